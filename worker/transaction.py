"""The transaction runner: an ordinary handler on one delivery, exactly once.

One attempt is::

    fresh session -> [redelivery: inbox fast path] -> insert marker -> handler
        -> [the adapter's own writes] -> one commit

The marker and the handler's writes commit together or not at all, so the
database picks the winner between two pumps holding the same message: the loser's
unique violation of the inbox constraint is a duplicate. Contention retries on a
fresh session within ``WORKER_RETRY_BUDGET``; every other ending is
:class:`~worker.endings.Endings`' to name.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from worker import inbox
from worker.calling import call_handler
from worker.context import Context
from worker.db import discard
from worker.delivery import in_commit
from worker.judge import Again
from worker.verdict import COMMITTED

if TYPE_CHECKING:
    from pydantic import BaseModel

    from worker.db import PumpSession
    from worker.delivery import Delivery
    from worker.endings import Endings
    from worker.registry import Handler
    from worker.verdict import Verdict
    from worker.work import Stage


class TransactionRunner:
    """Runs a handler until it commits, is a duplicate, or must give the delivery back."""

    def __init__(
        self, sessions: async_sessionmaker[Any], endings: Endings, *, postgres: bool
    ) -> None:
        self.endings = endings
        self.judge = judge = endings.judge
        self._sessions = sessions
        self._postgres = postgres
        settings = judge.settings
        self._lock_timeout_ms = max(1, round(settings.marker_lock_timeout * 1000))
        self._fast_path = settings.fast_path
        self._timeout = settings.handler_timeout
        self._retry_budget = settings.retry_budget
        # what one attempt may take: the handler, plus the longest backoff before the next
        self._phase = (self._timeout or 0.0) + settings.retry_backoff_max

    async def run(self, stage: Stage) -> list[Verdict]:
        return [
            await self.one(item.delivery, stage.handler, item.message(stage.handler), stage.last)
            for item in stage.items
        ]

    async def one(
        self, delivery: Delivery, handler: Handler[Any], message: BaseModel, last: bool = True
    ) -> Verdict:
        """``last``: the type's last handler, whose commit carries the adapter's writes."""
        judge = self.judge
        message_id = delivery.message_id
        assert message_id is not None
        consumer = handler.consumer
        attempt = 0
        deadline = 0.0
        while True:
            attempt += 1
            if self._timeout is not None:
                delivery.keep_alive(self._phase)
            session: PumpSession = self._sessions()
            try:
                if await self._mark(session, delivery, handler, message):
                    await discard(session)
                    return judge.duplicate(delivery, consumer, attempt, "fast-path")
                context = Context(
                    session,
                    message_id,
                    consumer,
                    delivery.delivery_count,
                    attempt,
                    delivery.headers,
                )
                await call_handler(handler.func(context, message), self._timeout)
                if last:
                    await in_commit(session, [delivery])
                await AsyncSession.commit(session)
            except Exception as exc:
                # end the failed transaction first: on PostgreSQL it may still hold the
                # marker's key, which a replica racing for the same message waits on
                await discard(session)
                if attempt == 1:
                    deadline = time.monotonic() + self._retry_budget
                ending = await self.endings.ended(
                    delivery, handler, attempt, exc, deadline, session
                )
            except BaseException:  # cancelled (a shutdown past its grace): nothing settles
                await discard(session)
                raise
            else:
                # Committed: the connection is back in the pool and nothing is left to
                # roll back, so the session is dropped unclosed (one greenlet hop less).
                judge.committed(consumer)
                judge.note(delivery, consumer, attempt, "committed")
                return COMMITTED
            if isinstance(ending, Again):
                await asyncio.sleep(ending.delay)
                continue
            return replace(ending, attempt=attempt)

    async def _mark(
        self, session: PumpSession, delivery: Delivery, handler: Handler[Any], message: BaseModel
    ) -> bool:
        """Insert the inbox marker; True instead when the fast path finds it there already.

        Only a redelivery can be a broker-made duplicate of finished work, so a first
        delivery goes straight to the insert. A keyed handler on PostgreSQL takes the key's
        advisory lock first, so other processes' writers of that key wait their turn.
        """
        message_id = delivery.message_id
        assert message_id is not None
        consumer = handler.consumer
        key = None if handler.key is None or not self._postgres else handler.key(message)
        if not handler.inbox:
            if key is not None:
                await inbox.lock_key(session, str(key))
            return False
        if not delivery.redelivered:
            if key is None:
                await inbox.mark(session, message_id, consumer)
            else:
                await inbox.mark_keyed(session, message_id, consumer, str(key))
            return False
        if self._postgres:
            return await inbox.mark_redelivery(
                session,
                message_id,
                consumer,
                self._lock_timeout_ms,
                fast_path=self._fast_path,
                key=None if key is None else str(key),
            )
        if self._fast_path and await inbox.seen(session, message_id, consumer):
            return True
        await inbox.mark(session, message_id, consumer)
        return False
