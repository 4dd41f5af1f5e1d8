"""The pump: the worker's lifecycle and shutdown order around one loop.

Each of ``WORKER_CONCURRENCY`` worker tasks runs the same loop over units of work
(one delivery, or a group of deliveries of one type that were ready together)::

    work = await intake.next()          # worker.intake: receive, refuse, lanes, groups
    verdicts = await self._handle(work) # the start (a redelivery's count, its limit),
                                        # then each handler's runner (worker.transaction,
                                        # worker.claim_runner); worker.judge names every
                                        # failure; middleware, where attached, around it
    await settlement.work(work, verdicts)  # worker.settle: exactly one verb per delivery
    intake.done(work)                   # its lanes go to what waits behind it

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
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from worker import attempts, inbox
from worker.brokers import Broker
from worker.claim_runner import ClaimRunner
from worker.concurrency import prepare_models
from worker.context import session_factory
from worker.db import discard
from worker.health import DatabaseHealth
from worker.intake import Intake, Item, Work
from worker.judge import Judge
from worker.logs import get_logger
from worker.middleware import NextStage, StageMiddleware, WorkMiddleware, compose
from worker.registry import Handler, Registry, Runs
from worker.settings import Settings
from worker.settle import Settlement
from worker.startup import broker_up
from worker.transaction import Stage, TransactionRunner
from worker.verdict import STOPPING, Outcome, Verb, Verdict, unexpected

_MOST_PREFETCHED = 8192  # what a pump holds at most: a few KB each


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
        self.health = health = DatabaseHealth(engine, log, settings.db_probe_backoff_max)
        self._sessions = sessions = session_factory(engine)
        self.judge = judge = Judge(settings, log, self.stats, sessions, health)
        transactions = TransactionRunner(
            engine,
            sessions,
            judge,
            self.stats,
            watches=broker.watches,
            writes_in_commit=broker.writes_in_commit,
        )
        claims = ClaimRunner(engine, sessions, judge)
        self._runners: dict[Runs, NextStage] = {
            Runs.TRANSACTION: compose(stage_middleware, transactions.run),
            Runs.CLAIM: compose(stage_middleware, claims.run),
        }
        self._handle = compose(middleware, self._run)
        self._count_every_start = settings.count_first_deliveries
        self._settlement = Settlement(engine, settings, log, self.stats, health)
        self._intake = Intake(
            broker,
            engine,
            registry,
            settings,
            health,
            self._settlement.one,
            self.stats,
            self.outcomes,
            log,
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
        """Unsettled deliveries the broker may push: one per worker, three when keys
        serialize (deliveries waiting for a busy key hold broker credit without a worker);
        with groups, a full group for every worker and one more filling (docs/batch.md),
        at most 8,192. A backlog reaches the pump as fast as it can take it; on a quiet
        queue nothing is held."""
        concurrency = self.settings.concurrency
        unsettled = 3 * concurrency if self.registry.keyed else concurrency
        size = self.settings.batch_size
        if size == 1:
            return unsettled
        return max(unsettled, min((concurrency + 1) * size, _MOST_PREFETCHED))

    def held(self) -> dict[str, int]:
        """What the pump holds per delivery now (all zero once nothing is in flight)."""
        return {**self._intake.held(), "workers holding work": len(self._busy)}

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
        # a database that stops answering cuts the attempts waiting on it
        self.health.watch(self.settings.handler_timeout)
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
        self._settlement.stopping = True  # what is left is given back without waiting
        settle = self._settlement.one
        for item in intake.unstarted():  # waiting in a lane, or never taken
            await settle(item.delivery, STOPPING)
        for work in intake.running():  # cancelled mid-attempt
            for item in work.items:
                await settle(item.delivery, STOPPING, work.counted)
        await self.broker.close()
        await self.health.close()
        self.consuming = False
        self._log.info("pump stopped", **dict(self.stats))

    # -- the loop ---------------------------------------------------------------

    async def _work(self) -> None:
        """One worker: take a unit of work, run it, settle it, free its lanes."""
        intake, settlement, health = self._intake, self._settlement, self.health
        task = asyncio.current_task()
        assert task is not None
        while not self._stop.is_set():
            work = await intake.next()
            self._busy.add(task)  # from here on, shutdown waits for this work
            try:
                if not health.gate.is_set():  # the gate closed while this worker waited:
                    await health.wait_available()  # hold the work, don't burn a count
                try:
                    verdicts = await self._handle(work)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # the pump outlives any bug in a handler or adapter
                    if isinstance(exc, asyncio.CancelledError) and task.cancelling():
                        raise  # the shutdown's, past its grace period: nothing settles
                    verdicts = await self._bug(work, exc, task)
                await settlement.work(work, verdicts)
                try:
                    intake.done(work, verdicts)
                except Exception:  # a bug: the worker must outlive it
                    self._log.exception("bug: a unit of work's lanes were not released")
            finally:
                self._busy.discard(task)

    async def _bug(self, work: Work, exc: BaseException, task: asyncio.Task[None]) -> list[Verdict]:
        """A bug outside any handler (an adapter's, a middleware's) is a counted failure of
        the delivery it met. A group it met runs again one delivery at a time, so it costs
        only that one a count (what the group committed comes back as duplicates)."""
        if len(work.items) == 1:
            return self._unexpected(work, exc)
        self._log.warning("group failed outside its handlers, one at a time", error=exc)
        verdicts: list[Verdict] = []
        for item in work.items:
            alone = Work([item], work.handlers)
            alone.counted = work.counted  # started already: not counted again
            try:
                verdicts.extend(await self._handle(alone))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as error:
                if isinstance(error, asyncio.CancelledError) and task.cancelling():
                    raise
                verdicts.extend(self._unexpected(alone, error))
        return verdicts

    async def _run(self, work: Work) -> list[Verdict]:
        """The start, then each handler of the type over the items still live: an item
        whose verdict is not an ack stops there (the type's later handlers run on its
        redelivery, the earlier ones deduplicated by their markers)."""
        items = work.items
        if not work.handlers:  # refused by intake: no handler can run it
            refused = items[0].refused
            assert refused is not None
            self.outcomes["", refused.outcome] += 1
            return [refused]
        if (self._count_every_start or items[0].redelivered) and work.counted is None:
            over = await self._start(work)
            if over is not None:
                self.outcomes["", over.outcome] += 1
                return [over]
        handlers = work.handlers
        outcomes = self.outcomes
        if len(handlers) == 1:  # the common case: one handler, every item live
            handler = handlers[0]
            verdicts = await self._runners[handler.runs](Stage(work, handler, items))
            for verdict in verdicts:
                outcomes[handler.consumer, verdict.outcome] += 1
            return verdicts
        ended: list[Verdict | None] = [None] * len(items)
        live = list(range(len(items)))
        last = len(handlers) - 1
        for index, handler in enumerate(handlers):
            stage = Stage(work, handler, [items[i] for i in live], index == last)
            still = []
            for i, verdict in zip(live, await self._runners[handler.runs](stage), strict=True):
                ended[i] = verdict
                outcomes[handler.consumer, verdict.outcome] += 1
                if verdict.verb is Verb.ACK:
                    still.append(i)
            live = still
            if not live:
                break
        return [verdict for verdict in ended if verdict is not None]

    async def _start(self, work: Work) -> Verdict | None:
        """Spend the start durably (a redelivery's, before anything that may crash starts;
        with WORKER_COUNT_FIRST_DELIVERIES every one's); past the limit, end it here."""
        consumer = work.handlers[0].consumer
        if len(work.items) > 1:  # a group: first deliveries, none past a limit
            if await attempts.count_many(self.engine, work.deliveries, consumer, self.settings):
                work.counted = consumer
            return None
        item = work.items[0]
        delivery = item.delivery
        if await attempts.count(self.engine, delivery, consumer, self.settings):
            work.counted = consumer
        if delivery.delivery_count > self.settings.max_deliveries:
            return await self._over_limit(item, work.handlers)
        return None

    async def _over_limit(self, item: Item, handlers: tuple[Handler[Any], ...]) -> Verdict:
        """Past WORKER_MAX_DELIVERIES: done already (its ack was lost), or dead-letter it."""
        delivery = item.delivery
        judge = self.judge
        marked = [h for h in handlers if h.inbox]
        if marked and len(marked) == len(handlers):
            session = self._sessions()
            try:
                done = [await inbox.seen(session, item.message_id, h.consumer) for h in marked]
            except Exception as exc:
                ending = await judge.stopped(delivery, marked[0], exc)
                if ending.outcome is Outcome.PAUSED:
                    return ending  # the database is away: back, uncounted, once it answers
                # past the limit whatever the check says: it ends here, as exhausted
            else:
                if all(done):
                    return judge.duplicate(delivery, marked[0].consumer, 0, "fast-path")
            finally:
                await discard(session)
        limit = self.settings.max_deliveries
        reason = f"delivered {delivery.delivery_count} times (WORKER_MAX_DELIVERIES={limit})"
        return Verdict(Verb.DEAD_LETTER, Outcome.EXHAUSTED, reason)

    def _unexpected(self, work: Work, exc: BaseException) -> list[Verdict]:
        """A bug outside any handler: every item is nacked (dead-lettered on its last
        allowed delivery), so a delivery that always meets it still ends."""
        self._log.error(
            "unexpected error",
            message_id=work.items[0].message_id,
            size=len(work.items),
            attempt=0,
            outcome="nacked",
            exc_info=exc,
        )
        limit = self.settings.max_deliveries
        return [unexpected(item.delivery.delivery_count, limit, exc) for item in work.items]
