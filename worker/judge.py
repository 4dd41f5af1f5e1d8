"""How an attempt ends: one module for every runner. An exception in, a verdict out.

A transaction, a group and a claim fail in one vocabulary (a database error classified
by :func:`worker.db.classify`, a handler's ``Poison`` or ``Retry``, a business
rejection), so one :class:`Judge` names each ending, tallies it and logs it with the
message id, consumer and attempt, and does the I/O a verdict needs: it tells a row
another writer deleted from one it changed, records a rejection with its inbox marker
before the ack, pings a database whose connection broke, and closes the intake gate
for a database that cannot serve anyone. An :class:`Again` says "run the attempt
again on a fresh session after this delay".
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from worker.db import Failure, classify
from worker.errors import Poison, Rejected, Retry, StatementSwallowed
from worker.rejections import deleted_row, record_rejection
from worker.retry import backoff
from worker.verdict import (
    COMMITTED,
    DUPLICATE,
    GIVE_BACK_DELAY,
    PAUSED,
    Outcome,
    Verb,
    Verdict,
    failure,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

    from worker.delivery import Delivery
    from worker.health import DatabaseHealth
    from worker.registry import Handler
    from worker.settings import Settings

_SCHEMA_PROOF = 60.0
"""A consumer that committed this recently has the schema it needs: a table that one of
its messages misses is that message's failure (a handler branch naming a missing table)."""


@dataclass(frozen=True, slots=True)
class Again:
    """Not an ending: run the attempt again on a fresh session after ``delay`` seconds."""

    delay: float


def requested(consumer: str, exc: BaseException, attempt: int) -> Verdict | None:
    """What a handler asked for by raising: ``Poison`` dead-letters at once, ``Retry``
    gives the message back after its delay (counted); None for any other exception."""
    if isinstance(exc, Poison):
        reason = f"{consumer}: {exc}"
        return Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason, attempt=attempt, consumer=consumer)
    if isinstance(exc, Retry):
        return Verdict(
            Verb.NACK,
            Outcome.RETRY_REQUESTED,
            str(exc),
            exc.delay,
            attempt=attempt,
            consumer=consumer,
        )
    return None


def refused_value(consumer: str, exc: BaseException, attempt: int = 0) -> Verdict:
    """A value the database refuses (SQLSTATE class 22): no retry can fix it."""
    reason = f"{consumer}: the database refuses a value: {type(exc).__name__}: {exc}"
    return Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason, attempt=attempt, consumer=consumer)


def cause_of(exc: BaseException) -> BaseException:
    """The database error behind a swallowed statement, else the exception itself."""
    if isinstance(exc, StatementSwallowed) and isinstance(exc.__cause__, Exception):
        return exc.__cause__
    return exc


def failure_of(exc: BaseException) -> Failure:
    """The failure class of an attempt's exception. A unique violation the handler
    swallowed is its own insert's, never the marker's: an ordinary error."""
    failed = classify(cause_of(exc))
    if failed is Failure.DUPLICATE and isinstance(exc, StatementSwallowed):
        return Failure.ERROR
    return failed


