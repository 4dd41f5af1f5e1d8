"""Side effects that cannot join the transaction: two-phase claims with a lease.

An e-mail, a card charge or an HTTP call cannot be rolled back with the
database, so a side-effect handler runs in phases instead of one commit::

    claim:  INSERT the marker as "claimed" with a lease, COMMIT
    call:   the handler's external call, keyed by the message id
    mark:   UPDATE the marker to "finished" with the outcome, COMMIT

A redelivery finds the marker and decides from its state:

=====================================  ================================================
marker                                 what happens
=====================================  ================================================
finished                               ack: the call was made and recorded
claimed, lease still running           nack after the rest of the lease: the owner may
                                       still be calling, and if it died we come back
claimed, lease expired                 take it over with a conditional UPDATE (one
                                       replica wins), repeat the call with the same key
abandoned                              take it over at once, as if there were no marker
=====================================  ================================================

A crash between claim and call therefore delays the call by one lease instead
of skipping it forever; a crash between call and mark repeats the call with the
same idempotency key, which the provider deduplicates. A failed call releases
the lease (so the redelivery may take over at once) and is never marked
finished. A call that timed out keeps its lease: its outcome is unknown (the
provider may still be working on it), so nobody calls again with the same key
until the lease has run out; the delivery comes back after the rest of the
lease. Lease times come from the database's clock on PostgreSQL, so a replica
whose clock runs fast cannot steal a live claim, and the call is bounded by the
lease as the database set it, measured from before the claim's statement was
sent: a slow claim (a commit, a lock wait) shortens the call, never the margin.

Only one replica's "finished" mark commits: a replica whose mark finds the claim
already finished (its lease ran out and a takeover finished first) rolls its
own writes back, since the winner's writes recorded the same call.

A claim whose message was dead-lettered (``Poison``, or a failure on the last
allowed delivery) is marked *abandoned*: terminal for the sweeper, which never
calls for it again, yet no obstacle to a new delivery of the message (a
re-submitted dead letter), which takes it over.

A claim stores the message body, so :mod:`worker.sweeper` (``worker sweep``)
can finish a claim left past its lease without a redelivery.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pydantic import BaseModel
from sqlalchemy import (
    ColumnElement,
    DateTime,
    Interval,
    Table,
    and_,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from worker.db import HANDLER_RUNNING, Failure, classify, discard, insert_ignoring_conflicts
from worker.errors import Poison, Retry
from worker.inbox import InboxMarker
from worker.logs import scrub
from worker.registry import Context, Handler, HandlerFunc, Registry, registry
from worker.retry import backoff
from worker.verdict import Outcome, Verb, Verdict, last_delivery

if TYPE_CHECKING:
    from worker.delivery import Delivery
    from worker.judge import Judge
    from worker.settings import Settings

M = TypeVar("M", bound=BaseModel)

CLAIMED, FINISHED, ABANDONED = "claimed", "finished", "abandoned"

_inbox = cast(Table, InboxMarker.__table__)
_OWNER_PREFIX = f"{socket.gethostname()}:{os.getpid()}"[:110]
_OUTCOME_LENGTH = 255  # inbox.outcome


def _outcome(text: str) -> str:
    """An outcome as the inbox stores it: scrubbed first, then cut (a cut URL hides from scrub)."""
    return scrub(text)[:_OUTCOME_LENGTH]


# Database trouble that is nobody's verdict on the claim: the pump pauses or gives back.
_NOT_NOW = frozenset({Failure.CONNECTION, Failure.SCHEMA, Failure.LOCKED})


def _margin(lease: float) -> float:
    """How long before its lease ends a call is cut: room for the loop's lag and the cut itself."""
    return min(1.0, lease * 0.1)


class ClaimContext(Context):
    """The context of a side-effect handler: the claim it holds and the worker's settings.

    ``session`` is committed together with the "finished" mark, after the call.
    It connects lazily: a handler that calls first and writes afterwards holds
    no connection while it waits on the network.
    """

    __slots__ = ("call_deadline", "claim", "settings")

    claim: Claim
    settings: Settings
    call_deadline: float  # time.monotonic() by which the call is cut

    @property
    def idempotency_key(self) -> str:
        """The key the provider deduplicates repeated calls by: the message id."""
        return self.message_id

    @property
    def time_left(self) -> float:
        """Seconds until the call is cut (the call timeout or the lease, whichever ends first).

        Use it as the HTTP client's timeout, so the client gives up by itself.
        """
        return max(0.0, self.call_deadline - time.monotonic())


