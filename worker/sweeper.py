"""The sweeper: side-effect claims left past their lease, finished without a redelivery.

A claim (:mod:`worker.claims`) stores its message's body, so a claim whose owner
died can be finished from the database alone: :func:`redrive` takes each stale
claim over and runs its handler under the claim protocol, as a redelivery would.
It re-drives a claim only while its ``attempts`` are below
``WORKER_MAX_DELIVERIES``; after that it abandons the claim instead.

This is operator tooling, apart from the protocol every delivery runs through:
``worker sweep`` lists or re-drives stale claims and lists abandoned ones, and
the pump's housekeeping (:mod:`worker.retention`) reports stale claims every
``WORKER_PURGE_INTERVAL`` seconds and, with ``WORKER_SWEEP_REDRIVE``, re-drives them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from pydantic import ValidationError
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from worker.claim_runner import run
from worker.db import discard
from worker.inbox import ABANDONED, CLAIMED, TABLE
from worker.leases import aware, take_over
from worker.leases import now as database_now
from worker.logs import scrub
from worker.registry import Runs

if TYPE_CHECKING:
    from worker.registry import Registry
    from worker.settings import Settings


@dataclass(frozen=True, slots=True)
class StaleClaim:
    """A claim whose lease ran out without a "finished" mark."""

    id: int
    message_id: str
    consumer: str
    message_type: str | None
    claimed_by: str | None
    attempts: int
    lease_until: datetime
    outcome: str | None
    overdue: float  # seconds since the lease ran out

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "message_id": self.message_id,
            "consumer": self.consumer,
            "type": self.message_type,
            "claimed_by": self.claimed_by,
            "attempts": self.attempts,
            "lease_until": self.lease_until.isoformat(),
            "overdue_s": round(self.overdue, 1),
            "last_outcome": _printable(self.outcome),
        }


async def stale_claims(sessions: async_sessionmaker[Any], limit: int = 100) -> list[StaleClaim]:
    """Unfinished claims past their lease, longest overdue first (index ix_inbox_lease_until)."""
    session: AsyncSession = sessions()
    try:
        now = database_now(session)
        statement = (
            select(
                TABLE.c.id,
                TABLE.c.message_id,
                TABLE.c.consumer,
                TABLE.c.message_type,
                TABLE.c.claimed_by,
                TABLE.c.attempts,
                TABLE.c.lease_until,
                TABLE.c.outcome,
                now.label("now"),
            )
            .where(TABLE.c.state == CLAIMED, TABLE.c.lease_until < now)
            .order_by(TABLE.c.lease_until)
            .limit(limit)
        )
        rows = (await session.execute(statement)).all()
    finally:
        await discard(session)
    return [
        StaleClaim(
            row.id,
            row.message_id,
            row.consumer,
            row.message_type,
            row.claimed_by,
            row.attempts,
            aware(row.lease_until),
            row.outcome,
            (aware(row.now) - aware(row.lease_until)).total_seconds(),
        )
        for row in rows
    ]


async def redrive(
    sessions: async_sessionmaker[Any],
    handlers: Registry,
    settings: Settings,
    log: Any,
    *,
    limit: int = 100,
) -> Counter[str]:
    """Finish stale claims without a redelivery, from the body each claim stored.

    A claim whose ``attempts`` reached ``WORKER_MAX_DELIVERIES`` is not called
    again: it is abandoned and counted as ``exhausted`` (its message has been, or
    is about to be, dead-lettered; re-submitting the dead letter runs it again).
    Abandoning also takes it out of :func:`stale_claims`, so a pile of hopeless
    claims never hides the others behind ``limit``.
    """
    results: Counter[str] = Counter()
    by_consumer = {h.consumer: h for h in handlers if h.runs is Runs.CLAIM}
    for stale in await stale_claims(sessions, limit):
        if stale.attempts >= settings.max_deliveries:
            gave_up = await _abandon_exhausted(sessions, stale.id, settings.max_deliveries)
            results["exhausted" if gave_up else "lost-race"] += 1
            if gave_up:
                log.warning(
                    "claim abandoned",
                    message_id=stale.message_id,
                    consumer=stale.consumer,
                    attempt=stale.attempts,
                    outcome=ABANDONED,
                    reason=f"{stale.attempts} attempts (WORKER_MAX_DELIVERIES="
                    f"{settings.max_deliveries}); last: {stale.outcome}",
                )
            continue
        handler = by_consumer.get(stale.consumer)
        body = await _body(sessions, stale.id)
        if handler is None or body is None:
            results["no-handler" if handler is None else "no-body"] += 1
            continue
        try:
            message = handler.model.model_validate_json(body)
        except ValidationError:
            results["invalid-body"] += 1
            continue
        claim = await take_over(sessions, stale.id, settings.claim_lease)
        if claim is None:
            results["lost-race"] += 1  # a redelivery or another sweeper took it first
            continue
        try:
            outcome = await run(
                sessions,
                handler,
                message,
                claim,
                settings,
                log,
                message_id=stale.message_id,
                delivery_count=0,
                headers={},
            )
        except Exception as exc:
            log.warning(
                "re-drive failed",
                message_id=stale.message_id,
                consumer=stale.consumer,
                attempt=claim.attempts,
                outcome="failed",
                error=exc,
            )
            results["failed"] += 1
            continue
        log.info(
            "re-driven",
            message_id=stale.message_id,
            consumer=stale.consumer,
            attempt=claim.attempts,
            outcome=outcome.outcome,
        )
        results[outcome.outcome] += 1
    return results


async def _abandon_exhausted(
    sessions: async_sessionmaker[Any], claim_id: int, max_attempts: int
) -> bool:
    """Abandon a stale claim out of attempts; False if it moved on (taken over, finished)."""
    session: AsyncSession = sessions()
    try:
        result = await session.execute(
            update(TABLE)
            .where(
                TABLE.c.id == claim_id,
                TABLE.c.state == CLAIMED,
                TABLE.c.lease_until < database_now(session),
                TABLE.c.attempts >= max_attempts,
            )
            .values(state=ABANDONED, lease_until=None, processed_at=database_now(session))
        )
        await AsyncSession.commit(session)
    finally:
        await discard(session)
    return bool(result.rowcount)  # type: ignore[attr-defined]


async def abandoned_claims(
    sessions: async_sessionmaker[Any], limit: int = 100
) -> list[dict[str, Any]]:
    """Abandoned claims, newest first: side effects an operator may still owe someone."""
    session: AsyncSession = sessions()
    try:
        rows = (
            await session.execute(
                select(
                    TABLE.c.id,
                    TABLE.c.message_id,
                    TABLE.c.consumer,
                    TABLE.c.message_type,
                    TABLE.c.attempts,
                    TABLE.c.processed_at,
                    TABLE.c.outcome,
                )
                .where(TABLE.c.state == ABANDONED)
                .order_by(TABLE.c.processed_at.desc())
                .limit(limit)
            )
        ).all()
    finally:
        await discard(session)
    return [
        {
            "id": row.id,
            "message_id": row.message_id,
            "consumer": row.consumer,
            "type": row.message_type,
            "state": ABANDONED,
            "attempts": row.attempts,
            "abandoned_at": aware(row.processed_at).isoformat() if row.processed_at else None,
            "last_outcome": _printable(row.outcome),
        }
        for row in rows
    ]


async def _body(sessions: async_sessionmaker[Any], claim_id: int) -> bytes | None:
    session: AsyncSession = sessions()
    try:
        body = await session.scalar(select(TABLE.c.body).where(TABLE.c.id == claim_id))
    finally:
        await discard(session)
    return cast(bytes | None, body)


def _printable(outcome: str | None) -> str | None:
    """Outcomes are scrubbed when written; rows written before that was so are scrubbed here."""
    return None if outcome is None else scrub(outcome)
