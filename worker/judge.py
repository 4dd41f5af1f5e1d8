"""What an attempt's end means, for every runner: the failure class decides the verdict.

A transaction, a claim and a batch fail in the same vocabulary (a database error
classified by :func:`worker.db.classify`, a handler's ``Poison`` or ``Retry``, a
business rejection), so one :class:`Judge` turns each into a
:class:`~worker.verdict.Verdict`, counts it and logs it with the message id,
consumer and attempt. The runners keep only their own loops.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from worker.db import Failure, classify, discard
from worker.errors import Poison, Rejected, Retry, StatementSwallowed
from worker.rejections import deleted_row, record_rejection
from worker.retry import backoff
from worker.verdict import (
    DUPLICATE,
    GIVE_BACK_DELAY,
    PAUSED,
    Outcome,
    Verb,
    Verdict,
    failure,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from worker.delivery import Delivery
    from worker.health import DatabaseHealth
    from worker.registry import Handler
    from worker.settings import Settings


class Runner(Protocol):
    """What the pump calls for each handler of a delivery (the handler names it: ``runs``)."""

    async def run(self, delivery: Delivery, handler: Handler[Any], message: BaseModel) -> Verdict:
        """Do the handler's work on the delivery; never raises for the message's own failures."""
        ...


def requested(consumer: str, exc: BaseException, attempt: int) -> Verdict | None:
    """What a handler asked for by raising: ``Poison`` dead-letters at once, ``Retry``
    gives the message back after its delay (counted); None for any other exception."""
    if isinstance(exc, Poison):
        return Verdict(Verb.DEAD_LETTER, Outcome.POISON, f"{consumer}: {exc}", attempt=attempt)
    if isinstance(exc, Retry):
        return Verdict(Verb.NACK, Outcome.RETRY_REQUESTED, str(exc), exc.delay, attempt=attempt)
    return None


def refused_value(consumer: str, exc: BaseException, attempt: int = 0) -> Verdict:
    """A value the database refuses (SQLSTATE class 22): no retry can fix it."""
    reason = f"{consumer}: the database refuses a value: {type(exc).__name__}: {exc}"
    return Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason, attempt=attempt)


class Judge:
    """Verdicts for failed attempts, and the one place their tallies and log lines are made."""

    def __init__(
        self,
        settings: Settings,
        sessions: async_sessionmaker[Any],
        health: DatabaseHealth,
        log: Any,
        stats: Counter[str],
    ) -> None:
        self.settings = settings
        self.health = health
        self.log = log
        self.stats = stats
        self._sessions = sessions

    def note(
        self, delivery: Delivery, consumer: str, attempt: int, outcome: str, **extra: Any
    ) -> None:
        self.stats[outcome] += 1
        if outcome == "committed":
            return  # hot path: logging each commit costs more than its Python work
        log = self.log.info if outcome == "duplicate" else self.log.warning
        if outcome == "retrying":
            log = self.log.debug
        log(
            outcome,
            message_id=delivery.message_id,
            consumer=consumer,
            attempt=attempt,
            outcome=outcome,
            delivery_count=delivery.delivery_count,
            **extra,
        )

    def duplicate(self, delivery: Delivery, consumer: str, attempt: int, path: str) -> Verdict:
        """Another attempt won: ``path`` is how it was seen (fast-path, constraint, ...)."""
        self.stats[f"duplicates-{path}"] += 1
        if path == "fast-path":
            self.note(delivery, consumer, attempt, "duplicate", fast_path=True)
        else:
            self.note(delivery, consumer, attempt, "duplicate")
        return DUPLICATE

    def requested(
        self, delivery: Delivery, consumer: str, attempt: int, exc: Exception
    ) -> Verdict | None:
        verdict = requested(consumer, exc, attempt)
        if verdict is not None and verdict.outcome is Outcome.RETRY_REQUESTED:
            self.note(delivery, consumer, attempt, "retry-requested", reason=str(exc))
        return verdict

    def failed(self, delivery: Delivery, consumer: str, attempt: int, exc: Exception) -> Verdict:
        """An ordinary exception: nack, or dead-letter on the last allowed delivery."""
        verdict = failure(consumer, exc, delivery.delivery_count, self.settings.max_deliveries)
        self.log.warning(
            "handler failed",
            message_id=delivery.message_id,
            consumer=consumer,
            attempt=attempt,
            delivery_count=delivery.delivery_count,
            outcome="dead-lettered" if verdict.verb is Verb.DEAD_LETTER else "nacked",
            exc_info=exc,
        )
        return verdict

    async def after_failure(
        self,
        delivery: Delivery,
        handler: Handler[Any],
        attempt: int,
        deadline: float,
        session: AsyncSession,
        exc: Exception,
    ) -> Verdict | None:
        """Decide after a failed transaction: a verdict, or None after backing off to retry."""
        consumer = handler.consumer
        swallowed = isinstance(exc, StatementSwallowed)
        cause = exc.__cause__ if swallowed and isinstance(exc.__cause__, Exception) else exc
        failed = classify(cause)
        if swallowed:
            self.log.error(
                "handler swallowed a database error",
                message_id=delivery.message_id,
                consumer=consumer,
                attempt=attempt,
                outcome="swallowed",
                error=cause,
                hint=str(exc),
            )
            if failed is Failure.DUPLICATE:  # not the pump's marker: the handler's own insert
                failed = Failure.ERROR
        final = await self._final(delivery, handler, attempt, session, cause, failed)
        if final is not None:
            return final
        if failed is Failure.CONFLICT or failed is Failure.TRANSIENT:
            return await self._contended(
                delivery, consumer, attempt, deadline, session, failed, cause
            )
        if failed is Failure.ERROR:
            return self.failed(delivery, consumer, attempt, exc)
        verdict = await self.database_trouble(delivery, handler, attempt, cause, failed)
        if verdict is not None:
            return verdict
        # a dropped connection, and the database answers: retry, a bounded number of times
        if attempt >= self.settings.max_attempts:
            self.note(delivery, consumer, attempt, "attempts-exhausted", error=cause)
            return Verdict(Verb.NACK, Outcome.ATTEMPTS_EXHAUSTED, f"{failed.value}: {cause}")
        self.stats[f"retried-{failed.value}"] += 1
        await discard(session)
        settings = self.settings
        await asyncio.sleep(backoff(attempt, settings.retry_backoff, settings.retry_backoff_max))
        return None

    async def database_trouble(
        self,
        delivery: Delivery,
        handler: Handler[Any],
        attempt: int,
        exc: Exception,
        failed: Failure | None = None,
    ) -> Verdict | None:
        """Not the message's fault: a verdict that spends no delivery, or None to retry."""
        failed = classify(exc) if failed is None else failed
        consumer = handler.consumer
        if failed is Failure.LOCKED:
            self.note(delivery, consumer, attempt, "in-progress", error=exc)
            reason = "the same message is in progress elsewhere"
            delay = self.settings.marker_lock_timeout
            return Verdict(Verb.NACK, Outcome.IN_PROGRESS, reason, delay, counted=False)
        if failed is Failure.SCHEMA:
            self.health.pause_for_schema(exc)
            self.note(delivery, consumer, attempt, "paused", error=exc)
            reason = "schema behind the code"
            return Verdict(Verb.NACK, Outcome.PAUSED, reason, GIVE_BACK_DELAY, counted=False)
        if failed is Failure.CONNECTION:
            if not await self.health.confirm():
                self.note(delivery, consumer, attempt, "paused", error=exc)
                return PAUSED
            return None
        if failed is Failure.DATA:
            return refused_value(consumer, exc)
        return None

    async def _contended(
        self,
        delivery: Delivery,
        consumer: str,
        attempt: int,
        deadline: float,
        session: AsyncSession,
        failed: Failure,
        exc: Exception,
    ) -> Verdict | None:
        """Someone else committed first: retry on a fresh session until the budget is spent."""
        settings = self.settings
        pause = backoff(attempt, settings.retry_backoff, settings.retry_backoff_max)
        if time.monotonic() + pause > deadline:
            self.note(delivery, consumer, attempt, "attempts-exhausted", error=exc)
            reason = f"{failed.value}: retry budget of {settings.retry_budget}s spent: {exc}"
            return Verdict(
                Verb.NACK, Outcome.ATTEMPTS_EXHAUSTED, reason, GIVE_BACK_DELAY, counted=False
            )
        self.stats[f"retried-{failed.value}"] += 1
        self.note(delivery, consumer, attempt, "retrying", failure=failed.value)
        # end the failed transaction before backing off: on PostgreSQL it may still hold
        # the marker's key, which a replica racing for the same message would wait on
        await discard(session)
        await asyncio.sleep(pause)
        return None

    async def _final(
        self,
        delivery: Delivery,
        handler: Handler[Any],
        attempt: int,
        session: AsyncSession,
        exc: Exception,
        failed: Failure,
    ) -> Verdict | None:
        """The errors that end a delivery without a retry: duplicate, rejected, row deleted."""
        if failed is Failure.DUPLICATE:
            return self.duplicate(delivery, handler.consumer, attempt, "constraint")
        rejected = exc if isinstance(exc, Rejected) else None
        if rejected is None and failed is Failure.CONFLICT:  # changed, or gone?
            # end the failed transaction first: it still holds the marker's key (on SQLite
            # the write lock), which the lookup's fresh connection would wait on
            await discard(session)
            rejected = await deleted_row(session, exc, self._sessions)
        if rejected is None:
            return None
        await discard(session)  # on PostgreSQL its marker would block the record's
        return await self._rejected(delivery, handler, attempt, rejected)

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
            verdict = await self.database_trouble(delivery, handler, attempt, error)
            return (
                verdict if verdict is not None else self.failed(delivery, consumer, attempt, error)
            )
        if not recorded:
            return self.duplicate(delivery, consumer, attempt, "constraint")
        self.note(
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
