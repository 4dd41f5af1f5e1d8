"""The pump: deliveries in, one transaction per attempt, exactly one settlement out.

For each delivery and each handler of its type, an attempt is::

    fresh session -> [redelivery: inbox fast path] -> insert marker -> handler -> one commit

and the outcome decides the settlement in :meth:`Pump._settle`:

=============================================  ===========================================
outcome                                        settlement
=============================================  ===========================================
committed                                      ack
unique violation of the inbox constraint       ack (duplicate: another attempt won)
version conflict, serialization, deadlock      new attempt on a new session; exhausted: nack
connection lost, database does not answer      nack, pause intake until the database answers
no id, unknown type, undecodable, invalid      dead-letter at once, with the reason
``Poison`` raised by the handler               dead-letter at once, with the reason
any other exception                            nack; on the last allowed delivery: dead-letter
=============================================  ===========================================
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from worker import claims, inbox, metrics, retention
from worker.brokers import Broker
from worker.concurrency import deleted_row, prepare_models, record_rejection
from worker.db import HANDLER_RUNNING, Failure, PumpSession, classify, session_factory
from worker.delivery import Delivery
from worker.errors import Poison, Rejected, Retry, SettlementLost, WorkerError
from worker.health import DatabaseHealth
from worker.logs import get_logger
from worker.registry import Context, Handler, Registry
from worker.retry import backoff
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.tracing import Tracing

ACK, NACK, DEAD_LETTER = "ack", "nack", "dead-letter"


class _Verdict:
    """How one handler's work on a delivery ended."""

    __slots__ = ("delay", "outcome", "reason", "verb")

    def __init__(
        self, verb: str, outcome: str, reason: str | None = None, delay: float | None = None
    ) -> None:
        self.verb = verb
        self.outcome = outcome
        self.reason = reason
        self.delay = delay


