"""The transaction runner: an ordinary handler on one delivery, exactly once.

One attempt is::

    fresh session -> [redelivery: inbox fast path] -> insert marker -> handler -> one commit

The marker and the handler's writes commit together or not at all, so the
database picks the winner between two pumps holding the same message: the loser's
unique violation of the inbox constraint is a duplicate. Contention retries on a
fresh session within ``WORKER_RETRY_BUDGET``; every other ending is the
:class:`~worker.judge.Judge`'s to name.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from worker import inbox
from worker.db import HANDLER_RUNNING, HandlerRun, discard
from worker.errors import HandlerTimeout
from worker.registry import Context
from worker.verdict import COMMITTED

if TYPE_CHECKING:
    from pydantic import BaseModel

    from worker.db import PumpSession
    from worker.delivery import Delivery
    from worker.judge import Judge
    from worker.registry import Handler
    from worker.verdict import Verdict


class TransactionRunner:
    """Runs a handler until it commits, is a duplicate, or must give the delivery back."""

    def __init__(self, sessions: async_sessionmaker[Any], judge: Judge, *, postgres: bool) -> None:
        self.judge = judge
        self._sessions = sessions
        self._postgres = postgres
        settings = judge.settings
        self._lock_timeout_ms = max(1, round(settings.marker_lock_timeout * 1000))
        self._fast_path = settings.fast_path
        self._timeout = settings.handler_timeout
        self._retry_budget = settings.retry_budget

    async def run(self, delivery: Delivery, handler: Handler[Any], message: BaseModel) -> Verdict:
        judge = self.judge
        message_id = delivery.message_id
        assert message_id is not None
        consumer = handler.consumer
        timeout = self._timeout
        attempt = 0
        deadline = 0.0
        while True:
            attempt += 1
            session: PumpSession = self._sessions()
            spent = True
            try:
                if await self._mark(session, delivery, handler, message):
                    return judge.duplicate(delivery, consumer, attempt, "fast-path")
                context = Context(
                    session,
                    message_id,
                    consumer,
                    delivery.delivery_count,
                    attempt,
                    delivery.headers,
                )
                run = HandlerRun()
                running = HANDLER_RUNNING.set(run)
                try:  # inline, not a wrapper coroutine: every resume of the handler skips a frame
                    async with asyncio.timeout(timeout):
                        await handler.func(context, message)
                except TimeoutError as exc:
                    if timeout is None:
                        raise
                    raise _overran(timeout) from exc
                finally:
                    HANDLER_RUNNING.reset(running)
                run.refuse_swallowed()
                if delivery.in_transaction is not None:
                    await delivery.in_transaction(session)
                await AsyncSession.commit(session)
                # Committed: the connection is back in the pool and nothing is left to
                # roll back, so the session is dropped unclosed (one greenlet hop less).
                spent = False
                judge.note(delivery, consumer, attempt, "committed")
                return COMMITTED
            except Exception as exc:
                verdict = judge.requested(delivery, consumer, attempt, exc)
                if verdict is not None:
                    return verdict
                if attempt == 1:
                    deadline = time.monotonic() + self._retry_budget
                verdict = await judge.after_failure(
                    delivery, handler, attempt, deadline, session, exc
                )
                if verdict is not None:
                    return replace(verdict, attempt=attempt)
            finally:
                if spent:
                    await discard(session)

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


def _overran(seconds: float) -> HandlerTimeout:
    return HandlerTimeout(f"handler ran longer than WORKER_HANDLER_TIMEOUT={seconds}s")