ClaimFunc = Callable[[ClaimContext, M], Awaitable[str | None]]
"""A side-effect handler; what it returns is stored as the claim's outcome.

An exception is a definite failure: the lease is released for a redelivery to
take over. A ``TimeoutError`` (raised, or let through from a client that gave
up waiting for an answer) means "sent, outcome unknown": the lease is kept.
"""


def side_effect(
    message_type: str, model: type[M], *, consumer: str, registry: Registry = registry
) -> Callable[[ClaimFunc[M]], ClaimFunc[M]]:
    """Register a side-effect handler: ``@side_effect("SendWelcomeEmail", Model, consumer=...)``."""

    def register(func: ClaimFunc[M]) -> ClaimFunc[M]:
        as_handler = cast(HandlerFunc[M], func)  # the pump calls it through claims.process
        registry.handler(message_type, model, consumer=consumer, side_effect=True)(as_handler)
        return func

    return register


@dataclass(frozen=True, slots=True)
class Claim:
    """A claim this replica holds."""

    id: int
    owner: str
    attempts: int  # 1 for the first claim, +1 for every takeover
    lease_until: datetime
    # time.monotonic() by which a call under this claim must have ended: the lease as the
    # database set it, counted from before the claim's statement was sent, minus a margin
    deadline: float = float("inf")

    @property
    def taken_over(self) -> bool:
        return self.attempts > 1


@dataclass(frozen=True, slots=True)
class Held:
    """Someone else's live claim, and how long its lease still runs."""

    remaining: float


# -- phase 1: claim ------------------------------------------------------------------


def _now(session: AsyncSession) -> ColumnElement[datetime]:
    if session.get_bind().dialect.name == "postgresql":
        return func.statement_timestamp()  # not now(): that is the transaction's start
    # SQLite has no server apart from this host, so its clock is ours
    return literal(datetime.now(UTC), DateTime(timezone=True))


def _after(session: AsyncSession, seconds: float) -> ColumnElement[datetime]:
    if session.get_bind().dialect.name == "postgresql":
        return func.statement_timestamp() + literal(timedelta(seconds=seconds), Interval())
    return literal(datetime.now(UTC) + timedelta(seconds=seconds), DateTime(timezone=True))


def _owner() -> str:
    return f"{_OWNER_PREFIX}:{uuid.uuid4().hex[:12]}"


def _claim(row: Any, owner: str, attempts: int, started: float) -> Claim:
    """A claim from its statement's RETURNING row (id, lease_until, now).

    The lease started at the statement's own time, which is later than ``started``
    (taken before the statement was sent), so ``started`` + the lease the database
    set ends no later than the lease does, whatever the commit and the network
    cost afterwards, and without comparing this host's clock with the database's.
    """
    lease_until = _aware(row.lease_until)
    lease = (lease_until - _aware(row.now)).total_seconds()
    return Claim(row.id, owner, attempts, lease_until, started + lease - _margin(lease))


async def acquire(
    sessions: async_sessionmaker[Any],
    message_id: str,
    consumer: str,
    lease: float,
    *,
    message_type: str | None = None,
    body: bytes | None = None,
) -> Claim | Held | None:
    """Claim ``(message_id, consumer)``: a :class:`Claim`, a live claim elsewhere, None if finished.

    One short transaction: insert the claimed marker, or take an expired claim
    over, or read why neither was possible.
    """
    started = time.monotonic()  # before any lease can start: see _claim
    session: AsyncSession = sessions()
    owner = _owner()
    try:
        fresh = insert_ignoring_conflicts(session, InboxMarker).values(
            message_id=message_id,
            consumer=consumer,
            state=CLAIMED,
            processed_at=None,
            lease_until=_after(session, lease),
            claimed_by=owner,
            attempts=1,
            message_type=message_type,
            body=body,
        )
        returning = fresh.returning(_inbox.c.id, _inbox.c.lease_until, _now(session).label("now"))
        row = (await session.execute(returning)).first()
        if row is not None:
            await AsyncSession.commit(session)
            return _claim(row, owner, 1, started)
        mine = _inbox.c.message_id == message_id, _inbox.c.consumer == consumer
        claim = await _take_over(session, mine, owner, lease, started, abandoned=True)
        if claim is not None:
            await AsyncSession.commit(session)
            return claim
        state = (
            await session.execute(
                select(_inbox.c.state, _inbox.c.lease_until, _now(session).label("now")).where(
                    *mine
                )
            )
        ).first()
        if state is None:
            return Held(0.0)  # purged in between: look again
        if state.state == FINISHED:
            return None
        if state.lease_until is None:
            return Held(0.0)  # abandoned (or released) in between: look again
        # a live lease; an abandoned claim keeps one after a call that timed out
        return Held(max(0.0, (_aware(state.lease_until) - _aware(state.now)).total_seconds()))
    finally:
        await discard(session)


