"""The batch runner: one handler over many deliveries of one type, in one transaction.

With ``WORKER_BATCH_SIZE`` > 1, intake (:mod:`worker.intake`) fills buckets and
hands a full or ripe one out as one unit of work; for each handler of its type this
runner makes it one transaction::

    fresh session -> [keyed: the keys' advisory locks] -> one multi-row marker insert
        -> ordinary handler: one SAVEPOINT per new message, in arrival order
           batch handler: one call with every new message
        -> the adapter's writes for the committed messages -> one commit

A bucket holds each key it has (a key belongs to one open batch at a time), so
same-key deliveries run in their batch one after another, each in its own savepoint
on the batch's session: the ORM's identity map hands the second credit the row the
first one changed, with no conflict and no second read. Batches running at the same
time hold disjoint keys and never wait on each other's row locks.

What may not share a transaction never does:

- the same id twice in one batch: intake makes the second a twin of the first,
  acked as its duplicate once the first is done (or run on its own when it was not);
- a message whose savepoint fails on its own (an exception, a business unique
  violation, ``Poison``): its writes and its marker are rolled back, the rest commit;
- a savepoint that lost to another writer (version conflict, deadlock, a marker in
  progress elsewhere, a rejection to record): deferred, it runs again on its own
  after the commit;
- a failed batch handler, a failed flush or commit, a lost connection: a whole-
  transaction failure. Contention and connection loss retry the batch once; then,
  as for every other such failure, each message runs on its own through the
  transaction runner, spending no delivery count of a message that did nothing wrong.

Each phase (the transaction, its retry, each message of the fallback) tells the
adapter how long it may take (``Delivery.keep_alive``), so a watchdog follows what
the batch is doing.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from worker import inbox
from worker.calling import call_handler
from worker.context import BatchContext, Context
from worker.db import Failure, discard
from worker.delivery import in_commit
from worker.errors import HandlerTimeout, Rejected
from worker.judge import cause_of, failure_of, refused_value
from worker.retry import backoff
from worker.verdict import COMMITTED, DUPLICATE, PAUSED, Verdict

if TYPE_CHECKING:
    from collections import Counter

    from worker.db import PumpSession
    from worker.endings import Endings
    from worker.registry import Handler
    from worker.transaction import TransactionRunner
    from worker.work import Item, Stage

_RETRIED = (Failure.TRANSIENT, Failure.CONFLICT, Failure.CONNECTION)
"""Whole-transaction failures worth one more try of the same batch."""
_DEFERRED = (Failure.TRANSIENT, Failure.CONFLICT, Failure.LOCKED)
"""A savepoint that lost to another writer: the message runs on its own after the commit."""
_WHOLE = (Failure.CONNECTION, Failure.SCHEMA)
"""A savepoint failure that is the transaction's, not the message's."""
# PostgreSQL, ordinary handlers in savepoints: a batch holds the rows it wrote until its
# commit, and two batches that write shared rows in different orders deadlock (found only
# after deadlock_timeout, 1 s by default). A handler statement therefore waits at most this
# long for a row another transaction holds; then that message runs again on its own after
# the commit (deferred, uncounted), where waiting is safe again.
_ROW_LOCK_WAIT = "50ms"
_BOUND_LOCKS = text(
    "WITH previous AS MATERIALIZED (SELECT current_setting('lock_timeout') AS value) "
    "SELECT previous.value, set_config('lock_timeout', :t, true) FROM previous"
)
_RESTORE_LOCKS = text("SELECT set_config('lock_timeout', :t, true)")
# PostgreSQL, keyed handlers: the batch's keys, locked in one order (by their hash, as
# every process computes it), so two processes' batches sharing keys queue, never deadlock.
_LOCK_KEYS = text(
    "SELECT count(pg_advisory_xact_lock(h)) FROM (SELECT DISTINCT "
    "hashtextextended('worker-key:' || k, 0) AS h FROM unnest(CAST(:keys AS text[])) AS k "
    "ORDER BY h OFFSET 0) AS ordered"
)


class _Defer(Exception):
    """A savepoint lost to another writer: run this message on its own after the commit."""


class BatchRunner:
    """One handler over a batch's items: a transaction, once more on contention, else
    each on its own through the transaction runner."""

    def __init__(
        self,
        sessions: async_sessionmaker[Any],
        endings: Endings,
        single: TransactionRunner,
        stats: Counter[str],
        *,
        postgres: bool,
    ) -> None:
        self.endings = endings
        self.judge = endings.judge
        self.single = single
        self.stats = stats
        self._sessions = sessions
        self._postgres = postgres
        settings = endings.judge.settings
        self._timeout = settings.handler_timeout
        self._backoff = (settings.retry_backoff, settings.retry_backoff_max)

    async def run(self, stage: Stage) -> list[Verdict]:
        handler, items = stage.handler, stage.items
        for attempt in (1, 2):
            self._keep_alive(items, self._timeout)
            try:
                return await self._transaction(stage, attempt)
            except Exception as exc:
                failed = failure_of(exc)
                if failed is Failure.CONNECTION and not await self.endings.health.confirm():
                    return [PAUSED for _ in items]
                if failed.environment:
                    await self.endings.health.pause_for(failed, cause_of(exc))
                    return [PAUSED for _ in items]
                if attempt == 1 and failed in _RETRIED:
                    self.stats["batch-retried"] += 1
                    self.judge.log.info(
                        "batch retrying",
                        consumer=handler.consumer,
                        size=len(items),
                        failure=failed.value,
                        error=exc,
                    )
                    await asyncio.sleep(backoff(1, *self._backoff))
                    continue
                self.stats["batch-fallback"] += 1
                self.judge.log.warning(
                    "batch failed, one message at a time",
                    consumer=handler.consumer,
                    size=len(items),
                    attempt=attempt,
                    failure=failed.value,
                    error=exc,
                )
                break
        return await self._one_by_one(stage)

    def _keep_alive(self, items: list[Item], seconds: float | None) -> None:
        if seconds is not None:
            for item in items:
                item.delivery.keep_alive(seconds)

    async def _one_by_one(self, stage: Stage) -> list[Verdict]:
        """The transaction runner, for each item on its own (batch handlers get a list of one)."""
        verdicts = []
        for index, item in enumerate(stage.items):
            self._keep_alive(stage.items[index:], self._timeout)
            verdicts.append(
                await self.single.one(
                    item.delivery, stage.handler, item.message(stage.handler), stage.last
                )
            )
        return verdicts

    async def _transaction(self, stage: Stage, attempt: int) -> list[Verdict]:
        """One transaction for the stage's handler over its items; a verdict per item.

        Raises on a whole-transaction failure, leaving every item's verdict to the caller.
        """
        handler, items = stage.handler, stage.items
        session: PumpSession = self._sessions()
        try:
            try:
                async with asyncio.timeout(self._timeout):
                    verdicts = await self._body(session, stage, attempt)
            except TimeoutError as exc:
                raise HandlerTimeout(
                    f"batch of {len(items)} ran longer than WORKER_HANDLER_TIMEOUT={self._timeout}s"
                ) from exc
            committed = [
                item.delivery
                for item, verdict in zip(items, verdicts, strict=True)
                if verdict is COMMITTED and not item.deferred
            ]
            if stage.last and committed:
                await in_commit(session, committed)
            await AsyncSession.commit(session)
        except BaseException:
            await discard(session)
            for item in items:
                item.deferred = False
            raise
        self.judge.committed(handler.consumer)
        for item, verdict in zip(items, verdicts, strict=True):
            if item.deferred or (verdict is not COMMITTED and verdict is not DUPLICATE):
                continue  # a failed savepoint was noted when it was judged
            if verdict is DUPLICATE:
                self.stats["duplicates-batch"] += 1
            self.judge.note(item.delivery, handler.consumer, attempt, verdict.outcome.value)
        return verdicts

    async def _body(self, session: PumpSession, stage: Stage, attempt: int) -> list[Verdict]:
        handler, items = stage.handler, stage.items
        consumer = handler.consumer
        if self._postgres and handler.key is not None:
            keys = sorted({str(item.key) for item in items if item.key is not None})
            if keys:
                await session.execute(_LOCK_KEYS, {"keys": keys})
        if handler.inbox:  # first deliveries only (a redelivery runs alone): they may wait
            new = await inbox.mark_many(session, [item.message_id for item in items], consumer)
        else:
            new = {item.message_id for item in items}
        verdicts: dict[int, Verdict] = {
            id(item): DUPLICATE for item in items if item.message_id not in new
        }
        fresh = [item for item in items if item.message_id in new]
        if handler.batch is not None:
            await self._call_batch(session, handler, fresh, attempt)
            verdicts.update((id(item), COMMITTED) for item in fresh)
        elif fresh:
            previous = None
            if self._postgres:
                previous = (await session.execute(_BOUND_LOCKS, {"t": _ROW_LOCK_WAIT})).one()[0]
            for item in fresh:
                try:
                    verdicts[id(item)] = await self._savepoint(session, handler, item, attempt)
                except _Defer:
                    item.deferred = True
                    verdicts[id(item)] = COMMITTED  # a placeholder: it runs again on its own
                    if handler.inbox:
                        await inbox.unmark(session, item.message_id, consumer)
                    continue
                if verdicts[id(item)] is not COMMITTED and handler.inbox:
                    await inbox.unmark(session, item.message_id, consumer)
            if previous is not None:
                await session.execute(_RESTORE_LOCKS, {"t": previous})
        return [verdicts[id(item)] for item in items]

    async def _call_batch(
        self, session: PumpSession, handler: Handler[Any], items: list[Item], attempt: int
    ) -> None:
        if not items:
            return
        assert handler.batch is not None
        context = BatchContext(
            session,
            handler.consumer,
            attempt,
            [item.message_id for item in items],
            [item.delivery.delivery_count for item in items],
            [item.delivery.headers for item in items],
        )
        messages = [item.message(handler) for item in items]
        await call_handler(handler.batch(context, messages), None, "batch handler")

    async def _savepoint(
        self, session: PumpSession, handler: Handler[Any], item: Item, attempt: int
    ) -> Verdict:
        """An ordinary handler on one message inside a SAVEPOINT: its failure stays its own."""
        delivery = item.delivery
        context = Context(
            session,
            item.message_id,
            handler.consumer,
            delivery.delivery_count,
            attempt,
            delivery.headers,
        )
        nested = await session.begin_nested()
        try:
            await call_handler(handler.func(context, item.message(handler)), None)
            await nested.commit()  # flushes: a version conflict surfaces here, as its own
        except Exception as exc:
            # after a failed flush too (the savepoint is then inactive, not yet rolled back);
            # a failure of the rollback itself is the transaction's: it propagates
            await nested.rollback()
            return self._judge(item, handler, attempt, exc)
        return COMMITTED

    def _judge(self, item: Item, handler: Handler[Any], attempt: int, exc: Exception) -> Verdict:
        """A savepoint's failure: a verdict for this message alone, or _Defer, or re-raised."""
        consumer = handler.consumer
        judge = self.judge
        verdict = judge.requested(item.delivery, consumer, attempt, exc)
        if verdict is not None:
            return verdict
        if isinstance(exc, Rejected):
            raise _Defer from exc  # recorded by the transaction runner, with its marker
        failed = failure_of(exc)
        if failed is Failure.DUPLICATE:  # not the batch's marker: the handler's own insert
            failed = Failure.ERROR
        if failed in _DEFERRED:
            self.stats["batch-deferred"] += 1
            raise _Defer from exc
        if failed in _WHOLE or failed.environment:
            raise exc
        if failed is Failure.DATA:
            return refused_value(consumer, cause_of(exc), attempt)
        return judge.failed(item.delivery, consumer, attempt, cause_of(exc))
