"""How a failed attempt ends, with the I/O its verdict needs: shared by every runner.

The :class:`~worker.judge.Judge` decides from what it is told; :class:`Endings` finds
out what it needs to be told and carries out what follows: it tells a row another
writer deleted from one it changed, records a rejection (with the inbox marker) before
the ack, pings a database whose connection broke, and closes the intake gate for a
database that cannot serve anyone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from worker.db import Failure
from worker.errors import Rejected, StatementSwallowed
from worker.judge import Again, Judge, cause_of, failure_of
from worker.rejections import deleted_row, record_rejection
from worker.verdict import COMMITTED, Verdict

if TYPE_CHECKING:
    from worker.delivery import Delivery
    from worker.health import DatabaseHealth
    from worker.registry import Handler


class Endings:
    """The I/O side of the judge, for one pump."""

    def __init__(
        self, sessions: async_sessionmaker[Any], judge: Judge, health: DatabaseHealth
    ) -> None:
        self.judge = judge
        self.health = health
        self._sessions = sessions

    async def ended(
        self,
        delivery: Delivery,
        handler: Handler[Any],
        attempt: int,
        exc: Exception,
        deadline: float,
        session: AsyncSession | None = None,
    ) -> Verdict | Again:
        """How a failed attempt ends: the judge's verdict, after the I/O it needs."""
        judge = self.judge
        consumer = handler.consumer
        verdict = judge.requested(delivery, consumer, attempt, exc)
        if verdict is not None:
            return verdict
        if isinstance(exc, StatementSwallowed):
            judge.swallowed(delivery, consumer, attempt, exc)
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
        return judge.decide(
            delivery, consumer, attempt, exc, failed, deadline=deadline, answers=answers
        )

    async def reject(
        self, delivery: Delivery, handler: Handler[Any], attempt: int, exc: Rejected
    ) -> Verdict:
        """Not applied and never retried: record it with the inbox marker, then ack."""
        judge = self.judge
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
            return (
                ending
                if not isinstance(ending, Again)
                else judge.failed(delivery, consumer, attempt, error)
            )
        if not recorded:
            return judge.duplicate(delivery, consumer, attempt, "constraint")
        judge.note(
            delivery,
            consumer,
            attempt,
            exc.outcome,
            reason=str(exc),
            subject=exc.subject,
            expected=exc.expected,
            actual=exc.actual,
        )
        return replace(COMMITTED, outcome=exc.outcome, reason=str(exc))