async def _take_over(
    session: AsyncSession,
    where: tuple[ColumnElement[bool], ...],
    owner: str,
    lease: float,
    started: float,
    *,
    abandoned: bool = False,
) -> Claim | None:
    """The conditional UPDATE: only a claim whose lease has run out, so only one replica wins.

    On PostgreSQL a second replica's UPDATE waits for the first's row lock and
    then re-checks the WHERE against the new lease, which no longer qualifies.
    ``abandoned``: a new delivery may also take an abandoned claim (the sweeper may
    not), once the lease it may still carry (a call that timed out) has run out.
    """
    now = _now(session)
    expired = and_(_inbox.c.state == CLAIMED, _inbox.c.lease_until < now)
    given_up = and_(
        _inbox.c.state == ABANDONED,
        or_(_inbox.c.lease_until.is_(None), _inbox.c.lease_until < now),
    )
    statement = (
        update(_inbox)
        .where(*where, or_(expired, given_up) if abandoned else expired)
        .values(
            state=CLAIMED,
            processed_at=None,
            claimed_by=owner,
            lease_until=_after(session, lease),
            attempts=_inbox.c.attempts + 1,
        )
        .returning(_inbox.c.id, _inbox.c.attempts, _inbox.c.lease_until, now.label("now"))
    )
    row = (await session.execute(statement)).first()
    return None if row is None else _claim(row, owner, row.attempts, started)


async def take_over(sessions: async_sessionmaker[Any], claim_id: int, lease: float) -> Claim | None:
    """Take the expired claim ``claim_id`` over (the sweeper's way in); None if someone else won."""
    started = time.monotonic()
    session: AsyncSession = sessions()
    try:
        claim = await _take_over(session, (_inbox.c.id == claim_id,), _owner(), lease, started)
        await AsyncSession.commit(session)
        return claim
    finally:
        await discard(session)


# -- the runner: what the pump calls for a side-effect handler -------------------------


class ClaimRunner:
    """A side-effect handler on one delivery: claim with a lease, call, mark finished.

    Errors the claim protocol does not decide itself (an outage, a broken statement)
    end as they would for an ordinary handler, through the :class:`~worker.judge.Judge`.
    """

    def __init__(self, sessions: async_sessionmaker[Any], judge: Judge) -> None:
        self.judge = judge
        self._sessions = sessions

    async def run(self, delivery: Delivery, handler: Handler[Any], message: BaseModel) -> Verdict:
        judge = self.judge
        try:
            verdict = await process(
                self._sessions, handler, message, delivery, judge.settings, judge.log
            )
        except Exception as exc:
            trouble = await judge.database_trouble(delivery, handler, 1, exc)
            return (
                trouble if trouble is not None else judge.failed(delivery, handler.consumer, 1, exc)
            )
        judge.note(delivery, handler.consumer, 1, verdict.outcome, reason=verdict.reason)
        return replace(verdict, attempt=1)


# -- phases 2 and 3: call, then mark -----------------------------------------------------


