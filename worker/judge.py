"""The judge: how a failed attempt ends, for every runner. Exception in, verdict out.

A transaction, a claim and a batch fail in one vocabulary (a database error
classified by :func:`worker.db.classify`, a handler's ``Poison`` or ``Retry``, a
business rejection), so one :class:`Judge` names each ending, counts it and logs it
with the message id, consumer and attempt. It awaits nothing: what needs the
database (telling a deleted row from a changed one, recording a rejection, pinging,
pausing) is the runners' to do, and the judge is told the answer. An
:class:`Again` says "retry on a fresh session after this delay".
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worker.db import Failure, classify
from worker.errors import Poison, Retry, StatementSwallowed
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
    from worker.delivery import Delivery
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
        return Verdict(Verb.DEAD_LETTER, Outcome.POISON, f"{consumer}: {exc}", attempt=attempt)
    if isinstance(exc, Retry):
        return Verdict(Verb.NACK, Outcome.RETRY_REQUESTED, str(exc), exc.delay, attempt=attempt)
    return None


def refused_value(consumer: str, exc: BaseException, attempt: int = 0) -> Verdict:
    """A value the database refuses (SQLSTATE class 22): no retry can fix it."""
    reason = f"{consumer}: the database refuses a value: {type(exc).__name__}: {exc}"
    return Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason, attempt=attempt)


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
    """Verdicts for failed attempts, and the one place their tallies and log lines are made."""

    def __init__(self, settings: Settings, log: Any, stats: Counter[str]) -> None:
        self.settings = settings
        self.log = log
        self.stats = stats
        self._committed: dict[str, float] = {}  # consumer -> time.monotonic() of its last commit

    def committed(self, consumer: str) -> None:
        self._committed[consumer] = time.monotonic()

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
        return Verdict(
            verdict.verb, verdict.outcome, verdict.reason, verdict.delay, attempt=attempt
        )

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
        *,
        deadline: float,
        answers: bool = True,
    ) -> Verdict | Again:
        """The ending of a failed attempt that raised no ``Poison``/``Retry`` and was no
        rejection. ``deadline``: when the contention budget runs out (time.monotonic());
        ``answers``: for a lost connection, whether the database answered a ping since."""
        cause = cause_of(exc)
        settings = self.settings
        if failed is Failure.DUPLICATE:
            return self.duplicate(delivery, consumer, attempt, "constraint")
        if failed is Failure.CONFLICT or failed is Failure.TRANSIENT:
            pause = backoff(attempt, settings.retry_backoff, settings.retry_backoff_max)
            if time.monotonic() + pause > deadline:
                self.note(delivery, consumer, attempt, "attempts-exhausted", error=cause)
                reason = f"{failed.value}: retry budget of {settings.retry_budget}s spent: {cause}"
                return _give_back(Outcome.ATTEMPTS_EXHAUSTED, reason, attempt)
            self.stats[f"retried-{failed.value}"] += 1
            self.note(delivery, consumer, attempt, "retrying", failure=failed.value)
            return Again(pause)
        if failed is Failure.LOCKED:
            self.note(delivery, consumer, attempt, "in-progress", error=cause)
            reason = "the same message is in progress elsewhere"
            return _give_back(Outcome.IN_PROGRESS, reason, attempt, settings.marker_lock_timeout)
        if failed is Failure.DATA:
            return refused_value(consumer, cause, attempt)
        if failed is Failure.SCHEMA:
            return self._schema(delivery, consumer, attempt, exc)
        if failed.environment or (failed is Failure.CONNECTION and not answers):
            self.note(delivery, consumer, attempt, "paused", error=cause, trouble=failed.value)
            return PAUSED
        if failed is Failure.CONNECTION:  # dropped, and the database answers: a few more tries
            if attempt >= settings.max_attempts:
                self.note(delivery, consumer, attempt, "attempts-exhausted", error=cause)
                reason = f"{failed.value}: {cause}"
                return Verdict(Verb.NACK, Outcome.ATTEMPTS_EXHAUSTED, reason, attempt=attempt)
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
        last = self._committed.get(consumer)
        if last is not None and time.monotonic() - last < _SCHEMA_PROOF:
            return self.failed(delivery, consumer, attempt, exc)
        self.note(delivery, consumer, attempt, "schema-behind", error=cause)
        return _give_back(Outcome.SCHEMA_BEHIND, f"schema behind the code: {cause}", attempt)


def _give_back(
    outcome: Outcome, reason: str, attempt: int, delay: float = GIVE_BACK_DELAY
) -> Verdict:
    """Not the message's fault, but its own path: uncounted, and bounded by its give-backs."""
    return Verdict(Verb.NACK, outcome, reason, delay, counted=False, attempt=attempt)
