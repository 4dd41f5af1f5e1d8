"""The pump: deliveries in, each handler's runner, exactly one settlement out.

The pump takes deliveries from the broker, refuses what no handler can run (no id,
unknown type, undecodable), serializes keyed deliveries in lanes, and hands each
handler of the type to the runner the handler names: :mod:`worker.transaction`
(marker and writes in one commit per attempt), :mod:`worker.claims` (a two-phase
claim around a side effect), or in batch mode :mod:`worker.batch`. A runner ends in a
:class:`~worker.verdict.Verdict` (:mod:`worker.judge` names the failures), and the
verdict decides the settlement in :meth:`Pump._settle`:

==============================================  ==========================================
outcome                                         settlement
==============================================  ==========================================
committed                                       ack
unique violation of the inbox constraint        ack (duplicate: another attempt won)
over WORKER_MAX_DELIVERIES, every marker there  ack (duplicate: the earlier ack was lost)
over WORKER_MAX_DELIVERIES, work not done       dead-letter ("exhausted")
version conflict, serialization, deadlock       new attempt on a new session, jittered
                                                backoff; budget spent: nack, uncounted
marker waited out its lock_timeout              nack, uncounted (in progress elsewhere)
connection lost, database does not answer       nack, uncounted; pause intake until it answers
table or column missing (schema behind code)    nack, uncounted; pause intake a while
no id, unknown type, undecodable, invalid       dead-letter at once, with the reason
a value the database refuses (SQLSTATE 22)      dead-letter at once, with the reason
``Poison`` raised by the handler                dead-letter at once, with the reason
statement failed, handler carried on            as the failed statement's class (above or
                                                below): the transaction is aborted
handler ran past WORKER_HANDLER_TIMEOUT         as any other exception
any other exception                             nack; on the last allowed delivery: dead-letter
==============================================  ==========================================

"Uncounted" give-backs keep the message's delivery count where it is: only a
message's own failures move it toward the dead-letter queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from asyncio import FIRST_COMPLETED
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import attempts, inbox, metrics
from worker.brokers import Broker
from worker.claims import ClaimRunner
from worker.concurrency import prepare_models
from worker.db import discard, session_factory
from worker.delivery import Delivery
from worker.errors import AlreadySettled, SettlementLost
from worker.health import DatabaseHealth
from worker.judge import Judge, Runner
from worker.logs import get_logger
from worker.registry import Handler, Registry, Runs
from worker.settings import Settings
from worker.transaction import TransactionRunner
from worker.verdict import COMMITTED, STOPPING, UNEXPECTED, Outcome, Verb, Verdict

if TYPE_CHECKING:
    from worker.tracing import Tracing

_Decoded = dict[type[BaseModel], BaseModel]

_MAX_BATCH_PREFETCH = 8192
"""Unsettled deliveries batch mode may hold at most: 64 workers x 64 fit, RSS stays bounded."""


class Pump:
    """Consume from one broker with ``settings.concurrency`` workers until stopped."""

    def __init__(
        self,
        broker: Broker,
        engine: AsyncEngine,
        registry: Registry,
        settings: Settings,
        *,
        name: str = "pump",
        tracing: Tracing | None = None,
    ) -> None:
        """``tracing``: OpenTelemetry spans per delivery, built where the process is
        assembled (``worker run``); None costs not one OpenTelemetry call per delivery."""
        self.broker = broker
        self.settings = settings
        self.registry = registry
        self.stats: Counter[str] = Counter()
        self.engine = engine
        self._sessions = session_factory(engine)
        self._log = get_logger(pump=name, broker=broker.name)
        self.health = DatabaseHealth(engine, self._log, settings.db_probe_backoff_max)
        self.judge = Judge(settings, self._sessions, self.health, self._log, self.stats)
        self._runners: dict[Runs, Runner] = {
            Runs.TRANSACTION: TransactionRunner(
                self._sessions, self.judge, postgres=engine.dialect.name == "postgresql"
            ),
            Runs.CLAIM: ClaimRunner(self._sessions, self.judge),
        }
        self._stop = asyncio.Event()
        self._idle: set[asyncio.Task[None]] = set()
        self._held: set[Delivery] = set()  # taken from the broker and not settled yet
        # Per-key lanes: key -> deliveries waiting behind the one running for that key.
        self._lanes: dict[Hashable, deque[tuple[Delivery, tuple[Handler[Any], ...], _Decoded]]]
        self._lanes = {}
        self.started = asyncio.Event()
        self.consuming = False
        # Instrumentation: plain tallies, read by worker.metrics at scrape time.
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (consumer, outcome)
        self.in_flight = 0
        self.tracing = tracing

    # -- lifecycle --------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return (
            self.consuming
            and not self._stop.is_set()
            and self.broker.ready
            and self.health.available
        )

    @property
    def prefetch(self) -> int:
        """Unsettled deliveries the broker may push. When keys serialize, deliveries parked
        behind a busy key hold broker credit without a worker: three times the workers
        leaves other keys room until one key has twice the workers waiting in a row."""
        concurrency = self.settings.concurrency
        unsettled = 3 * concurrency if self.registry.keyed else concurrency
        size = self.settings.batch_size
        if size > 1:  # every worker's batch, plus one batch filling (docs/batch.md)
            unsettled = max(unsettled, min((concurrency + 1) * size, _MAX_BATCH_PREFETCH))
        return unsettled

    def stop(self) -> None:
        """Ask for a graceful stop; :meth:`run` returns once in-flight work is settled."""
        self._stop.set()

    async def run(self, *, install_signal_handlers: bool = False) -> None:
        if install_signal_handlers:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        prepare_models(self.engine.dialect.name)  # refuses unusable tokens before any work
        concurrency = self.settings.concurrency
        await self.broker.start(prefetch=self.prefetch)
        self.consuming = True
        self.started.set()
        self._log.info("pump started", concurrency=concurrency, types=self.registry.message_types)
        workers = self._start_workers(concurrency)
        try:
            await self._stop.wait()
        finally:
            await self._shutdown(workers)

    @contextlib.asynccontextmanager
    async def running(self, start_within: float = 30.0) -> AsyncIterator[Pump]:
        """``async with pump.running():`` for tests and embedders: consuming inside the
        block (a start that fails raises here), stopped gracefully on the way out."""
        task = asyncio.create_task(self.run(), name="pump")
        started = asyncio.create_task(self.started.wait())
        try:
            await asyncio.wait({task, started}, timeout=start_within, return_when=FIRST_COMPLETED)
        finally:
            started.cancel()
        if task.done():
            task.result()  # the start failed: its error, here
            raise RuntimeError("the pump stopped before it started")
        if not self.started.is_set():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise TimeoutError(f"the pump did not start within {start_within}s")
        try:
            yield self
        finally:
            self.stop()
            await task

    def _start_workers(self, concurrency: int) -> list[asyncio.Task[None]]:
        if self.settings.batch_size == 1:
            return [asyncio.create_task(self._work()) for _ in range(concurrency)]
        from worker.batch import BatchRunner  # batch mode only: not imported otherwise

        batches = BatchRunner(self)
        intake = asyncio.create_task(batches.intake(), name="batch-intake")
        self._idle.add(intake)  # never in flight: shutdown cancels it with the idle workers
        return [intake, *(asyncio.create_task(batches.work()) for _ in range(concurrency))]

    async def _shutdown(self, workers: list[asyncio.Task[None]]) -> None:
        # Order matters: stop taking work, let in-flight work finish within the
        # grace period, cancel what is left, give back (uncounted) whatever is still
        # unsettled, so a rolling restart costs no message a delivery, then close.
        self._log.info("pump stopping", in_flight=len(workers) - len(self._idle))
        self._stop.set()
        await self.broker.stop_receiving()
        for task in self._idle:
            task.cancel()
        _, late = await asyncio.wait(workers, timeout=self.settings.grace_period)
        for task in late:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        if late:
            self._log.warning("grace period over, cancelled in-flight work", cancelled=len(late))
        for delivery in list(self._held):  # cancelled mid-attempt, or parked behind a key
            if delivery.settled is None:
                await self._settle_guarded(delivery, STOPPING)
        await self.broker.close()
        await self.health.close()
        self.consuming = False
        self._log.info("pump stopped", **dict(self.stats))

    async def _work(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        idle = self._idle
        while not self._stop.is_set():
            idle.add(task)
            await self.health.wait_available()
            try:
                delivery = await self.broker.receive()
            except Exception as exc:  # an adapter bug must not silently retire this worker
                self._log.error("receive failed", error=exc)
                await asyncio.sleep(1.0)
                continue
            idle.discard(task)  # from here on, shutdown waits for this delivery
            self._held.add(delivery)
            if not self.health.available:  # the gate closed while this loop was waiting:
                await self.health.wait_available()  # hold the delivery, don't burn a count
            await self._one(delivery)

    async def _one(
        self, delivery: Delivery, work: Callable[[Delivery], Awaitable[None]] | None = None
    ) -> None:
        """Handle one delivery; whatever goes wrong, it ends settled or is logged loudly."""
        self.in_flight += 1
        try:
            await self._guarded(delivery, self._handle if work is None else work)
        finally:
            self.in_flight -= 1
            if delivery.settled is not None:
                self._held.discard(delivery)

    async def _guarded(
        self, delivery: Delivery, work: Callable[[Delivery], Awaitable[None]]
    ) -> None:
        try:
            if self.tracing is None:
                await work(delivery)
            else:
                await self.tracing.delivery(delivery, work)
        except AlreadySettled as exc:  # a bug in the pump or an adapter: never a success
            self.stats["settled-twice"] += 1
            self._log.error(
                "bug: delivery settled twice",
                message_id=delivery.message_id,
                attempt=0,
                outcome="settled-twice",
                error=exc,
                exc_info=exc,
            )
        except Exception:  # the pump must outlive any bug in a handler or adapter
            self._log.exception(
                "unexpected error", message_id=delivery.message_id, attempt=0, outcome="nacked"
            )
            if delivery.settled is None:
                await self._settle_guarded(delivery, UNEXPECTED)

    # -- one delivery -----------------------------------------------------------

    async def _handle(self, delivery: Delivery) -> None:
        if delivery.message_id is None:
            return await self._refuse(
                delivery, Verdict(Verb.DEAD_LETTER, Outcome.POISON, "no message id")
            )
        if len(delivery.message_id) > inbox.MESSAGE_ID_LENGTH:
            reason = f"message id longer than {inbox.MESSAGE_ID_LENGTH} characters"
            return await self._refuse(delivery, Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason))
        handlers = self.registry.for_type(delivery.type)
        if not handlers:
            reason = f"no handler for message type {delivery.type!r}"
            return await self._refuse(delivery, Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason))
        decoded: _Decoded = {}
        key: Hashable = None
        for handler in handlers:
            message = decoded.get(handler.model)
            if message is None:
                try:
                    message = decoded[handler.model] = handler.model.model_validate_json(
                        delivery.body
                    )
                except ValidationError as exc:
                    reason = f"invalid body for {delivery.type}: {_first_error(exc)}"
                    return await self._refuse(
                        delivery, Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason)
                    )
            if key is None and handler.key is not None:
                try:
                    key = handler.key(message)
                except Exception as exc:
                    reason = f"{handler.consumer}: key function failed: {type(exc).__name__}: {exc}"
                    return await self._refuse(
                        delivery, Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason)
                    )
        if key is None:
            return await self._process(delivery, handlers, decoded)
        lane = self._lanes.get(key)
        if lane is not None:  # the key is busy: wait in its lane, and free this worker
            lane.append((delivery, handlers, decoded))
            self.stats["parked"] += 1
            return None
        await self._run_lane(key, delivery, handlers, decoded)
        return None

    async def _refuse(self, delivery: Delivery, verdict: Verdict) -> None:
        """Dead-letter before any handler ran (counted under no consumer, for the metrics)."""
        self.outcomes["", verdict.outcome] += 1
        await self._settle(delivery, verdict)

    async def _run_lane(
        self,
        key: Hashable,
        delivery: Delivery,
        handlers: tuple[Handler[Any], ...],
        decoded: _Decoded,
    ) -> None:
        """Run ``delivery``, then every delivery that parked behind its key, in order."""
        lane = self._lanes[key] = deque()
        try:
            # guarded: a failure here must not strand the deliveries parked behind it
            await self._guarded(delivery, _bind(self._process, handlers, decoded))
            while lane:
                parked, parked_handlers, parked_decoded = lane.popleft()
                if not self._stop.is_set():
                    await self.health.wait_available()  # hold them while the database is away
                if self._stop.is_set():
                    await self._settle_guarded(parked, STOPPING)
                    self._held.discard(parked)
                    continue
                await self._one(parked, _bind(self._process, parked_handlers, parked_decoded))
        finally:
            del self._lanes[key]
            # cancelled at shutdown: what still waits here is given back by _shutdown

    async def _process(
        self, delivery: Delivery, handlers: tuple[Handler[Any], ...], decoded: _Decoded
    ) -> None:
        """Run the type's handlers in order (each its own transaction), then settle once."""
        await attempts.count(self.engine, delivery, handlers, self.settings)  # durable count
        if delivery.delivery_count > self.settings.max_deliveries:
            verdict = await self._over_limit(delivery, handlers)
            if verdict.verb is Verb.DEAD_LETTER:
                return await self._refuse(delivery, verdict)
            return await self._settle(delivery, verdict)
        verdict = COMMITTED
        store, last = delivery.in_transaction, handlers[-1]  # the adapter's part goes with
        for handler in handlers:  # the last handler's commit: a crash before it repeats them all
            delivery.in_transaction = store if handler is last else None
            verdict = await self._consume_observed(delivery, handler, decoded[handler.model])
            if verdict.verb is not Verb.ACK:
                break  # later handlers run on the redelivery; earlier ones are deduplicated
        await self._settle(delivery, verdict, handler.consumer)
        return None

    async def _over_limit(self, delivery: Delivery, handlers: tuple[Handler[Any], ...]) -> Verdict:
        """Past WORKER_MAX_DELIVERIES: done already (its ack was lost), or dead-letter it."""
        message_id = delivery.message_id
        assert message_id is not None
        marked = [h for h in handlers if h.inbox]
        if marked and len(marked) == len(handlers):
            session = self._sessions()
            try:
                done = [await inbox.seen(session, message_id, h.consumer) for h in marked]
            except Exception as exc:
                verdict = await self.judge.database_trouble(delivery, marked[0], 1, exc)
                if verdict is not None:
                    return verdict
                return Verdict(Verb.NACK, Outcome.FAILED, f"inbox check failed: {exc}")
            finally:
                await discard(session)
            if all(done):
                return self.judge.duplicate(delivery, marked[0].consumer, 0, "fast-path")
        limit = self.settings.max_deliveries
        reason = f"delivered {delivery.delivery_count} times (WORKER_MAX_DELIVERIES={limit})"
        return Verdict(Verb.DEAD_LETTER, Outcome.EXHAUSTED, reason)

    async def _consume_observed(
        self, delivery: Delivery, handler: Handler[Any], message: BaseModel
    ) -> Verdict:
        """The handler's runner on the delivery, timed and counted per consumer (and traced
        when tracing is on)."""
        started = time.perf_counter()
        runner = self._runners[handler.runs]
        if self.tracing is None:
            verdict = await runner.run(delivery, handler, message)
        else:
            with self.tracing.transaction(handler.consumer) as span:
                verdict = await runner.run(delivery, handler, message)
                span.set_attribute("worker.outcome", verdict.outcome)
        metrics.observe_handler(handler.consumer, time.perf_counter() - started)
        self.outcomes[handler.consumer, verdict.outcome] += 1
        return verdict

    async def _settle(
        self, delivery: Delivery, verdict: Verdict, consumer: str | None = None
    ) -> None:
        """The one place a delivery is settled. A lost settlement is never a success.

        A second settlement of one delivery raises :class:`AlreadySettled`: a bug,
        reported loudly by the caller, never mistaken for a lost settlement.
        """
        # Not shielded: the only cancellation is the shutdown's after its grace
        # period, and an ack cut short is a redelivery that the inbox absorbs.
        verb = verdict.verb
        if self.tracing is not None:
            self.tracing.settling(verdict.outcome, verb, verdict.reason)
        try:
            if verb is Verb.ACK:
                await delivery.ack()
            elif verb is Verb.NACK:
                if not verdict.counted and attempts.wanted(delivery, self.settings):
                    handlers = self.registry.for_type(delivery.type)
                    await attempts.refund(self.engine, delivery, handlers)
                await delivery.nack(verdict.delay, counted=verdict.counted)
            else:
                assert verdict.reason is not None
                await delivery.dead_letter(verdict.reason)
        except SettlementLost as exc:
            self.stats["settlement-lost"] += 1
            self._log.warning(
                "settlement lost, broker will redeliver",
                message_id=delivery.message_id,
                consumer=consumer,
                attempt=verdict.attempt,
                verb=verb,
                error=exc,
                outcome="settlement-lost",
            )
            return
        self.stats[verb] += 1
        if verb is Verb.DEAD_LETTER:
            self.stats[f"dead-letter-{verdict.outcome}"] += 1
            self._log.warning(
                "dead-lettered",
                message_id=delivery.message_id,
                consumer=consumer,
                attempt=verdict.attempt,
                type=delivery.type,
                delivery_count=delivery.delivery_count,
                reason=verdict.reason,
                outcome=verdict.outcome,
            )

    async def _settle_guarded(self, delivery: Delivery, verdict: Verdict) -> None:
        """A fallback settlement: it may fail (an adapter bug), but never ends a worker loop."""
        try:
            await self._settle(delivery, verdict)
        except Exception as exc:
            self.stats["settlement-failed"] += 1
            self._log.error(
                "fallback settlement failed, broker will redeliver",
                message_id=delivery.message_id,
                attempt=verdict.attempt,
                verb=verdict.verb,
                outcome="settlement-failed",
                error=exc,
            )


def _bind(
    process: Callable[[Delivery, tuple[Handler[Any], ...], _Decoded], Awaitable[None]],
    handlers: tuple[Handler[Any], ...],
    decoded: _Decoded,
) -> Callable[[Delivery], Awaitable[None]]:
    async def work(delivery: Delivery) -> None:
        await process(delivery, handlers, decoded)

    return work


def _first_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"]) or "body"
    return f"{where}: {error['msg']}"