async def process(
    sessions: async_sessionmaker[Any],
    handler: Handler[Any],
    message: BaseModel,
    delivery: Delivery,
    settings: Settings,
    log: Any,
) -> Verdict:
    """One delivery of a side-effect message: claim, call, mark; the pump settles its Verdict."""
    message_id = delivery.message_id
    assert message_id is not None
    try:
        got = await acquire(
            sessions,
            message_id,
            handler.consumer,
            settings.claim_lease,
            message_type=delivery.type,
            body=delivery.body,
        )
    except Exception as exc:
        failure = classify(exc)
        if failure is not Failure.TRANSIENT and failure is not Failure.CONFLICT:
            raise  # the pump decides: an outage pauses it, anything else is a failure
        # A deadlock or a busy SQLite file on the claim: contention, not the message's fault.
        delay = backoff(delivery.delivery_count, settings.retry_backoff, settings.retry_backoff_max)
        reason = scrub(f"claim contended ({failure.value}): {type(exc).__name__}: {exc}")
        return Verdict(Verb.NACK, Outcome.CLAIM_CONTENDED, reason, delay, counted=False)
    if got is None:
        return Verdict(Verb.ACK, Outcome.DUPLICATE)
    if isinstance(got, Held):
        # Come back when the lease has run out: finished by then, or ours to take over.
        # Waiting for someone else's lease is not this message's failure: not counted.
        delay = min(settings.claim_lease, got.remaining + 0.05)
        reason = f"claimed elsewhere, lease ends in {got.remaining:.1f}s"
        return Verdict(Verb.NACK, Outcome.CLAIM_HELD, reason, delay, counted=False)
    if got.taken_over:
        log.warning(
            "expired claim taken over",
            message_id=message_id,
            consumer=handler.consumer,
            attempt=got.attempts,
            outcome="taken-over",
        )
    return await run(
        sessions,
        handler,
        message,
        got,
        settings,
        log,
        message_id=message_id,
        delivery_count=delivery.delivery_count,
        headers=delivery.headers,
    )


async def run(
    sessions: async_sessionmaker[Any],
    handler: Handler[Any],
    message: BaseModel,
    claim: Claim,
    settings: Settings,
    log: Any,
    *,
    message_id: str,
    delivery_count: int,
    headers: Mapping[str, Any],
) -> Verdict:
    """Call the handler under the claim, then mark it finished; release it if the call failed.

    The call is cut at ``WORKER_CLAIM_CALL_TIMEOUT`` or shortly before the claim's
    lease ends, whichever comes first. A cut call keeps its lease (its outcome is
    unknown) and the delivery is nacked until the lease is over. A failure that
    dead-letters the message (``Poison``, or any failure but ``Retry`` on the
    last allowed delivery, as the pump decides) abandons the claim instead.
    """
    who = {"message_id": message_id, "consumer": handler.consumer}
    budget = min(settings.claim_call_timeout, claim.deadline - time.monotonic())
    if budget <= 0:
        # The claim itself (a lock wait, a slow commit) ate the lease: calling now could
        # overlap a takeover. Nothing was called, so the lease may go at once.
        spent = TimeoutError("the lease ran out while the claim was being committed")
        await _release(sessions, claim, spent, log, abandon=False, prefix="not called", who=who)
        delay = backoff(claim.attempts, settings.retry_backoff, settings.retry_backoff_max)
        return Verdict(
            Verb.NACK, Outcome.LEASE_SPENT, f"{handler.consumer}: {spent}", delay, counted=False
        )
    session = sessions()
    context = ClaimContext(
        session, message_id, handler.consumer, delivery_count, claim.attempts, headers
    )
    context.claim = claim
    context.settings = settings
    context.call_deadline = time.monotonic() + budget
    func = cast(ClaimFunc[Any], handler.func)
    last = last_delivery(delivery_count, settings.max_deliveries)  # the sweeper passes 0
    cut = asyncio.timeout(budget)
    try:
        try:
            running = HANDLER_RUNNING.set(True)  # the claim commits, never the handler
            try:
                async with cut:
                    result = await func(context, message)
            finally:
                HANDLER_RUNNING.reset(running)
        except TimeoutError as exc:
            # ours, or the handler's own (its HTTP client gave up): the outcome is unknown
            if not cut.expired():
                text = f"{exc}" or "the call timed out"
            elif budget < settings.claim_call_timeout:
                text = f"call cut after {budget:.2f}s, before the claim's lease ends"
            else:
                text = f"call took longer than WORKER_CLAIM_CALL_TIMEOUT={budget}s"
            return await _timed_out(sessions, claim, TimeoutError(text), settings, log, last, who)
        except Exception as exc:
            # CancelledError (shutdown, a crash) skips this: the lease runs out instead.
            # A value the database refuses (the handler's own statement) is poison too.
            poison = isinstance(exc, Poison) or classify(exc) is Failure.DATA
            abandon = poison or (last and not isinstance(exc, Retry))
            await _release(sessions, claim, exc, log, abandon=abandon, who=who)
            if isinstance(exc, Poison):
                return Verdict(
                    Verb.DEAD_LETTER, Outcome.POISON, scrub(f"{handler.consumer}: {exc}")
                )
            if isinstance(exc, Retry):
                return Verdict(Verb.NACK, Outcome.RETRY_REQUESTED, scrub(str(exc)), exc.delay)
            raise
        try:
            finished = await _finish(session, claim, result or "ok")
        except Exception as exc:
            # The call is over; its record failed. Outages (connection, schema, lock) leave
            # the claim to its lease; anything else is definite and may release it.
            failure = classify(exc)
            if failure in _NOT_NOW:
                raise
            await discard(session)  # first: on PostgreSQL it still locks the claim's row
            if failure is Failure.CONFLICT or failure is Failure.TRANSIENT:
                return await _lost_to_contention(sessions, claim, exc, failure, settings, log, who)
            # a value the database refuses is poison (the pump dead-letters it at once)
            abandon = last or failure is Failure.DATA
            await _release(
                sessions, claim, exc, log, abandon=abandon, prefix="not recorded", who=who
            )
            raise
    finally:
        await discard(session)
    if not finished:
        # Our lease ran out mid-call and another replica finished first, with the same key:
        # its writes recorded the call, ours were rolled back.
        reason = "claim finished by another replica; this replica's writes were rolled back"
        log.warning(
            "claim lost",
            message_id=message_id,
            consumer=handler.consumer,
            attempt=claim.attempts,
            outcome="duplicate",
            reason=reason,
        )
        return Verdict(Verb.ACK, Outcome.DUPLICATE, reason)
    return Verdict(Verb.ACK, Outcome.COMMITTED)


