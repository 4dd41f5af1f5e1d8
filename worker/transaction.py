"""The transaction runner: ordinary handlers, exactly once, one transaction per unit of work.

A unit of work that holds one delivery runs the per-message statements and nothing
more::

    fresh session -> [redelivery: inbox fast path] -> insert marker -> handler
        -> [the adapter's own writes] -> one commit

Deliveries that were ready together (:mod:`worker.intake`) share one transaction
(group commit)::

    fresh session -> [keyed, PostgreSQL: the keys' locks, in one order]
        -> one multi-row marker insert (it reports which ids are new)
        -> ordinary handler: every new message in arrival order, then one flush
           batch handler: one call with every new message
        -> the adapter's writes for the committed messages -> one commit

The marker and the handler's writes commit together or not at all, so the database
picks the winner between two pumps holding the same message: the loser's unique
violation of the inbox constraint is a duplicate (a group's marker insert reports the
id as not new). Same-key deliveries of one group run one after another on its session:
the ORM's identity map hands the second credit the row the first one changed.

A group's messages first run with no savepoint of their own (the shared pass). When
one fails, the group runs again on a fresh session: without that message when the
failure was plainly its own (its handler raised; it is judged on that failure), else
with one SAVEPOINT per message, which keeps every failure to its own message. A
savepoint that lost to another writer (version conflict, deadlock, a row lock held
past a short bound, a rejection to record) defers its message: it runs on its own
right after the group's commit, and so does every later member of the group that
shares a lane with a message that did not commit, in arrival order, so that a key's or
a partition's messages still apply in order; a partition's record behind one that
failed is given back with it, uncounted. A whole-transaction failure (a batch handler
that raised, a failed flush or commit, a lost connection) retries the group once on
contention or connection loss, then every message runs on its own. Nothing is nacked
on the group's account: an innocent message is run again, its delivery count untouched.

Each phase (an attempt, a group, its retry, each message run on its own) tells the
adapter how long it may take (``Delivery.keep_alive``), so a watchdog follows it.
Every other ending is :class:`~worker.judge.Judge`'s to name.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from worker import inbox
from worker.context import BatchContext, Context, call_handler, guard
from worker.db import Failure, discard, from_database
from worker.delivery import in_commit
from worker.errors import DatabaseUnreachable, HandlerTimeout, Rejected, StatementSwallowed
from worker.judge import Again, cause_of, failure_of, refused_value
from worker.retry import backoff
from worker.verdict import COMMITTED, DUPLICATE, HELD_BACK, PAUSED, Verb, Verdict

if TYPE_CHECKING:
    from collections import Counter

    from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

    from worker.intake import Item, Lane, Work
    from worker.judge import Judge
    from worker.registry import Handler


@dataclass(slots=True, eq=False)
class Stage:
    """One handler over the live items of a unit of work: what a runner runs.

    ``last``: the type's last handler, whose commit carries the adapter's own writes
    (``Settler.in_commit``).
    """

    work: Work | None  # None: a group's member run again on its own
    handler: Handler[Any]
    items: list[Item]
    last: bool = True


ANSWERS = 1.0
"""Seconds a database that answers takes at most to answer a ping, or to cancel a
statement: an attempt that timed out while the database took longer (or whose
cancellation took longer) was stopped by the database, not by its handler."""
_RETRIED = (Failure.TRANSIENT, Failure.CONFLICT, Failure.CONNECTION)
"""Whole-transaction failures worth one more try of the same group."""
_DEFERRED = (Failure.TRANSIENT, Failure.CONFLICT, Failure.LOCKED)
"""A savepoint that lost to another writer: the message runs on its own after the commit."""
_WHOLE = (Failure.CONNECTION, Failure.SCHEMA)
"""A savepoint failure that is the transaction's, not the message's."""
# PostgreSQL, a group of ordinary handlers: it holds the rows it wrote until its commit,
# and two groups that write shared rows in different orders deadlock (found only after
# deadlock_timeout, 1 s by default). A handler statement therefore waits at most this
# long for a row another transaction holds; then that message runs again on its own
# after the commit (deferred, uncounted), where waiting is safe again. Transaction-local:
# the commit ends it.
_BOUND_LOCKS = text("SELECT set_config('lock_timeout', '50ms', true)")
# PostgreSQL, keyed handlers: the group's keys, locked in one order (by their hash, as
# every process computes it), so two processes' groups sharing keys queue, never deadlock.
_LOCK_KEYS = text(
    "SELECT count(pg_advisory_xact_lock(h)) FROM (SELECT DISTINCT "
    "hashtextextended('worker-key:' || k, 0) AS h FROM unnest(CAST(:keys AS text[])) AS k "
    "ORDER BY h OFFSET 0) AS ordered"
)


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


class TransactionRunner:
    """Runs an ordinary handler over a unit of work until each delivery commits, is a
    duplicate, or must be given back."""

    def __init__(
        self,
        engine: AsyncEngine,
        sessions: async_sessionmaker[Any],
        judge: Judge,
        stats: Counter[str],
        *,
        watches: bool = True,
        writes_in_commit: bool = True,
    ) -> None:
        guard(engine)
        self._watches = watches  # the broker's: does keep_alive or in_commit do anything
        self._writes_in_commit = writes_in_commit
        self.judge = judge
        self._attempts = judge.health.attempts
        self._committed_at = judge.committed_at
        self._stats = stats
        self._sessions = sessions
        self._postgres = engine.dialect.name == "postgresql"
        settings = judge.settings
        self._lock_timeout_ms = max(1, round(settings.marker_lock_timeout * 1000))
        self._fast_path = settings.fast_path
        self._timeout = settings.handler_timeout
        self._retry_budget = settings.retry_budget
        self._backoff = (settings.retry_backoff, settings.retry_backoff_max)
        # what one attempt may take: the handler, plus the longest backoff before the next
        self._phase = (self._timeout or 0.0) + settings.retry_backoff_max

    async def run(self, stage: Stage) -> list[Verdict]:
        """A verdict per item of the stage: one delivery on its own, or a group."""
        items = stage.items
        if len(items) > 1:
            return await self._group(stage)
        # One delivery: the per-message statements and nothing more.
        item, handler = items[0], stage.handler
        judge = self.judge
        delivery = item.delivery
        message = item.messages[handler.model]
        first = handler.inbox and not item.redelivered and (item.key is None or not self._postgres)
        attempts = self._attempts
        attempt = 0
        deadline = 0.0
        while True:
            attempt += 1
            if self._watches and self._timeout is not None:
                delivery.keep_alive(self._phase)
            session = self._sessions()
            watched = asyncio.timeout(None)  # cut by the database watch (worker.health)
            attempts.add(watched)
            ending: Verdict | Again | None = None
            try:
                async with watched:
                    if first:  # a first delivery's marker, straight in
                        marker = {"m": item.message_id, "c": handler.consumer}
                        await session.run_sync(inbox.MARK.run, marker)
                    elif await self._mark(session, item, handler):
                        await discard(session)
                        return [judge.duplicate(delivery, handler.consumer, attempt, "fast-path")]
                    context = _context(session, item, handler.consumer, attempt)
                    await call_handler(handler.func(context, message), self._timeout)
                    if stage.last and self._writes_in_commit:
                        await in_commit(session, (delivery,))
                    await AsyncSession.commit(session)
            except Exception as exc:
                error: Exception = exc
                if watched.expired() or (
                    isinstance(exc, HandlerTimeout)
                    and (exc.late > ANSWERS or not await judge.health.confirm(ANSWERS))
                ):
                    error = DatabaseUnreachable("the database stopped answering the attempt")
                # end the failed transaction first: on PostgreSQL it may still hold the
                # marker's key, which a replica racing for the same message waits on
                await discard(session)
                if attempt == 1:
                    deadline = time.monotonic() + self._retry_budget
                ending = await judge.ended(delivery, handler, attempt, error, deadline, session)
            except BaseException:  # cancelled (a shutdown past its grace): nothing settles
                await discard(session)
                raise
            finally:
                attempts.discard(watched)
            if ending is None:
                # Committed: the connection is back in the pool and nothing is left to
                # roll back, so the session is dropped unclosed (one greenlet hop less).
                self._stats["committed"] += 1
                self._committed_at[handler.consumer] = time.monotonic()
                return [COMMITTED]
            if isinstance(ending, Again):
                await asyncio.sleep(ending.delay)
                continue
            return [replace(ending, attempt=attempt)]

    async def one(self, item: Item, handler: Handler[Any], last: bool) -> Verdict:
        """One delivery on its own (a group's deferred member, or its fallback)."""
        verdicts = await self.run(Stage(None, handler, [item], last))
        return verdicts[0]

    async def _mark(self, session: AsyncSession, item: Item, handler: Handler[Any]) -> bool:
        """Insert the inbox marker; True instead when the fast path finds it there already.

        Only a redelivery can be a broker-made duplicate of finished work, so a first
        delivery goes straight to the insert. A keyed handler on PostgreSQL takes the key's
        advisory lock first, so other processes' writers of that key wait their turn.
        """
        message_id, consumer = item.message_id, handler.consumer
        key = None if item.key is None or not self._postgres else str(item.key)
        if not handler.inbox:
            if key is not None:
                await inbox.lock_key(session, key)
            return False
        if not item.redelivered:
            if key is None:
                await inbox.mark(session, message_id, consumer)
            else:
                await inbox.mark_keyed(session, message_id, consumer, key)
            return False
        if self._postgres:
            return await inbox.mark_redelivery(
                session,
                message_id,
                consumer,
                self._lock_timeout_ms,
                fast_path=self._fast_path,
                key=key,
            )
        if self._fast_path and await inbox.seen(session, message_id, consumer):
            return True
        await inbox.mark(session, message_id, consumer)
        return False

    # -- a group ------------------------------------------------------------------------

    async def _group(self, stage: Stage) -> list[Verdict]:
        """One transaction for the group, once more on contention, else each on its own."""
        handler, items = stage.handler, stage.items
        shared = handler.batch is None  # the happy path first (_shared)
        failed_alone: dict[int, Exception] = {}  # a message's own failure in a shared pass
        attempt, retried = 0, False
        log = self.judge.log
        # at most: a shared pass, one more without the message that failed in it, one with
        # savepoints, and one retry of a whole-transaction failure
        while attempt < 4:
            attempt += 1
            self._keep_alive(items)
            try:
                verdicts, deferred = await self._transaction(stage, attempt, shared, failed_alone)
            except _Isolate as exc:
                self._stats["batch-isolated"] += 1
                log.info(
                    "group again without the shared pass's failure",
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
                health = self.judge.health
                if failed.environment:
                    await health.pause_for(failed, cause_of(exc))
                if failed.environment or (
                    failed is Failure.CONNECTION and not await health.confirm()
                ):
                    self._stats["paused"] += len(items)
                    log.warning(
                        "paused",
                        consumer=handler.consumer,
                        size=len(items),
                        message_id=items[0].message_id,
                        attempt=attempt,
                        outcome="paused",
                        trouble=failed.value,
                        error=cause_of(exc),
                    )
                    return [replace(PAUSED, consumer=handler.consumer) for _ in items]
                if not retried and failed in _RETRIED:
                    retried = True
                    self._stats["batch-retried"] += 1
                    log.info(
                        "group retrying",
                        consumer=handler.consumer,
                        size=len(items),
                        failure=failed.value,
                        error=exc,
                    )
                    await asyncio.sleep(backoff(1, *self._backoff))
                    continue
                self._stats["batch-fallback"] += 1
                log.warning(
                    "group failed, one message at a time",
                    consumer=handler.consumer,
                    size=len(items),
                    attempt=attempt,
                    failure=failed.value,
                    error=exc,
                )
                break
            return await self._after(stage, verdicts, deferred)
        return await self._after(stage, {}, items)

    def _keep_alive(self, items: list[Item]) -> None:
        if self._watches and self._timeout is not None:
            for item in items:
                item.delivery.keep_alive(self._timeout)

    async def _after(
        self, stage: Stage, verdicts: dict[int, Verdict], deferred: list[Item]
    ) -> list[Verdict]:
        """The deferred members, each on its own after the group's commit, in arrival
        order; a record behind one of its group that did not commit is given back."""
        handler = stage.handler
        if deferred:
            failed: set[Lane] = set()
            later = {id(item): index for index, item in enumerate(deferred)}
            for item in stage.items:
                verdict = verdicts.get(id(item))
                index = later.get(id(item))
                if index is not None:
                    if any(lane in failed for lane in item.lanes):
                        verdict = HELD_BACK
                    else:  # a phase for it and for every one still waiting behind it
                        self._keep_alive(deferred[index:])
                        verdict = await self.one(item, handler, stage.last)
                    verdicts[id(item)] = verdict
                if verdict is not None and verdict.verb is not Verb.ACK:
                    failed.update(lane for lane in item.lanes if lane[0] == "group")
        return [verdicts[id(item)] for item in stage.items]

    async def _transaction(
        self, stage: Stage, attempt: int, shared: bool, failed_alone: dict[int, Exception]
    ) -> tuple[dict[int, Verdict], list[Item]]:
        """One transaction for the stage's handler over its items: a verdict per item that
        ended in it, and the deferred items (to run on their own after the commit).

        Raises on a whole-transaction failure; ``shared``: :class:`_Isolate` when a
        message of the shared pass failed. ``failed_alone``: items whose failure an
        earlier shared pass saw; judged on it.
        """
        handler, items = stage.handler, stage.items
        session = self._sessions()
        cut = asyncio.timeout(self._timeout)  # the handler timeout, or the database watch's
        self._attempts.add(cut)
        try:
            try:
                async with cut:
                    verdicts, deferred = await self._body(
                        session, stage, attempt, shared, failed_alone
                    )
            except TimeoutError as exc:
                late = asyncio.get_running_loop().time() - (cut.when() or 0.0)
                if late > ANSWERS or not await self.judge.health.confirm(ANSWERS):
                    raise DatabaseUnreachable("the database stopped answering the group") from exc
                raise HandlerTimeout(
                    f"group of {len(items)} ran longer than WORKER_HANDLER_TIMEOUT={self._timeout}s"
                ) from exc
            finally:
                self._attempts.discard(cut)
            committed = [item.delivery for item in items if verdicts.get(id(item)) is COMMITTED]
            if stage.last and committed and self._writes_in_commit:
                await in_commit(session, committed)
            await AsyncSession.commit(session)
        except BaseException:
            await discard(session)
            raise
        consumer = handler.consumer
        self._committed_at[consumer] = time.monotonic()
        stats = self._stats
        for item in items:
            verdict = verdicts.get(id(item))
            if verdict is COMMITTED:
                stats["committed"] += 1
            elif verdict is DUPLICATE:
                stats["duplicates-batch"] += 1
                self.judge.note(item.delivery, consumer, attempt, "duplicate")
        return verdicts, deferred

    async def _body(
        self,
        session: AsyncSession,
        stage: Stage,
        attempt: int,
        shared: bool,
        failed_alone: dict[int, Exception],
    ) -> tuple[dict[int, Verdict], list[Item]]:
        handler = stage.handler
        consumer = handler.consumer
        verdicts: dict[int, Verdict] = {}
        deferred: list[Item] = []
        items = self._prejudged(stage, attempt, failed_alone, verdicts, deferred)
        if self._postgres and handler.key is not None:
            keys = sorted({str(item.key) for item in items if item.key is not None})
            if keys:
                await session.execute(_LOCK_KEYS, {"keys": keys})
        if handler.inbox and items:  # first deliveries only (a redelivery runs alone)
            new = await inbox.mark_many(session, [item.message_id for item in items], consumer)
        else:
            new = {item.message_id for item in items}
        fresh = []
        for item in items:
            if item.message_id in new:
                fresh.append(item)
            else:
                verdicts[id(item)] = DUPLICATE
        if handler.batch is not None:
            await self._call_batch(session, handler, fresh, attempt)
            verdicts.update((id(item), COMMITTED) for item in fresh)
        elif fresh:
            if self._postgres:
                await session.execute(_BOUND_LOCKS)
            if shared:
                await self._shared(session, handler, fresh, attempt)
                verdicts.update((id(item), COMMITTED) for item in fresh)
            else:
                deferred.extend(await self._savepoints(session, handler, fresh, attempt, verdicts))
        return verdicts, deferred

    def _prejudged(
        self,
        stage: Stage,
        attempt: int,
        failed_alone: dict[int, Exception],
        verdicts: dict[int, Verdict],
        deferred: list[Item],
    ) -> list[Item]:
        """The items this transaction runs: not one a shared pass saw fail on its own
        (judged on that failure), nor one behind it in a lane (deferred)."""
        if not failed_alone:
            return stage.items
        items: list[Item] = []
        blocked: set[Lane] = set()  # lanes of a member that did not commit: the rest wait
        for item in stage.items:
            if blocked and any(lane in blocked for lane in item.lanes):
                deferred.append(item)
                blocked.update(item.lanes)
                continue
            error = failed_alone.get(id(item))
            if error is None:
                items.append(item)
                continue
            verdict = self._judge(item, stage.handler, attempt, error)
            if verdict is None:
                deferred.append(item)
            else:
                verdicts[id(item)] = verdict
            blocked.update(item.lanes)
        return items

    async def _call_batch(
        self, session: AsyncSession, handler: Handler[Any], items: list[Item], attempt: int
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
        messages = [item.messages[handler.model] for item in items]
        await call_handler(handler.batch(context, messages), None, "batch handler")

    async def _shared(
        self, session: AsyncSession, handler: Handler[Any], items: list[Item], attempt: int
    ) -> None:
        """An ordinary handler over the group with no savepoint per message: the happy path.

        A savepoint costs a SAVEPOINT and a RELEASE round trip and a flush per message,
        most of a group's cost. So the messages first run one after another in the
        group's transaction, with one flush at the end; any failure but the transaction's
        own raises :class:`_Isolate`, and the group runs again on a fresh session.
        """
        item = None
        try:
            for item in items:
                context = _context(session, item, handler.consumer, attempt)
                await call_handler(handler.func(context, item.messages[handler.model]), None)
            item = None
            await session.flush()  # inside the bounded row-lock wait, as a savepoint's is
        except Exception as exc:
            failed = failure_of(exc)
            if failed in _WHOLE or failed.environment:
                raise
            raise _Isolate(item if _own(exc) else None, exc) from exc

    async def _savepoints(
        self,
        session: AsyncSession,
        handler: Handler[Any],
        items: list[Item],
        attempt: int,
        verdicts: dict[int, Verdict],
    ) -> list[Item]:
        """Each message in a savepoint of its own: its failure rolls back only its writes
        and its marker. Returns the deferred: one that lost to another writer, and every
        later one sharing a lane with a message that did not commit."""
        deferred: list[Item] = []
        blocked: set[Lane] = set()
        for item in items:
            if blocked and any(lane in blocked for lane in item.lanes):
                verdict = None
            else:
                verdict = await self._savepoint(session, handler, item, attempt)
            if verdict is None:
                deferred.append(item)
            else:
                verdicts[id(item)] = verdict
            if verdict is not COMMITTED:
                blocked.update(item.lanes)
                if handler.inbox:
                    await inbox.unmark(session, item.message_id, handler.consumer)
        return deferred

    async def _savepoint(
        self, session: AsyncSession, handler: Handler[Any], item: Item, attempt: int
    ) -> Verdict | None:
        """An ordinary handler on one message inside a SAVEPOINT: its failure stays its
        own. None: deferred."""
        context = _context(session, item, handler.consumer, attempt)
        nested = await session.begin_nested()
        try:
            await call_handler(handler.func(context, item.messages[handler.model]), None)
            await nested.commit()  # flushes: a version conflict surfaces here, as its own
        except Exception as exc:
            # after a failed flush too (the savepoint is then inactive, not yet rolled back);
            # a failure of the rollback itself is the transaction's: it propagates
            await nested.rollback()
            return self._judge(item, handler, attempt, exc)
        return COMMITTED

    def _judge(
        self, item: Item, handler: Handler[Any], attempt: int, exc: Exception
    ) -> Verdict | None:
        """A message's own failure inside a group: its verdict, or None (deferred: it
        runs on its own after the commit), or re-raised (the transaction's failure)."""
        consumer = handler.consumer
        judge = self.judge
        verdict = judge.requested(item.delivery, consumer, attempt, exc)
        if verdict is not None:
            return verdict
        if isinstance(exc, Rejected):
            return None  # recorded by the per-message path, with its marker
        failed = failure_of(exc)
        if failed is Failure.DUPLICATE:  # not the group's marker: the handler's own insert
            failed = Failure.ERROR
        if failed in _DEFERRED:
            self._stats["batch-deferred"] += 1
            return None
        if failed in _WHOLE or failed.environment:
            raise exc
        if failed is Failure.DATA:
            return refused_value(consumer, cause_of(exc), attempt)
        return judge.failed(item.delivery, consumer, attempt, cause_of(exc))


def _context(session: AsyncSession, item: Item, consumer: str, attempt: int) -> Context:
    delivery = item.delivery
    return Context(
        session, item.message_id, consumer, delivery.delivery_count, attempt, delivery.headers
    )
