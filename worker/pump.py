"""The pump: the worker's lifecycle and shutdown order around one loop.

Each of ``WORKER_CONCURRENCY`` worker tasks runs the same loop over units of work
(:mod:`worker.work`: one delivery, or a batch)::

    work = await intake.next()      # worker.intake: receive, refuse, lane, bucket
    await middleware(work)          # worker.middleware, then worker.dispatch: the start,
                                    # then each handler's runner (worker.transaction,
                                    # worker.claim_runner, worker.batch); worker.judge
                                    # names every failure
    await settlement.work(work)     # worker.settle: exactly one verb per delivery
    intake.done(work)               # its lanes free; what it left runs again

A runner ends each delivery in a :class:`~worker.verdict.Verdict`, and the verdict
decides the settlement:

==============================================  ==========================================
outcome                                         settlement
==============================================  ==========================================
committed                                       ack
unique violation of the inbox constraint        ack (duplicate: another attempt won)
over WORKER_MAX_DELIVERIES, every marker there  ack (duplicate: the earlier ack was lost)
over WORKER_MAX_DELIVERIES, work not done       dead-letter ("exhausted")
version conflict, serialization, deadlock,      new attempt on a new session, jittered
a statement timeout in a lock wait              backoff; budget spent: nack, uncounted
marker waited out its lock_timeout              nack, uncounted (in progress elsewhere)
connection lost, database does not answer       nack, uncounted; pause intake until it answers
read-only, out of disk or memory, a missing     nack, uncounted; pause intake until a probe
privilege (SQLSTATE 25006, 53xxx, 42501)        says it is over
table or column missing (schema behind code)    nack, uncounted; while the same consumer
                                                commits other messages: as any exception
no id, unknown type, undecodable, invalid,      dead-letter at once, with the reason
a failing key function
a value the database refuses (SQLSTATE 22)      dead-letter at once, with the reason
``Poison`` raised by the handler                dead-letter at once, with the reason
statement failed, handler carried on            as the failed statement's class (above or
                                                below): the transaction is aborted
handler ran past WORKER_HANDLER_TIMEOUT         as any other exception
any other exception                             nack; on the last allowed delivery: dead-letter
==============================================  ==========================================

"Uncounted" give-backs keep the message's delivery count where it is: only a
message's own failures move it toward the dead-letter queue. Those that are the
message's own path (contention, in progress elsewhere, a schema behind the code, a
busy key) are bounded by its give-backs (``WORKER_MAX_GIVE_BACKS``); the
environment's (an outage, a shutdown) by the pause or the stop itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from asyncio import FIRST_COMPLETED
from collections import Counter
from collections.abc import AsyncIterator, Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.batch import BatchRunner
from worker.brokers import Broker
from worker.claim_runner import ClaimRunner
from worker.concurrency import prepare_models
from worker.db import session_factory
from worker.dispatch import Dispatch, Runner
from worker.endings import Endings
from worker.health import DatabaseHealth
from worker.intake import Intake
from worker.judge import Judge
from worker.logs import get_logger
from worker.middleware import StageMiddleware, WorkMiddleware, compose
from worker.registry import Registry, Runs
from worker.settings import Settings
from worker.settle import Settlement
from worker.startup import broker_up
from worker.transaction import TransactionRunner
from worker.verdict import STOPPING, Verb, unexpected
from worker.work import Work

_MAX_BATCH_PREFETCH = 8192
"""Unsettled deliveries batch mode may hold at most: 64 workers x 64 fit, RSS stays bounded."""


class Pump:
    """Consume from one broker with ``settings.concurrency`` workers until stopped.

    ``middleware`` wraps every unit of work and ``stage_middleware`` every handler's
    runner; both are attached where the process is assembled (``worker.cli.assemble``:
    tracing, handler timing), and a bare pump has none.
    """

    def __init__(
        self,
        broker: Broker,
        engine: AsyncEngine,
        registry: Registry,
        settings: Settings,
        *,
        name: str = "pump",
        middleware: Sequence[WorkMiddleware] = (),
        stage_middleware: Sequence[StageMiddleware] = (),
    ) -> None:
        self.broker = broker
        self.settings = settings
        self.registry = registry
        self.engine = engine
        self.middleware = (*middleware, *stage_middleware)
        # Instrumentation: plain tallies, read by worker.metrics at scrape time.
        self.stats: Counter[str] = Counter()
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (consumer, outcome)
        self._log = log = get_logger(pump=name, broker=broker.name)
        self.health = DatabaseHealth(engine, log, settings.db_probe_backoff_max)
        sessions = session_factory(engine)
        endings = Endings(sessions, Judge(settings, log, self.stats), self.health)
        postgres = engine.dialect.name == "postgresql"
        single = TransactionRunner(sessions, endings, postgres=postgres)
        runners: dict[Runs, Runner] = {
            Runs.TRANSACTION: single,
            Runs.CLAIM: ClaimRunner(sessions, endings),
        }
        batches = None
        if settings.batch_size > 1:
            batches = BatchRunner(sessions, endings, single, self.stats, postgres=postgres)
        dispatch = Dispatch(
            engine, sessions, endings, runners, batches, settings, self.outcomes, stage_middleware
        )
        self._run = compose(middleware, dispatch)
        self._settlement = Settlement(engine, settings, log, self.stats)
        self._intake = Intake(
            broker, engine, registry, settings, self.health, self._settlement, self.stats, log
        )
        self._stop = asyncio.Event()
        self._busy: set[asyncio.Task[None]] = set()  # workers holding a unit of work
        self.started = asyncio.Event()
        self.consuming = False

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
    def in_flight(self) -> int:
        """Deliveries the workers are processing now."""
        return self._intake.in_flight

    @property
    def prefetch(self) -> int:
        """Unsettled deliveries the broker may push. When keys serialize, deliveries parked
        behind a busy key hold broker credit without a worker: three times the workers
        leaves other keys room (and intake bounds what one key may park)."""
        concurrency = self.settings.concurrency
        unsettled = 3 * concurrency if self.registry.keyed else concurrency
        size = self.settings.batch_size
        if size > 1:  # every worker's batch, plus one batch filling (docs/batch.md)
            unsettled = max(unsettled, min((concurrency + 1) * size, _MAX_BATCH_PREFETCH))
        return unsettled

    def stop(self) -> None:
        """Ask for a graceful stop; :meth:`run` returns once in-flight work is settled."""
        self._stop.set()

    async def run(
        self, *, install_signal_handlers: bool = False, start_timeout: float | None = None
    ) -> None:
        """Consume until :meth:`stop`. ``start_timeout``: seconds a broker that is not
        there yet is retried (worker.startup); None: a failed start raises at once."""
        if install_signal_handlers:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        prepare_models(self.engine.dialect.name)  # refuses unusable tokens before any work
        concurrency = self.settings.concurrency
        await broker_up(lambda: self.broker.start(prefetch=self.prefetch), start_timeout, self._log)
        self.consuming = True
        self.started.set()
        self._log.info("pump started", concurrency=concurrency, types=self.registry.message_types)
        reader = asyncio.create_task(self._intake.run(), name="intake")
        workers = [asyncio.create_task(self._work(), name="worker") for _ in range(concurrency)]
        try:
            await self._stop.wait()
        finally:
            await self._shutdown(reader, workers)

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

    async def _shutdown(
        self, reader: asyncio.Task[None], workers: list[asyncio.Task[None]]
    ) -> None:
        # Order matters: stop taking work, let in-flight work finish within the grace
        # period, cancel what is left, give back (uncounted) whatever is still unsettled,
        # so a rolling restart costs no message a delivery, then close.
        intake = self._intake
        self._log.info("pump stopping", in_flight=intake.in_flight)
        self._stop.set()
        intake.stop()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await self.broker.stop_receiving()
        for task in workers:
            if task not in self._busy:
                task.cancel()
        _, late = await asyncio.wait(workers, timeout=self.settings.grace_period)
        for task in late:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        if late:
            self._log.warning("grace period over, cancelled in-flight work", cancelled=len(late))
        await intake.settled()
        left = intake.unstarted()  # parked behind a key, in a batch bucket, never taken
        for work in intake.running():  # cancelled mid-attempt
            for item in work.items:
                left.append(item)
                left.extend(item.twins)
        for item in left:
            if item.delivery.settled is None:
                await self._settlement.one(item, STOPPING)
        await self.broker.close()
        await self.health.close()
        self.consuming = False
        self._log.info("pump stopped", **dict(self.stats))

    async def _work(self) -> None:
        intake, settlement, health = self._intake, self._settlement, self.health
        task = asyncio.current_task()
        assert task is not None
        while not self._stop.is_set():
            work = await intake.next()
            self._busy.add(task)  # from here on, shutdown waits for this work
            try:
                if not health.available:  # the gate closed while this worker waited:
                    await health.wait_available()  # hold the work, don't burn a count
                await self._guarded(work)
                await settlement.work(work)
                intake.done(work)
            finally:
                self._busy.discard(task)

    async def _guarded(self, work: Work) -> None:
        """Run the unit of work; whatever goes wrong, every delivery leaves with a verdict."""
        try:
            await self._run(work)
        except Exception as exc:  # the pump must outlive any bug in a handler or adapter
            self._log.exception(
                "unexpected error",
                message_id=work.items[0].delivery.message_id,
                size=len(work.items),
                attempt=0,
                outcome="nacked",
            )
            limit = self.settings.max_deliveries
            for item in work.items:
                verdict = item.verdict
                if verdict is None or verdict.verb is Verb.ACK or item.deferred:
                    item.deferred = False
                    item.verdict = unexpected(item.delivery.delivery_count, limit, exc)