async def _lost_to_contention(
    sessions: async_sessionmaker[Any],
    claim: Claim,
    error: Exception,
    failure: Failure,
    settings: Settings,
    log: Any,
    who: Mapping[str, str],
) -> Verdict:
    """The call succeeded but its writes lost to another writer (a version conflict, a
    deadlock, a busy SQLite file), so nothing was recorded: try again, uncounted.

    The call is over, so the lease may go at once; the redelivery takes over and calls
    again with the same key, which the provider answers from its record of the first
    call. Uncounted (a delivery count is spent only by the message's own failure)
    while the claim's attempts stay below WORKER_MAX_DELIVERIES, counted after that,
    so a row that is always hot still ends.
    """
    await _release(sessions, claim, error, log, abandon=False, prefix="not recorded", who=who)
    delay = backoff(claim.attempts, settings.retry_backoff, settings.retry_backoff_max)
    reason = scrub(f"{who['consumer']}: the call's writes met a {failure.value}: {error}")
    counted = claim.attempts >= settings.max_deliveries
    return Verdict(Verb.NACK, Outcome.FINISH_CONTENDED, reason, delay, counted=counted)


async def _timed_out(
    sessions: async_sessionmaker[Any],
    claim: Claim,
    error: TimeoutError,
    settings: Settings,
    log: Any,
    last: bool,
    who: Mapping[str, str],
) -> Verdict:
    """A cut call: the provider may still be working on it, so the lease stays.

    Releasing it would let the redelivery take over and call again with the same
    key while the first call still runs. The delivery comes back after the rest
    of the lease, counted (the call failed to answer in time); on the last allowed
    delivery it is dead-lettered and the claim abandoned, lease kept, so even a
    re-submitted dead letter waits for the lease to end.
    """
    if last:
        await _release(
            sessions, claim, error, log, prefix="unknown", abandon=True, keep_lease=True, who=who
        )
        raise error
    remaining = await _keep(sessions, claim, error, log)
    delay = min(settings.claim_lease, remaining + 0.05)
    reason = scrub(f"{error}; outcome unknown, lease kept ({remaining:.1f}s left)")
    return Verdict(Verb.NACK, Outcome.CALL_TIMEOUT, reason, delay)