class Judge:
    """Endings of failed attempts, their I/O, and the one place their tallies and log
    lines are made."""

    def __init__(
        self,
        settings: Settings,
        log: Any,
        stats: Counter[str],
        sessions: async_sessionmaker[Any],
        health: DatabaseHealth,
    ) -> None:
        self.settings = settings
        self.log = log
        self.stats = stats
        self.health = health
        self._sessions = sessions
        self.committed_at: dict[str, float] = {}
        """consumer -> time.monotonic() of its last commit (the runners write it)."""

    # -- endings that need the database -------------------------------------------------

    async def ended(
        self,
        delivery: Delivery,
        handler: Handler[Any],
        attempt: int,
        exc: BaseException,
        deadline: float,
        session: AsyncSession | None = None,
    ) -> Verdict | Again:
        """How a failed attempt ends, after the I/O its verdict needs. ``deadline``: when
        the contention budget runs out (time.monotonic()); ``session``: the attempt's,
        discarded already, which remembers what its failed flush wrote."""
        consumer = handler.consumer
        verdict = self.requested(delivery, consumer, attempt, exc)
        if verdict is not None:
            return verdict
        if isinstance(exc, StatementSwallowed):
            self.swallowed(delivery, consumer, attempt, exc)
        failed = failure_of(exc)
        rejected = exc if isinstance(exc, Rejected) else None
        if rejected is None and failed is Failure.CONFLICT and session is not None:
            # changed, or gone? (the session is discarded; it remembers what it wrote)
            rejected = await deleted_row(session, cause_of(exc), self._sessions)
        if rejected is not None:
            return await self.reject(delivery, handler, attempt, rejected)
        answers = True
        if failed is Failure.CONNECTION:
            answers = await self.health.confirm()
        elif failed.environment:
            await self.health.pause_for(failed, cause_of(exc))
        return self.decide(delivery, consumer, attempt, exc, failed, deadline, answers)

    async def reject(
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
            ending = await self.ended(delivery, handler, attempt, error, 0.0)
            if isinstance(ending, Again):
                return self.failed(delivery, consumer, attempt, error)
            return ending
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
        return replace(COMMITTED, outcome=exc.outcome, reason=str(exc), consumer=consumer)

    async def stopped(self, delivery: Delivery, handler: Handler[Any], exc: Exception) -> Verdict:
        """A failure outside the handler's attempts (a claim's, a check past the limit):
        the ending, with no retry in process (a retry is the redelivery)."""
        ending = await self.ended(delivery, handler, 1, exc, 0.0)
        if isinstance(ending, Again):  # a connection dropped and the database answers
            return self.failed(delivery, handler.consumer, 1, exc)
        return ending

    # -- endings from what the runner saw ------------------------------------------------

    def note(
        self, delivery: Delivery, consumer: str, attempt: int, outcome: str, **extra: Any
    ) -> None:
        self.stats[outcome] += 1
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
        self, delivery: Delivery, consumer: str, attempt: int, exc: BaseException
    ) -> Verdict | None:
        verdict = requested(consumer, exc, attempt)
        if verdict is not None and verdict.outcome is Outcome.RETRY_REQUESTED:
            self.note(delivery, consumer, attempt, "retry-requested", reason=str(exc))
        return verdict

    def failed(
        self, delivery: Delivery, consumer: str, attempt: int, exc: BaseException
    ) -> Verdict:
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
        return replace(verdict, attempt=attempt, consumer=consumer)

    def swallowed(
        self, delivery: Delivery, consumer: str, attempt: int, exc: StatementSwallowed
    ) -> None:
        self.log.error(
            "handler swallowed a database error",
            message_id=delivery.message_id,
            consumer=consumer,
            attempt=attempt,
            outcome="swallowed",
            error=cause_of(exc),
            hint=str(exc),
        )

    def decide(
        self,
        delivery: Delivery,
        consumer: str,
        attempt: int,
        exc: BaseException,
        failed: Failure,
        deadline: float,
        answers: bool = True,
    ) -> Verdict | Again:
        """The ending of a failed attempt that raised no ``Poison``/``Retry`` and was no
        rejection. ``answers``: for a lost connection, whether the database answered a
        ping since."""
        cause = cause_of(exc)
        settings = self.settings
        if failed is Failure.DUPLICATE:
            return self.duplicate(delivery, consumer, attempt, "constraint")
        if failed is Failure.CONFLICT or failed is Failure.TRANSIENT:
            pause = backoff(attempt, settings.retry_backoff, settings.retry_backoff_max)
            if time.monotonic() + pause > deadline:
                self.note(delivery, consumer, attempt, "attempts-exhausted", error=cause)
                reason = f"{failed.value}: retry budget of {settings.retry_budget}s spent: {cause}"
                return _give_back(Outcome.ATTEMPTS_EXHAUSTED, reason, attempt, consumer)
            self.stats[f"retried-{failed.value}"] += 1
            self.note(delivery, consumer, attempt, "retrying", failure=failed.value)
            return Again(pause)
        if failed is Failure.LOCKED:
            self.note(delivery, consumer, attempt, "in-progress", error=cause)
            reason = "the same message is in progress elsewhere"
            return _give_back(
                Outcome.IN_PROGRESS, reason, attempt, consumer, settings.marker_lock_timeout
            )
        if failed is Failure.DATA:
            return refused_value(consumer, cause, attempt)
        if failed is Failure.SCHEMA:
            return self._schema(delivery, consumer, attempt, exc)
        if failed.environment or (failed is Failure.CONNECTION and not answers):
            self.note(delivery, consumer, attempt, "paused", error=cause, trouble=failed.value)
            return replace(PAUSED, attempt=attempt, consumer=consumer)
        if failed is Failure.CONNECTION:  # dropped, and the database answers: a few more tries
            if attempt >= settings.max_attempts:
                self.note(delivery, consumer, attempt, "attempts-exhausted", error=cause)
                reason = f"{failed.value}: {cause}"
                return Verdict(
                    Verb.NACK,
                    Outcome.ATTEMPTS_EXHAUSTED,
                    reason,
                    attempt=attempt,
                    consumer=consumer,
                )
            self.stats[f"retried-{failed.value}"] += 1
            return Again(backoff(attempt, settings.retry_backoff, settings.retry_backoff_max))
        return self.failed(delivery, consumer, attempt, exc)

    def _schema(
        self, delivery: Delivery, consumer: str, attempt: int, exc: BaseException
    ) -> Verdict:
        """A table or column missing. While this consumer commits other messages, the
        schema is there and this message's branch names what is not: its own failure.
        Otherwise the code is ahead of its migration: an uncounted, bounded give-back
        (intake goes on with other types meanwhile; no pause of the whole pump)."""
        cause = cause_of(exc)
        last = self.committed_at.get(consumer)
        if last is not None and time.monotonic() - last < _SCHEMA_PROOF:
            return self.failed(delivery, consumer, attempt, exc)
        self.note(delivery, consumer, attempt, "schema-behind", error=cause)
        reason = f"schema behind the code: {cause}"
        return _give_back(Outcome.SCHEMA_BEHIND, reason, attempt, consumer)


def _give_back(
    outcome: Outcome, reason: str, attempt: int, consumer: str, delay: float = GIVE_BACK_DELAY
) -> Verdict:
    """Not the message's fault, but its own path: uncounted, and bounded by its give-backs."""
    return Verdict(
        Verb.NACK, outcome, reason, delay, counted=False, attempt=attempt, consumer=consumer
    )
