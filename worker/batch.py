"""Batch mode: many deliveries of one message type, one transaction, still exactly once.

With ``WORKER_BATCH_SIZE`` > 1 the pump runs this instead of one delivery per worker.
One intake task takes deliveries from the broker and sorts them into buckets by
(message type, ``delivery.group``), in receive order; a bucket is released to the
workers when it is full or its oldest delivery has waited ``WORKER_BATCH_WAIT``.
For each handler of the type, a batch is one transaction::

    fresh session -> one multi-row marker insert (reports the new ids)
        -> ordinary handler: one SAVEPOINT per new message
           batch handler: one call with every new message
        -> every committed delivery's in_transaction hook -> one commit

then each delivery is settled on its own, as the per-message table in
:mod:`worker.pump` says. What may not share a transaction never does:

- the same id twice in one batch: one runs, the other is acked as its duplicate
  once the first is done (or runs on its own when the first was not);
- a message whose savepoint fails on its own (an exception, a business unique
  violation, ``Poison``): its writes and its marker are rolled back, the rest commit;
- a savepoint that lost to another writer (version conflict, deadlock, a marker in
  progress elsewhere, a rejection to record): run again on its own after the commit;
- a failed batch handler, a failed flush or commit, a lost connection: a whole-
  transaction failure. Contention and connection loss retry the batch once; then,
  as for every other such failure, each message runs on its own through the
  per-message path, spending no delivery count of a message that did nothing wrong.

Side-effect claims and keyed handlers never share a transaction: their types, and
deliveries that need the per-message path's care (no id, undecodable, past
WORKER_MAX_DELIVERIES, counted in the database by WORKER_DELIVERY_COUNTS=database),
run one at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from worker import attempts, inbox, metrics
from worker.db import HANDLER_RUNNING, Failure, HandlerRun, classify, discard
from worker.delivery import Delivery, ack_many
from worker.errors import AlreadySettled, HandlerTimeout, Rejected, StatementSwallowed
from worker.judge import refused_value
from worker.registry import BatchContext, Context, Handler
from worker.retry import backoff
from worker.verdict import COMMITTED, DUPLICATE, PAUSED, UNEXPECTED, Outcome, Verb, Verdict

if TYPE_CHECKING:
    from worker.db import PumpSession
    from worker.pump import Pump

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

BatchKey = tuple[str | None, Hashable]


class _Item:
    """One delivery in a batch: its decoded messages and where its handlers left it."""

    __slots__ = ("consumer", "decoded", "deferred", "delivery", "twins", "verdict")

    def __init__(self, delivery: Delivery, decoded: dict[type[BaseModel], BaseModel]) -> None:
        self.delivery = delivery
        self.decoded = decoded
        self.verdict = COMMITTED
        self.consumer: str | None = None
        self.twins: list[Delivery] = []  # later deliveries of the same id in this batch
        self.deferred = False  # lost to another writer: runs on its own after the batch

    @property
    def message_id(self) -> str:
        assert self.delivery.message_id is not None
        return self.delivery.message_id


class _Defer(Exception):
    """A savepoint lost to another writer: run this message on its own after the commit."""


class BatchRunner:
    """The batch-mode intake and workers of one :class:`~worker.pump.Pump`.

    A part of the pump in a module of its own: it shares the pump's state (held and
    idle deliveries, sessions, health) and its per-message path, and changes neither.
    """

    def __init__(self, pump: Pump) -> None:
        self.pump = pump
        self.size = pump.settings.batch_size
        self.wait = pump.settings.batch_wait
        self._postgres = pump.engine.dialect.name == "postgresql"
        self._buckets: dict[BatchKey, tuple[float, deque[Delivery]]] = {}
        # released batches, and whether they are (False: one delivery, the per-message path)
        self._ready: asyncio.Queue[tuple[list[Delivery], bool]] = asyncio.Queue()
        # per delivery group: released batches waiting behind the one running for the group
        self._lanes: dict[Hashable, deque[tuple[list[Delivery], bool]]] = {}
        self._batchable = {
            message_type: all(h.batchable for h in pump.registry.for_type(message_type))
            for message_type in pump.registry.message_types
        }

    # -- intake -------------------------------------------------------------------

    def key(self, delivery: Delivery) -> BatchKey | None:
        """The bucket a delivery may share a batch in, or None: it runs on its own."""
        if not self._batchable.get(delivery.type or "", False):
            return None
        message_id = delivery.message_id
        if message_id is None or len(message_id) > inbox.MESSAGE_ID_LENGTH:
            return None
        settings = self.pump.settings
        if delivery.delivery_count > settings.max_deliveries:
            return None
        if attempts.wanted(delivery, settings):  # counted in the database, by the pump's path
            return None
        if delivery.redelivered:  # a suspect (it may have killed its last batch): alone
            return None
        return delivery.type, delivery.group

    async def intake(self) -> None:
        """Receive, sort into buckets, release full or ripe ones; the only broker reader."""
        pump = self.pump
        while not pump._stop.is_set():
            await pump.health.wait_available()
            self._release_ripe(time.monotonic())
            timeout = self._next_deadline()
            try:
                async with asyncio.timeout(timeout):
                    delivery = await pump.broker.receive()
            except TimeoutError:
                continue
            except Exception as exc:  # an adapter bug must not silently stop the intake
                pump._log.error("receive failed", error=exc)
                await asyncio.sleep(1.0)
                continue
            pump._held.add(delivery)
            key = self.key(delivery)
            if key is None:
                self._ready.put_nowait(([delivery], False))
                continue
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = (time.monotonic() + self.wait, deque())
            bucket[1].append(delivery)
            if len(bucket[1]) >= self.size:
                del self._buckets[key]
                self._ready.put_nowait((list(bucket[1]), True))

    def _next_deadline(self) -> float | None:
        if not self._buckets:
            return None
        earliest = min(deadline for deadline, _ in self._buckets.values())
        return max(0.0, earliest - time.monotonic())

    def _release_ripe(self, now: float) -> None:
        for key in [k for k, (deadline, _) in self._buckets.items() if deadline <= now]:
            _, deliveries = self._buckets.pop(key)
            self._ready.put_nowait((list(deliveries), True))

    async def work(self) -> None:
        """One worker: take a released batch, run it, settle every delivery in it.

        Work of one delivery group (a Kafka partition) runs one batch at a time, in
        release order: a batch released while its group's previous one still runs
        waits in the group's lane, and this worker moves on.
        """
        pump = self.pump
        task = asyncio.current_task()
        assert task is not None
        while not pump._stop.is_set():
            pump._idle.add(task)
            released = await self._ready.get()
            pump._idle.discard(task)  # from here on, shutdown waits for this batch
            group = released[0][0].group
            if group is None:
                await self._run_released(released)
                continue
            lane = self._lanes.get(group)
            if lane is not None:  # the group is busy: its worker runs this one next
                lane.append(released)
                continue
            lane = self._lanes[group] = deque()
            try:
                await self._run_released(released)
                while lane:
                    if pump._stop.is_set():  # what still waits is given back by the pump
                        break
                    await self._run_released(lane.popleft())
            finally:
                del self._lanes[group]

    async def _run_released(self, released: tuple[list[Delivery], bool]) -> None:
        deliveries, batchable = released
        pump = self.pump
        if not pump.health.available:  # hold the batch while the database is away
            await pump.health.wait_available()
        if batchable:  # a batch of one too: the same path whatever the load
            await self._guarded(deliveries)
        else:
            await pump._one(deliveries[0])

    # -- one batch ----------------------------------------------------------------

    async def _guarded(self, deliveries: list[Delivery]) -> None:
        """Run one batch; whatever goes wrong, each delivery ends settled or logged loudly."""
        pump = self.pump
        pump.in_flight += len(deliveries)
        try:
            await self._run(deliveries)
        except AlreadySettled as exc:  # a bug in the pump or an adapter: never a success
            pump.stats["settled-twice"] += 1
            pump._log.error("bug: delivery settled twice", outcome="settled-twice", error=exc)
        except Exception:  # the pump must outlive any bug in a handler or adapter
            pump._log.exception("unexpected error in a batch", attempt=0, outcome="nacked")
            for delivery in deliveries:
                if delivery.settled is None:
                    await pump._settle_guarded(delivery, UNEXPECTED)
        finally:
            pump.in_flight -= len(deliveries)
            for delivery in deliveries:
                if delivery.settled is not None:
                    pump._held.discard(delivery)

    async def _run(self, deliveries: list[Delivery]) -> None:
        items, singles = self._prepare(deliveries)
        handlers = self.pump.registry.for_type(deliveries[0].type)
        stores = {item: item.delivery.in_transaction for item in items}
        live = items
        for handler in handlers:
            # the adapter's part (Kafka: the offset) goes with the last handler's commit
            for item in live:
                item.delivery.in_transaction = stores[item] if handler is handlers[-1] else None
            await self._stage(handler, live)
            live = [item for item in live if item.verdict.verb is Verb.ACK and not item.deferred]
            if not live:
                break
        for item, store in stores.items():
            item.delivery.in_transaction = store
        await self._settle([item for item in items if not item.deferred])
        # then, each on its own: messages that lost to another writer inside the batch (their
        # earlier handlers' markers make those duplicates), their twins, undecodable ones
        for item in items:
            if item.deferred:
                singles = [item.delivery, *item.twins, *singles]
        for delivery in singles:
            if delivery.settled is None:
                await self.pump._one(delivery)

    def _prepare(self, deliveries: list[Delivery]) -> tuple[list[_Item], list[Delivery]]:
        """Decode each delivery once per model; set twins and undecodable ones aside."""
        handlers = self.pump.registry.for_type(deliveries[0].type)
        items: dict[str, _Item] = {}
        singles: list[Delivery] = []
        for delivery in deliveries:
            assert delivery.message_id is not None
            first = items.get(delivery.message_id)
            if first is not None:
                first.twins.append(delivery)
                continue
            decoded: dict[type[BaseModel], BaseModel] = {}
            try:
                for handler in handlers:
                    if handler.model not in decoded:
                        decoded[handler.model] = handler.model.model_validate_json(delivery.body)
            except ValidationError:
                singles.append(delivery)  # the per-message path dead-letters it, with the reason
                continue
            items[delivery.message_id] = _Item(delivery, decoded)
        return list(items.values()), singles

    async def _stage(self, handler: Handler[Any], items: list[_Item]) -> None:
        """One handler over the batch: a transaction, once more on contention, else one by one."""
        pump = self.pump
        started = time.perf_counter()
        for attempt in (1, 2):
            try:
                deferred = await self._transaction(handler, items, attempt)
            except Exception as exc:
                failure = classify(_cause(exc))
                if failure is Failure.CONNECTION and not await pump.health.confirm():
                    for item in items:
                        item.verdict, item.consumer = PAUSED, handler.consumer
                    return
                if attempt == 1 and failure in _RETRIED:
                    pump.stats["batch-retried"] += 1
                    pump._log.info(
                        "batch retrying",
                        consumer=handler.consumer,
                        size=len(items),
                        failure=failure.value,
                        error=exc,
                    )
                    settings = pump.settings
                    await asyncio.sleep(
                        backoff(1, settings.retry_backoff, settings.retry_backoff_max)
                    )
                    continue
                pump.stats["batch-fallback"] += 1
                pump._log.warning(
                    "batch failed, one message at a time",
                    consumer=handler.consumer,
                    size=len(items),
                    attempt=attempt,
                    failure=failure.value,
                    error=exc,
                )
                await self._one_by_one(handler, items)
                return
            break
        elapsed = (time.perf_counter() - started) / max(len(items), 1)
        for _ in items:
            metrics.observe_handler(handler.consumer, elapsed)
        for item in deferred:
            item.deferred = True

    async def _one_by_one(self, handler: Handler[Any], items: list[_Item]) -> None:
        """The per-message path, for each item on its own (batch handlers get a list of one)."""
        for item in items:
            item.verdict = await self.pump._consume_observed(
                item.delivery, handler, item.decoded[handler.model]
            )
            item.consumer = handler.consumer

    async def _transaction(
        self, handler: Handler[Any], items: list[_Item], attempt: int
    ) -> list[_Item]:
        """One transaction for ``handler`` over ``items``; returns the items to run on their own.

        Raises on a whole-transaction failure, leaving every item's verdict to the caller.
        """
        pump = self.pump
        session: PumpSession = pump._sessions()
        spent = True
        timeout = pump.settings.handler_timeout
        try:
            try:
                async with asyncio.timeout(timeout):
                    verdicts, deferred = await self._body(session, handler, items, attempt)
            except TimeoutError as exc:
                raise HandlerTimeout(
                    f"batch of {len(items)} ran longer than WORKER_HANDLER_TIMEOUT={timeout}s"
                ) from exc
            await AsyncSession.commit(session)
            spent = False
        finally:
            if spent:
                await discard(session)
        for item, verdict in verdicts.items():
            item.verdict, item.consumer = verdict, handler.consumer
            self._tally(item, handler.consumer, attempt)
        return deferred

    async def _body(
        self, session: PumpSession, handler: Handler[Any], items: list[_Item], attempt: int
    ) -> tuple[dict[_Item, Verdict], list[_Item]]:
        consumer = handler.consumer
        if handler.inbox:  # first deliveries only (a redelivery runs alone): they may wait
            new = await inbox.mark_many(session, [item.message_id for item in items], consumer)
        else:
            new = {item.message_id for item in items}
        fresh = [item for item in items if item.message_id in new]
        verdicts = {item: DUPLICATE for item in items if item.message_id not in new}
        deferred: list[_Item] = []
        if handler.batch is not None:
            await self._call_batch(session, handler, fresh, attempt)
            verdicts.update((item, COMMITTED) for item in fresh)
        elif fresh:
            previous = None
            if self._postgres:
                previous = (await session.execute(_BOUND_LOCKS, {"t": _ROW_LOCK_WAIT})).one()[0]
            for item in fresh:
                try:
                    verdicts[item] = await self._savepoint(session, handler, item, attempt)
                except _Defer:
                    deferred.append(item)
                    if handler.inbox:
                        await inbox.unmark(session, item.message_id, consumer)
                    continue
                if verdicts[item] is not COMMITTED and handler.inbox:
                    await inbox.unmark(session, item.message_id, consumer)
            if previous is not None:
                await session.execute(_RESTORE_LOCKS, {"t": previous})
        for item in fresh:
            hook = item.delivery.in_transaction
            if hook is not None and verdicts.get(item) is COMMITTED:
                await hook(session)
        return verdicts, deferred

    async def _call_batch(
        self, session: PumpSession, handler: Handler[Any], items: list[_Item], attempt: int
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
        messages = [item.decoded[handler.model] for item in items]
        run = HandlerRun()
        running = HANDLER_RUNNING.set(run)
        try:
            await handler.batch(context, messages)
        finally:
            HANDLER_RUNNING.reset(running)
        run.refuse_swallowed()

    async def _savepoint(
        self, session: PumpSession, handler: Handler[Any], item: _Item, attempt: int
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
            run = HandlerRun()
            running = HANDLER_RUNNING.set(run)
            try:
                await handler.func(context, item.decoded[handler.model])
            finally:
                HANDLER_RUNNING.reset(running)
            run.refuse_swallowed()
            await nested.commit()  # flushes: a version conflict surfaces here, as its own
        except Exception as exc:
            # after a failed flush too (the savepoint is then inactive, not yet rolled back);
            # a failure of the rollback itself is the transaction's: it propagates
            await nested.rollback()
            return self._judge(item, handler, attempt, exc)
        return COMMITTED

    def _judge(self, item: _Item, handler: Handler[Any], attempt: int, exc: Exception) -> Verdict:
        """A savepoint's failure: a verdict for this message alone, or _Defer, or re-raised."""
        consumer = handler.consumer
        judge = self.pump.judge
        verdict = judge.requested(item.delivery, consumer, attempt, exc)
        if verdict is not None:
            return verdict
        if isinstance(exc, Rejected):
            raise _Defer from exc  # recorded by the per-message path, with its marker
        cause = _cause(exc)
        failure = classify(cause)
        if failure is Failure.DUPLICATE:  # not the batch's marker: the handler's own insert
            failure = Failure.ERROR
        if failure in _DEFERRED:
            self.pump.stats["batch-deferred"] += 1
            raise _Defer from exc
        if failure in _WHOLE:
            raise exc
        if failure is Failure.DATA:
            return refused_value(consumer, cause, attempt)
        verdict = judge.failed(item.delivery, consumer, attempt, cause)
        return Verdict(
            verdict.verb, verdict.outcome, verdict.reason, verdict.delay, attempt=attempt
        )

    def _tally(self, item: _Item, consumer: str, attempt: int) -> None:
        pump = self.pump
        outcome = item.verdict.outcome
        pump.outcomes[consumer, outcome] += 1
        if outcome is Outcome.COMMITTED or outcome is Outcome.DUPLICATE:
            if outcome is Outcome.DUPLICATE:
                pump.stats["duplicates-batch"] += 1
            pump.judge.note(item.delivery, consumer, attempt, outcome.value)

    # -- settlement ---------------------------------------------------------------

    async def _settle(self, items: list[_Item]) -> None:
        """Each delivery on its own verdict; the acks together, in one call where possible."""
        pump = self.pump
        acks: list[tuple[Delivery, str | None]] = []
        for item in items:
            if item.verdict.verb is Verb.ACK:
                acks.append((item.delivery, item.consumer))
                for twin in item.twins:
                    pump.stats["duplicates-in-batch"] += 1
                    pump.outcomes[item.consumer or "", Outcome.DUPLICATE] += 1
                    pump.judge.note(twin, item.consumer or "", 0, "duplicate", twin=True)
                    acks.append((twin, item.consumer))
            else:
                await pump._settle(item.delivery, item.verdict, item.consumer)
        await self._ack([delivery for delivery, _ in acks], dict(acks))
        for item in items:  # the first copy failed: each twin tries on its own
            if item.verdict.verb is not Verb.ACK:
                for twin in item.twins:
                    await pump._one(twin)

    async def _ack(
        self, deliveries: Sequence[Delivery], consumers: dict[Delivery, str | None]
    ) -> None:
        if not deliveries:
            return
        pump = self.pump
        lost = set(await ack_many(deliveries))
        pump.stats["ack"] += len(deliveries) - len(lost)
        for delivery in lost:
            pump.stats["settlement-lost"] += 1
            pump._log.warning(
                "settlement lost, broker will redeliver",
                message_id=delivery.message_id,
                consumer=consumers.get(delivery),
                attempt=0,
                verb=Verb.ACK,
                outcome="settlement-lost",
            )


def _cause(exc: Exception) -> Exception:
    """The database error behind a swallowed statement, else the exception itself."""
    if isinstance(exc, StatementSwallowed) and isinstance(exc.__cause__, Exception):
        return exc.__cause__
    return exc