async def _keep(
    sessions: async_sessionmaker[Any], claim: Claim, error: BaseException, log: Any
) -> float:
    """Record a cut call on the claim, lease untouched; the seconds its lease still runs."""
    session: AsyncSession = sessions()
    try:
        row = (
            await session.execute(
                update(_inbox)
                .where(
                    _inbox.c.id == claim.id,
                    _inbox.c.state == CLAIMED,
                    _inbox.c.claimed_by == claim.owner,
                )
                .values(outcome=_outcome(f"unknown: {type(error).__name__}: {error}"))
                .returning(_inbox.c.lease_until, _now(session).label("now"))
            )
        ).first()
        await AsyncSession.commit(session)
    except Exception as exc:  # the lease runs out by itself; a redelivery before then waits
        log.warning("claim update failed", claim_id=claim.id, error=exc)
        row = None
    finally:
        await discard(session)
    if row is None:  # taken over meanwhile, or no answer: our own bound is the best we know
        return max(0.0, claim.deadline - time.monotonic())
    return max(0.0, (_aware(row.lease_until) - _aware(row.now)).total_seconds())


async def _finish(session: AsyncSession, claim: Claim, outcome: str) -> bool:
    """Mark the claim finished and commit the handler's writes with it; False if lost.

    Not conditional on the owner: the call succeeded with the message's key, so
    the effect happened, whoever holds the lease now (an abandoned claim too).
    But only the first finish commits: the mark runs before the handler's
    pending writes are flushed, and when it matches no row (another replica
    finished first) the session is rolled back, so the writes recording this
    one call are not applied twice.
    """
    statement = (
        update(_inbox)
        .where(_inbox.c.id == claim.id, _inbox.c.state.in_((CLAIMED, ABANDONED)))
        .values(
            state=FINISHED,
            processed_at=_now(session),
            outcome=_outcome(outcome),
            lease_until=None,
            body=None,
        )
    )
    with session.no_autoflush:
        marked = (await session.execute(statement)).rowcount  # type: ignore[attr-defined]
    if not marked:
        await AsyncSession.rollback(session)
        return False
    await AsyncSession.commit(session)
    return True


async def _release(
    sessions: async_sessionmaker[Any],
    claim: Claim,
    error: BaseException,
    log: Any,
    *,
    who: Mapping[str, str] | None = None,
    abandon: bool = False,
    prefix: str = "failed",
    keep_lease: bool = False,
) -> None:
    """End our lease now, so the redelivery may take over at once; record the error.

    With ``abandon`` the message is being dead-lettered: the claim becomes
    abandoned, so the sweeper leaves it alone. Conditional on the owner: if our
    lease already ran out and another replica took over, releasing would hand
    its live claim to a third. ``keep_lease`` (a cut call on the last delivery)
    abandons the claim but leaves its lease to run out: the call may still be running.
    """
    session: AsyncSession = sessions()
    values: dict[str, Any] = {"outcome": _outcome(f"{prefix}: {type(error).__name__}: {error}")}
    if abandon:
        values.update(state=ABANDONED, processed_at=_now(session))
        if not keep_lease:
            values.update(lease_until=None)
    else:
        values.update(lease_until=_now(session))
    try:
        result = await session.execute(
            update(_inbox)
            .where(
                _inbox.c.id == claim.id,
                _inbox.c.state == CLAIMED,
                _inbox.c.claimed_by == claim.owner,
            )
            .values(values)
        )
        await AsyncSession.commit(session)
    except Exception as exc:  # the lease still runs out by itself
        log.warning("claim release failed", claim_id=claim.id, error=exc)
        return
    finally:
        await discard(session)
    if abandon and result.rowcount:  # type: ignore[attr-defined]
        log.warning(
            "claim abandoned",
            message_id=(who or {}).get("message_id"),
            consumer=(who or {}).get("consumer"),
            attempt=claim.attempts,
            outcome=ABANDONED,
            reason=values["outcome"],
        )


def _aware(value: datetime) -> datetime:
    """SQLite hands datetimes back naive; they were written in UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
