"""The claim runner: a side-effect handler on one delivery, in phases around its call.

::

    claim (a leased marker, committed) -> the handler's call -> mark finished (committed)

See :mod:`worker.claims` for what each state of the marker means to a redelivery.
Errors the claim protocol does not decide itself (an outage, a broken statement) end
as they would for an ordinary handler, through :class:`~worker.judge.Judge`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import async_sessionmaker

from worker.claims import ClaimContext, ClaimFunc
from worker.context import HANDLER_RUNNING, guard
from worker.db import Failure, classify, discard
from worker.errors import Poison, Retry
from worker.judge import requested
from worker.leases import Claim, Held, acquire, finish, keep, release
from worker.logs import scrub
from worker.retry import backoff
from worker.verdict import Outcome, Verb, Verdict, last_delivery

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from worker.delivery import Delivery
    from worker.judge import Judge
    from worker.registry import Handler
    from worker.settings import Settings
    from worker.transaction import Stage

# Database trouble that is nobody's verdict on the claim: the pump pauses or gives back.
_NOT_NOW = frozenset({Failure.CONNECTION, Failure.SCHEMA, Failure.LOCKED})


class ClaimRunner:
    """A side-effect handler on one delivery: claim with a lease, call, mark finished."""

    def __init__(
        self, engine: AsyncEngine, sessions: async_sessionmaker[Any], judge: Judge
    ) -> None:
        guard(engine)
        self.judge = judge
        self._sessions = sessions

    async def run(self, stage: Stage) -> list[Verdict]:
        handler = stage.handler
        return [await self.one(i.delivery, handler, i.message(handler)) for i in stage.items]

    async def one(self, delivery: Delivery, handler: Handler[Any], message: BaseModel) -> Verdict:
        judge = self.judge
        delivery.keep_alive(judge.settings.claim_lease)
        try:
            verdict = await process(
                self._sessions, handler, message, delivery, judge.settings, judge.log
            )
        except Exception as exc:
            return await judge.stopped(delivery, handler, exc)
        judge.note(delivery, handler.consumer, 1, verdict.outcome, reason=verdict.reason)
        return replace(verdict, attempt=1, consumer=handler.consumer)


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
        await release(sessions, claim, spent, log, abandon=False, prefix="not called", who=who)
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
            await release(sessions, claim, exc, log, abandon=abandon, who=who)
            asked = requested(handler.consumer, exc, claim.attempts)
            if asked is not None:
                return replace(asked, reason=scrub(asked.reason or ""))
            raise
        try:
            finished = await finish(session, claim, result or "ok")
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
            await release(
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
    await release(sessions, claim, error, log, abandon=False, prefix="not recorded", who=who)
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
        await release(
            sessions, claim, error, log, prefix="unknown", abandon=True, keep_lease=True, who=who
        )
        raise error
    remaining = await keep(sessions, claim, error, log)
    delay = min(settings.claim_lease, remaining + 0.05)
    reason = scrub(f"{error}; outcome unknown, lease kept ({remaining:.1f}s left)")
    return Verdict(Verb.NACK, Outcome.CALL_TIMEOUT, reason, delay)
