"""How one handler's work on a delivery ends: one vocabulary for the pump, the claims,
the metrics and the logs.

A :class:`Verdict` joins the settlement :class:`Verb` the broker sees to the
:class:`Outcome` the worker records; :func:`failure` is the one rule for an
ordinary exception (nack, and dead-letter on the last allowed delivery); what a
handler asks for by raising ``Poison`` or ``Retry`` is :func:`worker.judge.requested`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verb(enum.StrEnum):
    """What the broker is told."""

    ACK = "ack"
    NACK = "nack"
    DEAD_LETTER = "dead-letter"


class Outcome(enum.StrEnum):
    """What happened, as logs, traces and metrics name it."""

    COMMITTED = "committed"
    DUPLICATE = "duplicate"
    POISON = "poison"
    EXHAUSTED = "exhausted"
    FAILED = "failed"
    NACKED = "nacked"  # an unexpected error outside any handler
    RETRY_REQUESTED = "retry-requested"
    ATTEMPTS_EXHAUSTED = "attempts-exhausted"
    PAUSED = "paused"
    SCHEMA_BEHIND = "schema-behind"
    KEY_BUSY = "key-busy"
    IN_PROGRESS = "in-progress"
    SHUTDOWN = "shutdown"
    HELD_BACK = "held-back"  # behind a record of its delivery group that did not commit
    REJECTED = "rejected"
    PRECONDITION_FAILED = "precondition-failed"
    DELETED = "deleted"
    MERGE_CONFLICT = "merge-conflict"
    CLAIM_HELD = "claim-held"
    CLAIM_CONTENDED = "claim-contended"
    LEASE_SPENT = "lease-spent"
    FINISH_CONTENDED = "finish-contended"
    CALL_TIMEOUT = "call-timeout"

    @property
    def settlement(self) -> str:
        """The metrics' ``outcome`` label: committed, duplicate, dead-lettered, nacked, or
        the outcome's own name (rejections, claims' waits, shutdown give-backs)."""
        return _SETTLEMENT.get(self, self.value)


_SETTLEMENT = {
    Outcome.COMMITTED: "committed",
    Outcome.DUPLICATE: "duplicate",
    Outcome.POISON: "dead-lettered",
    Outcome.EXHAUSTED: "dead-lettered",
    Outcome.FAILED: "nacked",
    Outcome.ATTEMPTS_EXHAUSTED: "nacked",
    Outcome.PAUSED: "nacked",
    Outcome.SCHEMA_BEHIND: "nacked",
    Outcome.RETRY_REQUESTED: "nacked",
    Outcome.NACKED: "nacked",
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """One handler's end on one delivery, for the pump's single settlement point.

    ``counted=False`` keeps the delivery count where it is: the message is not to
    blame (contention, a twin in progress elsewhere, a claim held elsewhere). Such a
    give-back is still this message's path, so it is bounded: each one adds to the
    message's ``give_backs``, its delay grows with them, and past
    ``WORKER_MAX_GIVE_BACKS`` it counts (:mod:`worker.settle`).

    That holds when the environment is at fault too (the database is away, read-only
    or full): the pump pauses until a probe says it is over and takes nothing
    meanwhile, so a message meets the fault again only if it trips it right after each
    recovery, which is what a message that causes it does (a write too big for the
    disk, a query over a per-query limit): bounded like any other give-back.

    ``bounded_elsewhere=True`` (with ``counted=False``): the give-back is bounded by
    something other than the message's give-backs: the shutdown itself, or the earlier
    record of its delivery group that it waits behind.

    ``attempt`` and ``consumer`` are filled in on the unhappy path only, for the log
    lines (a commit or a duplicate is the shared constant).
    """

    verb: Verb
    outcome: Outcome
    reason: str | None = None
    delay: float | None = None
    counted: bool = True
    attempt: int = 0  # the handler attempt that ended it (0: before any handler ran)
    bounded_elsewhere: bool = False
    consumer: str = ""


COMMITTED = Verdict(Verb.ACK, Outcome.COMMITTED)
DUPLICATE = Verdict(Verb.ACK, Outcome.DUPLICATE)


def last_delivery(delivery_count: int, max_deliveries: int) -> bool:
    return delivery_count >= max_deliveries


def failure(consumer: str, exc: BaseException, delivery_count: int, max_deliveries: int) -> Verdict:
    """An ordinary exception: nack; on the last allowed delivery, dead-letter ("exhausted")."""
    reason = f"{consumer}: {type(exc).__name__}: {exc}"
    if last_delivery(delivery_count, max_deliveries):
        reason = f"failed {delivery_count} deliveries: {reason}"
        return Verdict(Verb.DEAD_LETTER, Outcome.EXHAUSTED, reason)
    return Verdict(Verb.NACK, Outcome.FAILED, reason)


GIVE_BACK_DELAY = 1.0
"""Seconds before an uncounted give-back (pause, contention, shutdown) comes back."""

PAUSED = Verdict(Verb.NACK, Outcome.PAUSED, "database unavailable", GIVE_BACK_DELAY, counted=False)
HELD_BACK = Verdict(
    Verb.NACK,
    Outcome.HELD_BACK,
    "an earlier record of its delivery group was given back",
    0.0,
    counted=False,
    bounded_elsewhere=True,  # by the earlier record's own bound
)
"""A record behind one of its delivery group that was given back: the adapter rewinds the
group to the earlier one (Kafka seeks back), so this one must not run before it."""
STOPPING = Verdict(
    Verb.NACK,
    Outcome.SHUTDOWN,
    "the worker is stopping",
    0.0,
    counted=False,
    bounded_elsewhere=True,
)


def unexpected(delivery_count: int, max_deliveries: int, error: BaseException) -> Verdict:
    """A bug outside any handler: nack (counted), or dead-letter on the last allowed
    delivery, so that a delivery that always meets it still ends."""
    reason = f"unexpected error: {type(error).__name__}: {error}"
    if last_delivery(delivery_count, max_deliveries):
        return Verdict(
            Verb.DEAD_LETTER, Outcome.EXHAUSTED, f"failed {delivery_count} deliveries: {reason}"
        )
    return Verdict(Verb.NACK, Outcome.NACKED, reason)


def poison(reason: str) -> Verdict:
    """What no handler can run (refused by intake, or ``Poison`` raised): dead-letter at once."""
    return Verdict(Verb.DEAD_LETTER, Outcome.POISON, reason)