_COMMITTED = _Verdict(ACK, "committed")
_DUPLICATE = _Verdict(ACK, "duplicate")
_PAUSED = _Verdict(NACK, "paused")


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
    ) -> None:
        self.broker = broker
        self.settings = settings
        self.registry = registry
        self.stats: Counter[str] = Counter()
        self._engine = engine
        self._sessions = session_factory(engine)
        self._log = get_logger(pump=name, broker=broker.name)
        self.health = DatabaseHealth(engine, self._log, settings.db_probe_backoff_max)
        self._stop = asyncio.Event()
        self._idle: set[asyncio.Task[None]] = set()
        self.started = asyncio.Event()
        self.running = False
        # Instrumentation: plain tallies, read by worker.metrics at scrape time.
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (consumer, outcome)
        self.in_flight = 0
        self.tracing: Tracing | None = None  # None: not one OpenTelemetry call per delivery
        if settings.tracing:
            from worker.tracing import Tracing

            self.tracing = Tracing(broker, engine)
        metrics.track(self)

    # -- lifecycle --------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return (
            self.running and not self._stop.is_set() and self.broker.ready and self.health.available
        )

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
        await self.broker.start(prefetch=concurrency)
        self.running = True
        self.started.set()
        self._log.info("pump started", concurrency=concurrency, types=self.registry.message_types)
        workers = [asyncio.create_task(self._work()) for _ in range(concurrency)]
        chores = retention.start(
            self._engine, self._sessions, self.registry, self.settings, self._log
        )
        try:
            await self._stop.wait()
        finally:
            if chores is not None:
                chores.cancel()
                await asyncio.gather(chores, return_exceptions=True)
            await self._shutdown(workers)

    async def _shutdown(self, workers: list[asyncio.Task[None]]) -> None:
        # Order matters: stop taking work, let in-flight work finish within the
        # grace period, cancel what is left (unsettled, so the broker redelivers
        # it and the inbox absorbs whatever did commit), then close the broker.
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
        await self.broker.close()
        await self.health.close()
        self.running = False
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
            if not self.health.available:  # the gate closed while this loop was waiting:
                await self.health.wait_available()  # hold the delivery, don't burn a count
            self.in_flight += 1
            try:
                if self.tracing is None:
                    await self._handle(delivery)
                else:
                    await self.tracing.delivery(delivery, self._handle)
            except Exception:  # the pump must outlive any bug in a handler or adapter
                self._log.exception("unexpected error", message_id=delivery.message_id)
                if delivery.settled is None:
                    await self._settle(delivery, _Verdict(NACK, "nacked", "unexpected error"))
            finally:
                self.in_flight -= 1

    # -- one delivery -----------------------------------------------------------

    async def _handle(self, delivery: Delivery) -> None:
        settings = self.settings
        if delivery.message_id is None:
            return await self._settle(delivery, _Verdict(DEAD_LETTER, "poison", "no message id"))
        if len(delivery.message_id) > inbox.MESSAGE_ID_LENGTH:
            reason = f"message id longer than {inbox.MESSAGE_ID_LENGTH} characters"
            return await self._settle(delivery, _Verdict(DEAD_LETTER, "poison", reason))
        if delivery.delivery_count > settings.max_deliveries:
            limit = settings.max_deliveries
            reason = f"delivered {delivery.delivery_count} times (WORKER_MAX_DELIVERIES={limit})"
            return await self._settle(delivery, _Verdict(DEAD_LETTER, "exhausted", reason))
        handlers = self.registry.for_type(delivery.type)
        if not handlers:
            reason = f"no handler for message type {delivery.type!r}"
            return await self._settle(delivery, _Verdict(DEAD_LETTER, "poison", reason))

        verdict = _COMMITTED
        decoded: dict[type[BaseModel], BaseModel] = {}
        for handler in handlers:
            message = decoded.get(handler.model)
            if message is None:
                try:
                    message = decoded[handler.model] = handler.model.model_validate_json(
                        delivery.body
                    )
                except ValidationError as exc:
                    reason = f"invalid body for {delivery.type}: {_first_error(exc)}"
                    return await self._settle(delivery, _Verdict(DEAD_LETTER, "poison", reason))
            verdict = await self._consume_observed(delivery, handler, message)
            if verdict.verb != ACK:
                break  # later handlers run on the redelivery; earlier ones are deduplicated
        await self._settle(delivery, verdict)

    async def _consume_observed(
        self, delivery: Delivery, handler: Handler[Any], message: BaseModel
    ) -> _Verdict:
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
    ) -> _Verdict:
        """Run one handler until it commits, is a duplicate, or must give the delivery back."""
        if handler.side_effect:
            return await self._claimed(delivery, handler, message)
        settings = self.settings
        message_id = delivery.message_id
        assert message_id is not None
        consumer = handler.consumer
        fast_path = settings.fast_path and delivery.redelivered and handler.inbox
        attempt = 0
        while True:
            attempt += 1
            session: PumpSession = self._sessions()
            spent = True
            try:
                if fast_path and await inbox.seen(session, message_id, consumer):
                    self._note(delivery, consumer, attempt, "duplicate", fast_path=True)
                    return _DUPLICATE
                if handler.inbox:
                    await inbox.mark(session, message_id, consumer)
                context = Context(
                    session,
                    message_id,
                    consumer,
                    delivery.delivery_count,
                    attempt,
                    delivery.headers,
                )
                running = HANDLER_RUNNING.set(True)
                try:
                    await handler.func(context, message)
                finally:
                    HANDLER_RUNNING.reset(running)
                await AsyncSession.commit(session)
                # Committed: the connection is back in the pool and nothing is left to
                # roll back, so the session is dropped unclosed (one greenlet hop less).
                spent = False
                self._note(delivery, consumer, attempt, "committed")
                return _COMMITTED
            except Poison as exc:
                return _Verdict(DEAD_LETTER, "poison", f"{consumer}: {exc}")
            except Retry as exc:
                self._note(delivery, consumer, attempt, "retry-requested", reason=str(exc))
                return _Verdict(NACK, "retry-requested", str(exc), exc.delay)
            except Exception as exc:
                verdict = await self._after_failure(delivery, handler, attempt, session, exc)
                if verdict is not None:
                    return verdict
            finally:
                if spent:
                    await _discard(session)

    async def _after_failure(
        self,
        delivery: Delivery,
        handler: Handler[Any],
        attempt: int,
        session: AsyncSession,
        exc: Exception,
    ) -> _Verdict | None:
        """Decide after a failed attempt: a verdict, or None after backing off to retry."""
        consumer = handler.consumer
        failure = classify(exc)
        final = await self._final(delivery, handler, attempt, session, exc, failure)
        if final is not None:
            return final
        if failure is Failure.CONNECTION:
            if not await self.health.confirm():
                self._note(delivery, consumer, attempt, "paused", error=exc)
                return _PAUSED
        elif failure is not Failure.CONFLICT and failure is not Failure.TRANSIENT:
            return self._failed(delivery, consumer, attempt, exc)
        settings = self.settings
        if attempt >= settings.max_attempts:
            self._note(delivery, consumer, attempt, "attempts-exhausted", error=exc)
            return _Verdict(NACK, "attempts-exhausted", f"{failure.value}: {exc}")
        self.stats[f"retried-{failure.value}"] += 1
        self._note(delivery, consumer, attempt, "retrying", failure=failure.value)
        # end the failed transaction before backing off: on PostgreSQL it may still hold
        # the marker's key, which a replica racing for the same message would wait on
        await _discard(session)
        await asyncio.sleep(backoff(attempt, settings.retry_backoff, settings.retry_backoff_max))
        return None

    async def _final(
        self,
        delivery: Delivery,
        handler: Handler[Any],
        attempt: int,
        session: AsyncSession,
        exc: Exception,
        failure: Failure,
    ) -> _Verdict | None:
        """The errors that end a delivery without a retry: duplicate, rejected, row deleted."""
        if failure is Failure.DUPLICATE:
            self._note(delivery, handler.consumer, attempt, "duplicate")
            return _DUPLICATE
        rejected = exc if isinstance(exc, Rejected) else None
        if rejected is None and failure is Failure.CONFLICT:  # changed, or gone?
            rejected = await deleted_row(session, exc, self._sessions)
        if rejected is None:
            return None
        await _discard(session)  # on PostgreSQL its marker would block the record's
        return await self._rejected(delivery, handler, attempt, rejected)

    async def _claimed(
        self, delivery: Delivery, handler: Handler[Any], message: BaseModel
    ) -> _Verdict:
        """A side-effect handler: claim with a lease, call, mark finished (worker/claims.py)."""
        try:
            result = await claims.process(
                self._sessions, handler, message, delivery, self.settings, self._log
            )
        except Exception as exc:
            if classify(exc) is Failure.CONNECTION and not await self.health.confirm():
                self._note(delivery, handler.consumer, 1, "paused", error=exc)
                return _PAUSED
            return self._failed(delivery, handler.consumer, 1, exc)
        self._note(delivery, handler.consumer, 1, result.outcome, reason=result.reason)
        return _Verdict(result.verb, result.outcome, result.reason, result.delay)

    async def _rejected(
        self, delivery: Delivery, handler: Handler[Any], attempt: int, exc: Rejected
    ) -> _Verdict:
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
            if classify(error) is Failure.CONNECTION and not await self.health.confirm():
                self._note(delivery, consumer, attempt, "paused", error=error)
                return _PAUSED
            return self._failed(delivery, consumer, attempt, error)
        if not recorded:
            self._note(delivery, consumer, attempt, "duplicate")
            return _DUPLICATE
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
        return _Verdict(ACK, exc.outcome, str(exc))

    def _failed(self, delivery: Delivery, consumer: str, attempt: int, exc: Exception) -> _Verdict:
        reason = f"{consumer}: {type(exc).__name__}: {exc}"
        last = delivery.delivery_count >= self.settings.max_deliveries
        self._log.warning(
            "handler failed",
            message_id=delivery.message_id,
            consumer=consumer,
            attempt=attempt,
            delivery_count=delivery.delivery_count,
            outcome="dead-lettered" if last else "nacked",
            exc_info=exc,
        )
        if last:
            return _Verdict(
                DEAD_LETTER, "exhausted", f"failed {delivery.delivery_count} deliveries: {reason}"
            )
        return _Verdict(NACK, "failed", reason)

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

    async def _settle(self, delivery: Delivery, verdict: _Verdict) -> None:
        """The one place a delivery is settled. A lost settlement is never a success."""
        # Not shielded: the only cancellation is the shutdown's after its grace
        # period, and an ack cut short is a redelivery that the inbox absorbs.
        verb = verdict.verb
        if self.tracing is not None:
            self.tracing.settling(verdict.outcome, verb, verdict.reason)
        try:
            if verb == ACK:
                await delivery.ack()
            elif verb == NACK:
                await delivery.nack(verdict.delay)
            else:
                assert verdict.reason is not None
                await delivery.dead_letter(verdict.reason)
        except (SettlementLost, WorkerError) as exc:
            self.stats["settlement-lost"] += 1
            self._log.warning(
                "settlement lost, broker will redeliver",
                message_id=delivery.message_id,
                verb=verb,
                error=exc,
                outcome="settlement-lost",
            )
            return
        self.stats[verb] += 1
        if verb == DEAD_LETTER:
            self._log.warning(
                "dead-lettered",
                message_id=delivery.message_id,
                type=delivery.type,
                delivery_count=delivery.delivery_count,
                reason=verdict.reason,
                outcome=verdict.outcome,
            )


async def _discard(session: AsyncSession) -> None:
    """Close an attempt's session (rolling back what did not commit), whatever state it is in."""
    try:
        await AsyncSession.close(session)
    except Exception:  # a broken connection can fail its own rollback; the pool drops it
        await AsyncSession.invalidate(session)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"]) or "body"
    return f"{where}: {error['msg']}"
