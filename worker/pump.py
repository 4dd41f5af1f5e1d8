"""The pump: deliveries in, one transaction per attempt, exactly one settlement out.

For each delivery and each handler of its type, an attempt is::

    fresh session -> [redelivery: inbox fast path] -> insert marker -> handler -> one commit

and the outcome decides the settlement in :meth:`Pump._settle`:

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
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from worker import attempts, claims, inbox, metrics
from worker.brokers import Broker
from worker.concurrency import prepare_models
from worker.db import HANDLER_RUNNING, Failure, HandlerRun, PumpSession, classify, session_factory
from worker.delivery import Delivery
from worker.errors import (
    AlreadySettled,
    HandlerTimeout,
    Poison,
    Rejected,
    Retry,
    SettlementLost,
    StatementSwallowed,
)
from worker.health import DatabaseHealth
from worker.logs import get_logger
from worker.registry import Context, Handler, Registry
from worker.rejections import deleted_row, record_rejection
from worker.retry import backoff
from worker.settings import Settings
from worker.verdict import COMMITTED, DUPLICATE, Outcome, Verb, Verdict, failure

if TYPE_CHECKING:
    from worker.tracing import Tracing

_GIVE_BACK_DELAY = 1.0
"""Seconds before an uncounted give-back (pause, contention, shutdown) comes back."""

_PAUSED = Verdict(
    Verb.NACK, Outcome.PAUSED, "database unavailable", _GIVE_BACK_DELAY, counted=False
)
_STOPPING = Verdict(Verb.NACK, Outcome.SHUTDOWN, "the worker is stopping", 0.0, counted=False)
_UNEXPECTED = Verdict(Verb.NACK, Outcome.NACKED, "unexpected error")

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
        self._engine = engine
        self._sessions = session_factory(engine)
        self._postgres = engine.dialect.name == "postgresql"
        self._lock_timeout_ms = max(1, round(settings.marker_lock_timeout * 1000))
        self._log = get_logger(pump=name, broker=broker.name)
        self.health = DatabaseHealth(engine, self._log, settings.db_probe_backoff_max)
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
        prepare_models(self._engine.dialect.name)  # refuses unusable tokens before any work
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
                await self._settle_guarded(delivery, _STOPPING)
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
                await self._settle_guarded(delivery, _UNEXPECTED)

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
                    await self._settle_guarded(parked, _STOPPING)
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
        await attempts.count(self._engine, delivery, handlers, self.settings)  # durable count
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
                verdict = await self._database_trouble(delivery, marked[0], 1, exc)
                if verdict is not None:
                    return verdict
                return Verdict(Verb.NACK, Outcome.FAILED, f"inbox check failed: {exc}")
            finally:
                await _discard(session)
            if all(done):
                self.stats["duplicates-fast-path"] += 1
                self._note(delivery, marked[0].consumer, 0, "duplicate", fast_path=True)
                return DUPLICATE
        limit = self.settings.max_deliveries
        reason = f"delivered {delivery.delivery_count} times (WORKER_MAX_DELIVERIES={limit})"
        return Verdict(Verb.DEAD_LETTER, Outcome.EXHAUSTED, reason)

    async def _consume_observed(
        self, delivery: Delivery, handler: Handler[Any], message: BaseModel
    ) -> Verdict:
        """:meth:`_consume`, timed and counted per consumer (and traced when tracing is on)."""
        started = time.perf_counter()
        if self.tracing is None:
            verdict = await self._consume(delivery, handler, message)
        else:
            with self.tracing.transaction(handler.consumer) as span:
                verdict = await self._consume(delivery, handler, message)
                span.set_attribute("worker.outcome", verdict.outcome)
        metrics.observe_handler(handler.consumer, time.perf_counter() - started)
        self.outcomes[handler.consumer, verdict.outcome] += 1
        return verdict

    async def _consume(
        self, delivery: Delivery, handler: Handler[Any], message: BaseModel
    ) -> Verdict:
        """Run one handler until it commits, is a duplicate, or must give the delivery back."""
        if handler.side_effect:
            return await self._claimed(delivery, handler, message)
        settings = self.settings
        message_id = delivery.message_id
        assert message_id is not None
        consumer = handler.consumer
        timeout = settings.handler_timeout
        attempt = 0
        deadline = 0.0
        while True:
            attempt += 1
            session: PumpSession = self._sessions()
            spent = True
            try:
                if await self._mark(session, delivery, handler, message):
                    return self._fast_duplicate(delivery, consumer, attempt)
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
                _refuse_swallowed(run)
                if delivery.in_transaction is not None:
                    await delivery.in_transaction(session)
                await AsyncSession.commit(session)
                # Committed: the connection is back in the pool and nothing is left to
                # roll back, so the session is dropped unclosed (one greenlet hop less).
                spent = False
                self._note(delivery, consumer, attempt, "committed")
                return COMMITTED
            except Poison as exc:
                reason = f"{consumer}: {exc}"
                return Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason, attempt=attempt)
            except Retry as exc:
                self._note(delivery, consumer, attempt, "retry-requested", reason=str(exc))
                return Verdict(
                    Verb.NACK, Outcome.RETRY_REQUESTED, str(exc), exc.delay, attempt=attempt
                )
            except Exception as exc:
                if attempt == 1:
                    deadline = time.monotonic() + settings.retry_budget
                verdict = await self._after_failure(
                    delivery, handler, attempt, deadline, session, exc
                )
                if verdict is not None:
                    return replace(verdict, attempt=attempt)
            finally:
                if spent:
                    await _discard(session)

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
        fast_path = self.settings.fast_path
        if self._postgres:
            return await inbox.mark_redelivery(
                session,
                message_id,
                consumer,
                self._lock_timeout_ms,
                fast_path=fast_path,
                key=None if key is None else str(key),
            )
        if fast_path and await inbox.seen(session, message_id, consumer):
            return True
        await inbox.mark(session, message_id, consumer)
        return False

    def _fast_duplicate(self, delivery: Delivery, consumer: str, attempt: int) -> Verdict:
        self.stats["duplicates-fast-path"] += 1
        self._note(delivery, consumer, attempt, "duplicate", fast_path=True)
        return DUPLICATE

    async def _after_failure(
        self,
        delivery: Delivery,
        handler: Handler[Any],
        attempt: int,
        deadline: float,
        session: AsyncSession,
        exc: Exception,
    ) -> Verdict | None:
        """Decide after a failed attempt: a verdict, or None after backing off to retry."""
        consumer = handler.consumer
        swallowed = isinstance(exc, StatementSwallowed)
        cause = exc.__cause__ if swallowed and isinstance(exc.__cause__, Exception) else exc
        failure = classify(cause)
        if swallowed:
            self._log.error(
                "handler swallowed a database error",
                message_id=delivery.message_id,
                consumer=consumer,
                attempt=attempt,
                outcome="swallowed",
                error=cause,
                hint=str(exc),
            )
            if failure is Failure.DUPLICATE:  # not the pump's marker: the handler's own insert
                failure = Failure.ERROR
        final = await self._final(delivery, handler, attempt, session, cause, failure)
        if final is not None:
            return final
        if failure is Failure.CONFLICT or failure is Failure.TRANSIENT:
            return await self._contended(
                delivery, consumer, attempt, deadline, session, failure, cause
            )
        if failure is Failure.ERROR:
            return self._failed(delivery, consumer, attempt, exc)
        verdict = await self._database_trouble(delivery, handler, attempt, cause, failure)
        if verdict is not None:
            return verdict
        # a dropped connection, and the database answers: retry, a bounded number of times
        if attempt >= self.settings.max_attempts:
            self._note(delivery, consumer, attempt, "attempts-exhausted", error=cause)
            return Verdict(Verb.NACK, Outcome.ATTEMPTS_EXHAUSTED, f"{failure.value}: {cause}")
        self.stats[f"retried-{failure.value}"] += 1
        await _discard(session)
        settings = self.settings
        await asyncio.sleep(backoff(attempt, settings.retry_backoff, settings.retry_backoff_max))
        return None

    async def _contended(
        self,
        delivery: Delivery,
        consumer: str,
        attempt: int,
        deadline: float,
        session: AsyncSession,
        failure: Failure,
        exc: Exception,
    ) -> Verdict | None:
        """Someone else committed first: retry on a fresh session until the budget is spent."""
        settings = self.settings
        pause = backoff(attempt, settings.retry_backoff, settings.retry_backoff_max)
        if time.monotonic() + pause > deadline:
            self._note(delivery, consumer, attempt, "attempts-exhausted", error=exc)
            reason = f"{failure.value}: retry budget of {settings.retry_budget}s spent: {exc}"
            return Verdict(
                Verb.NACK, Outcome.ATTEMPTS_EXHAUSTED, reason, _GIVE_BACK_DELAY, counted=False
            )
        self.stats[f"retried-{failure.value}"] += 1
        self._note(delivery, consumer, attempt, "retrying", failure=failure.value)
        # end the failed transaction before backing off: on PostgreSQL it may still hold
        # the marker's key, which a replica racing for the same message would wait on
        await _discard(session)
        await asyncio.sleep(pause)
        return None

    async def _database_trouble(
        self,
        delivery: Delivery,
        handler: Handler[Any],
        attempt: int,
        exc: Exception,
        failure: Failure | None = None,
    ) -> Verdict | None:
        """Not the message's fault: a verdict that spends no delivery, or None to retry."""
        failure = classify(exc) if failure is None else failure
        consumer = handler.consumer
        if failure is Failure.LOCKED:
            self._note(delivery, consumer, attempt, "in-progress", error=exc)
            reason = "the same message is in progress elsewhere"
            return Verdict(
                Verb.NACK,
                Outcome.IN_PROGRESS,
                reason,
                self.settings.marker_lock_timeout,
                counted=False,
            )
        if failure is Failure.SCHEMA:
            self.health.pause_for_schema(exc)
            self._note(delivery, consumer, attempt, "paused", error=exc)
            return Verdict(
                Verb.NACK, Outcome.PAUSED, "schema behind the code", _GIVE_BACK_DELAY, counted=False
            )
        if failure is Failure.CONNECTION:
            if not await self.health.confirm():
                self._note(delivery, consumer, attempt, "paused", error=exc)
                return _PAUSED
            return None
        if failure is Failure.DATA:
            reason = f"{consumer}: the database refuses a value: {type(exc).__name__}: {exc}"
            return Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason)
        return None

    async def _final(
        self,
        delivery: Delivery,
        handler: Handler[Any],
        attempt: int,
        session: AsyncSession,
        exc: Exception,
        failure: Failure,
    ) -> Verdict | None:
        """The errors that end a delivery without a retry: duplicate, rejected, row deleted."""
        if failure is Failure.DUPLICATE:
            self.stats["duplicates-constraint"] += 1
            self._note(delivery, handler.consumer, attempt, "duplicate")
            return DUPLICATE
        rejected = exc if isinstance(exc, Rejected) else None
        if rejected is None and failure is Failure.CONFLICT:  # changed, or gone?
            # end the failed transaction first: it still holds the marker's key (on SQLite
            # the write lock), which the lookup's fresh connection would wait on
            await _discard(session)
            rejected = await deleted_row(session, exc, self._sessions)
        if rejected is None:
            return None
        await _discard(session)  # on PostgreSQL its marker would block the record's
        return await self._rejected(delivery, handler, attempt, rejected)

    async def _claimed(
        self, delivery: Delivery, handler: Handler[Any], message: BaseModel
    ) -> Verdict:
        """A side-effect handler: claim with a lease, call, mark finished (worker/claims.py)."""
        try:
            result = await claims.process(
                self._sessions, handler, message, delivery, self.settings, self._log
            )
        except Exception as exc:
            verdict = await self._database_trouble(delivery, handler, 1, exc)
            return (
                verdict if verdict is not None else self._failed(delivery, handler.consumer, 1, exc)
            )
        self._note(delivery, handler.consumer, 1, result.outcome, reason=result.reason)
        return replace(result, attempt=1)

    async def _rejected(
        self, delivery: Delivery, handler: Handler[Any], attempt: int, exc: Rejected
    ) -> Verdict:
        """Not applied and never retried: record it with the inbox marker, then ack."""
        consumer = handler.consumer
        assert delivery.message_id is not None
        try:
            recorded = await record_rejection(
                self._sessions,
                delivery.message_id,
                consumer,
                delivery.type,
                exc,
                with_marker=handler.inbox,
            )
        except Exception as error:
            verdict = await self._database_trouble(delivery, handler, attempt, error)
            return (
                verdict if verdict is not None else self._failed(delivery, consumer, attempt, error)
            )
        if not recorded:
            self.stats["duplicates-constraint"] += 1
            self._note(delivery, consumer, attempt, "duplicate")
            return DUPLICATE
        self._note(
            delivery,
            consumer,
            attempt,
            exc.outcome,
            reason=str(exc),
            subject=exc.subject,
            expected=exc.expected,
            actual=exc.actual,
        )
        return Verdict(Verb.ACK, exc.outcome, str(exc))

    def _failed(self, delivery: Delivery, consumer: str, attempt: int, exc: Exception) -> Verdict:
        verdict = failure(consumer, exc, delivery.delivery_count, self.settings.max_deliveries)
        self._log.warning(
            "handler failed",
            message_id=delivery.message_id,
            consumer=consumer,
            attempt=attempt,
            delivery_count=delivery.delivery_count,
            outcome="dead-lettered" if verdict.verb is Verb.DEAD_LETTER else "nacked",
            exc_info=exc,
        )
        return verdict

    def _note(
        self, delivery: Delivery, consumer: str, attempt: int, outcome: str, **extra: Any
    ) -> None:
        self.stats[outcome] += 1
        if outcome == "committed":
            return  # hot path: logging each commit costs more than its Python work
        log = self._log.info if outcome == "duplicate" else self._log.warning
        if outcome == "retrying":
            log = self._log.debug
        log(
            outcome,
            message_id=delivery.message_id,
            consumer=consumer,
            attempt=attempt,
            outcome=outcome,
            delivery_count=delivery.delivery_count,
            **extra,
        )

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
                    await attempts.refund(self._engine, delivery, handlers)
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


def _refuse_swallowed(run: HandlerRun) -> None:
    if run.failures:
        raise StatementSwallowed(
            "a statement failed inside the handler and the handler carried on; "
            "the transaction is aborted: catch database errors inside "
            "`async with ctx.session.begin_nested():` instead"
        ) from run.failures[0]


def _overran(seconds: float) -> HandlerTimeout:
    return HandlerTimeout(f"handler ran longer than WORKER_HANDLER_TIMEOUT={seconds}s")


async def _discard(session: AsyncSession) -> None:
    """Close an attempt's session (rolling back what did not commit), whatever state it is in."""
    try:
        await AsyncSession.close(session)
    except Exception:  # a broken connection can fail its own rollback; the pump drops it
        await AsyncSession.invalidate(session)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"]) or "body"
    return f"{where}: {error['msg']}"
