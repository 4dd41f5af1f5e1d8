"""The batch runner: one handler over many deliveries of one type, in one transaction.

With ``WORKER_BATCH_SIZE`` > 1, intake (:mod:`worker.intake`) fills buckets and
hands a full or ripe one out as one unit of work; for each handler of its type this
runner makes it one transaction::

    fresh session -> [keyed: the keys' advisory locks] -> one multi-row marker insert
        -> ordinary handler: every new message in arrival order, then one flush
           batch handler: one call with every new message
        -> the adapter's writes for the committed messages -> one commit

A bucket holds each key it has (a key belongs to one open batch at a time), so
same-key deliveries run in their batch one after another on the batch's session: the
ORM's identity map hands the second credit the row the first one changed, with no
conflict and no second read. Batches running at the same time hold disjoint keys and
never wait on each other's row locks.

An ordinary handler's messages first run with no savepoint of their own (the shared
pass: a SAVEPOINT, a RELEASE and a flush per message were most of a batch's cost).
When one of them fails, the batch runs again on a fresh session: without that message
when the failure was plainly its own (its handler raised; it is judged on that failure
and not run again), else with one SAVEPOINT per message, which keeps every failure to
its own message:

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
from worker.db import Failure, discard, from_database
from worker.delivery import in_commit
from worker.errors import HandlerTimeout, Rejected, StatementSwallowed
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


class _Isolate(Exception):
    """Something failed in the shared pass: ``item``, when it was that message's own
    failure (``error``); None when it cannot be told whose it was."""

    def __init__(self, item: Item | None, error: Exception) -> None:
        super().__init__(str(error))
        self.item = item
        self.error = error


def _own(exc: BaseException) -> bool:
    """Whether a handler's exception is plainly its message's own: nothing in its chain
    came from the database (a database error in a shared pass may be an earlier
    message's pending write, flushed late by this one's query)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, StatementSwallowed) or from_database(current):
            return False
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return True


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
        shared = handler.batch is None  # the happy path first (_shared)
        failed_alone: dict[int, Exception] = {}  # a message's own failure in a shared pass
        attempt, retried = 0, False
        # at most: a shared pass, one more without the message that failed in it, one with
        # savepoints, and one retry of a whole-transaction failure
        while attempt < 4:
            attempt += 1
            self._keep_alive(items, self._timeout)
            try:
                return await self._transaction(stage, attempt, shared, failed_alone)
            except _Isolate as exc:
                self.stats["batch-isolated"] += 1
                self.judge.log.info(
                    "batch again without the shared pass's failure",
                    consumer=handler.consumer,
                    size=len(items),
                    error=exc.__cause__,
                )
                if exc.item is not None and not failed_alone:
                    failed_alone[id(exc.item)] = exc.error  # judged, not run again
                else:
                    shared = False  # the second failure, or the flush's: a savepoint each
                continue
            except Exception as exc:
                failed = failure_of(exc)
                if failed is Failure.CONNECTION and not await self.endings.health.confirm():
                    return [PAUSED for _ in items]
                if failed.environment:
                    await self.endings.health.pause_for(failed, cause_of(exc))
                    return [PAUSED for _ in items]
                if not retried and failed in _RETRIED:
                    retried = True
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

    async def _transaction(
        self, stage: Stage, attempt: int, shared: bool, failed_alone: dict[int, Exception]
    ) -> list[Verdict]:
        """One transaction for the stage's handler over its items; a verdict per item.

        Raises on a whole-transaction failure, leaving every item's verdict to the caller;
        ``shared``: :class:`_Isolate` when a message of the shared pass failed.
        ``failed_alone``: items whose failure an earlier shared pass saw; judged on it.
        """
        handler, items = stage.handler, stage.items
        session: PumpSession = self._sessions()
        try:
            try:
                async with asyncio.timeout(self._timeout):
                    verdicts = await self._body(session, stage, attempt, shared, failed_alone)
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

    async def _body(
        self,
        session: PumpSession,
        stage: Stage,
        attempt: int,
        shared: bool,
        failed_alone: dict[int, Exception],
    ) -> list[Verdict]:
        handler, all_items = stage.handler, stage.items
        consumer = handler.consumer
        verdicts = self._judged(handler, all_items, attempt, failed_alone)
        items = [item for item in all_items if id(item) not in verdicts]
        if self._postgres and handler.key is not None:
            keys = sorted({str(item.key) for item in items if item.key is not None})
            if keys:
                await session.execute(_LOCK_KEYS, {"keys": keys})
        if handler.inbox and items:  # first deliveries only (a redelivery runs alone)
            new = await inbox.mark_many(session, [item.message_id for item in items], consumer)
        else:
            new = {item.message_id for item in items}
        verdicts.update((id(item), DUPLICATE) for item in items if item.message_id not in new)
        fresh = [item for item in items if item.message_id in new]
        if handler.batch is not None:
            await self._call_batch(session, handler, fresh, attempt)
            verdicts.update((id(item), COMMITTED) for item in fresh)
        elif fresh:
            previous = None
            if self._postgres:
                previous = (await session.execute(_BOUND_LOCKS, {"t": _ROW_LOCK_WAIT})).one()[0]
            if shared:
                await self._shared(session, handler, fresh, attempt)
                verdicts.update((id(item), COMMITTED) for item in fresh)
            else:
                verdicts.update(await self._savepoints(session, handler, fresh, attempt))
            if previous is not None:
                await session.execute(_RESTORE_LOCKS, {"t": previous})
        return [verdicts[id(item)] for item in all_items]

    def _judged(
        self,
        handler: Handler[Any],
        items: list[Item],
        attempt: int,
        failed_alone: dict[int, Exception],
    ) -> dict[int, Verdict]:
        """Verdicts for the items a shared pass saw fail on their own, from that failure."""
        verdicts: dict[int, Verdict] = {}
        for item in items:
            error = failed_alone.get(id(item))
            if error is None:
                continue
            try:
                verdicts[id(item)] = self._judge(item, handler, attempt, error)
            except _Defer:
                item.deferred = True
                verdicts[id(item)] = COMMITTED  # a placeholder: it runs again on its own
        return verdicts

    async def _savepoints(
        self, session: PumpSession, handler: Handler[Any], items: list[Item], attempt: int
    ) -> dict[int, Verdict]:
        """Each message in a savepoint of its own: its failure rolls back only its writes
        and its marker; one that lost to another writer is deferred."""
        verdicts: dict[int, Verdict] = {}
        for item in items:
            try:
                verdict = await self._savepoint(session, handler, item, attempt)
            except _Defer:
                item.deferred = True
                verdict = COMMITTED  # a placeholder: it runs again on its own
            verdicts[id(item)] = verdict
            if (item.deferred or verdict is not COMMITTED) and handler.inbox:
                await inbox.unmark(session, item.message_id, handler.consumer)
        return verdicts

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

    async def _shared(
        self, session: PumpSession, handler: Handler[Any], items: list[Item], attempt: int
    ) -> None:
        """An ordinary handler over the batch with no savepoint per message: the happy path.

        A savepoint costs a SAVEPOINT and a RELEASE round trip and a flush per message,
        most of a batched ORM handler's time. So the batch's messages first run one after
        another in the batch's transaction, with one flush at the end; any failure but the
        transaction's own raises :class:`_Isolate`, and the batch runs again on a fresh
        session with one savepoint per message, where each failure is judged as its own.
        """
        item = None
        try:
            for item in items:
                delivery = item.delivery
                context = Context(
                    session,
                    item.message_id,
                    handler.consumer,
                    delivery.delivery_count,
                    attempt,
                    delivery.headers,
                )
                await call_handler(handler.func(context, item.message(handler)), None)
            item = None
            await session.flush()  # inside the bounded row-lock wait, as a savepoint's is
        except Exception as exc:
            failed = failure_of(exc)
            if failed in _WHOLE or failed.environment:
                raise
            raise _Isolate(item if _own(exc) else None, exc) from exc

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
