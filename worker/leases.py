"""Leased claims in the inbox: the SQL behind a side effect's two phases.

A claim is an inbox marker in state ``claimed`` with a lease; :func:`acquire` inserts
it or takes an expired one over (a conditional UPDATE: one replica wins), and
:func:`finish`, :func:`release` and :func:`keep` end or record it. Lease times come
from the database's clock on PostgreSQL. :mod:`worker.claim_runner` runs a handler
under a claim; :mod:`worker.sweeper` finishes claims left past their lease.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    DateTime,
    Interval,
    String,
    and_,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from worker.db import discard, insert_ignoring_conflicts
from worker.inbox import ABANDONED, CLAIMED, FINISHED, TABLE, InboxMarker
from worker.logs import scrub
from worker.partitions import ADMIT

_inbox = TABLE
_OWNER_PREFIX = f"{socket.gethostname()}:{os.getpid()}"[:110]
_OUTCOME_LENGTH = 255  # inbox.outcome


def _outcome(text: str) -> str:
    """An outcome as the inbox stores it: scrubbed first, then cut (a cut URL hides from scrub)."""
    return scrub(text)[:_OUTCOME_LENGTH]


def _margin(lease: float) -> float:
    """How long before its lease ends a call is cut: room for the loop's lag and the cut itself."""
    return min(1.0, lease * 0.1)


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


def now(session: AsyncSession) -> ColumnElement[datetime]:
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
    lease_until = aware(row.lease_until)
    lease = (lease_until - aware(row.now)).total_seconds()
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
        fresh = _claim_insert(
            session,
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
        returning = fresh.returning(_inbox.c.id, _inbox.c.lease_until, now(session).label("now"))
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
                select(_inbox.c.state, _inbox.c.lease_until, now(session).label("now")).where(*mine)
            )
        ).first()
        if state is None:
            return Held(0.0)  # purged in between: look again
        if state.state == FINISHED:
            return None
        if state.lease_until is None:
            return Held(0.0)  # abandoned (or released) in between: look again
        # a live lease; an abandoned claim keeps one after a call that timed out
        return Held(max(0.0, (aware(state.lease_until) - aware(state.now)).total_seconds()))
    finally:
        await discard(session)


def _claim_insert(session: AsyncSession, **values: Any) -> Any:
    """The claim's ``INSERT ... ON CONFLICT DO NOTHING``: a marker already there is no error.

    On PostgreSQL the row is admitted by ``worker_inbox_admit`` first (a no-op on the plain
    table; on the partitioned inbox the key's lock and a look into every partition, which
    its unique keys, one per partition, cannot do: worker/partitions.py).
    """
    if session.get_bind().dialect.name != "postgresql":
        return insert_ignoring_conflicts(session, InboxMarker).values(**values)
    columns = [
        value if isinstance(value, ColumnElement) else literal(value, _inbox.c[name].type)
        for name, value in values.items()
    ]
    admit = getattr(func, ADMIT)
    admitted = select(*columns).where(
        admit(literal(values["message_id"], String()), literal(values["consumer"], String()))
    )
    return postgresql.insert(_inbox).from_select(list(values), admitted).on_conflict_do_nothing()


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
    current = now(session)
    expired = and_(_inbox.c.state == CLAIMED, _inbox.c.lease_until < current)
    given_up = and_(
        _inbox.c.state == ABANDONED,
        or_(_inbox.c.lease_until.is_(None), _inbox.c.lease_until < current),
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
        .returning(_inbox.c.id, _inbox.c.attempts, _inbox.c.lease_until, current.label("now"))
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


async def keep(
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
                .returning(_inbox.c.lease_until, now(session).label("now"))
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
    return max(0.0, (aware(row.lease_until) - aware(row.now)).total_seconds())


async def finish(session: AsyncSession, claim: Claim, outcome: str) -> bool:
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
            processed_at=now(session),
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


async def release(
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
        values.update(state=ABANDONED, processed_at=now(session))
        if not keep_lease:
            values.update(lease_until=None)
    else:
        values.update(lease_until=now(session))
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


def aware(value: datetime) -> datetime:
    """SQLite hands datetimes back naive; they were written in UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
