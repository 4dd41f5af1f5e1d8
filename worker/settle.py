"""Settlement: the only code that acks, nacks or dead-letters a delivery.

Each delivery of a unit of work ends with one verdict (:mod:`worker.verdict`); this
module turns it into exactly one broker verb, and owns what goes with it:

- the acks of a unit of work go out together (``Settler.ack_many``: one frame where
  the broker allows it);
- an uncounted give-back refunds the durable count if this delivery's start moved it
  (:mod:`worker.attempts`), and before the give-back: while the database cannot take
  the refund, the delivery is held (the pump has paused, so nothing else runs) and the
  refund is tried again once it answers, so an outage costs no message a count;
- an uncounted give-back is bounded: its delay grows with the message's
  ``give_backs``, and past ``WORKER_MAX_GIVE_BACKS`` it counts, so a message that
  always takes it still ends. That holds for a pause too (an outage gives back only
  what was in flight, once, and nothing is taken while it lasts, so a message meets it
  again only when it trips the same fault right after each recovery); only the
  shutdown's give-back and a record held back behind an earlier one are bounded
  elsewhere (``Verdict.bounded_elsewhere``);
- a settlement the broker no longer accepts is "settlement lost": logged, counted,
  never a success (the broker redelivers); a second settlement of one delivery is a
  bug, logged loudly, never mistaken for a lost one; an adapter that raises anything
  else is logged and counted, and never ends the worker's loop.

Not shielded from cancellation: the only cancel is the shutdown's after its grace
period, and a settlement cut short is a redelivery the inbox absorbs.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import TYPE_CHECKING, Any

from worker import attempts
from worker.delivery import ack_many
from worker.errors import AcksFailed, AlreadySettled, SettlementLost
from worker.verdict import GIVE_BACK_DELAY, Outcome, Verb, Verdict

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from worker.delivery import Delivery
    from worker.health import DatabaseHealth
    from worker.intake import Work
    from worker.settings import Settings

_MAX_GIVE_BACK_DELAY = 30.0
_REFUND_TRIES = 3
_STOPPING_REFUND = 5.0  # seconds the shutdown gives one refund
"""Refunds tried while the database answers pings but refuses the refund, 1 s apart."""


def give_back_delay(give_backs: int, floor: float | None) -> float:
    """An uncounted give-back's delay: doubling with the give-backs so far, up to 30 s."""
    grown = min(GIVE_BACK_DELAY * 2.0 ** min(give_backs, 16), _MAX_GIVE_BACK_DELAY)
    return max(grown, floor or 0.0)


class Settlement:
    """Settles the deliveries of units of work for one pump."""

    def __init__(
        self,
        engine: AsyncEngine,
        settings: Settings,
        log: Any,
        stats: Counter[str],
        health: DatabaseHealth,
    ) -> None:
        self._engine = engine
        self.settings = settings
        self.log = log
        self.stats = stats
        self._health = health
        self.stopping = False
        """Set at shutdown: a refund no longer waits for the database."""

    async def work(self, work: Work, verdicts: list[Verdict]) -> None:
        """Every delivery of ``work`` ends settled, or logged loudly."""
        items = work.items
        consumer = work.handlers[-1].consumer if work.handlers else ""  # whose an ack is
        if len(items) == 1:
            await self.one(items[0].delivery, verdicts[0], work.counted, consumer)
            return
        acks: list[tuple[Delivery, Verdict]] = []
        for item, verdict in zip(items, verdicts, strict=True):
            if verdict.verb is Verb.ACK:
                acks.append((item.delivery, verdict))
            else:
                await self.one(item.delivery, verdict, work.counted, consumer)
        if len(acks) == 1:
            await self.one(*acks[0], None, consumer)
        elif acks:
            await self._ack_many([delivery for delivery, _ in acks], consumer)

    async def one(
        self,
        delivery: Delivery,
        verdict: Verdict,
        counted: str | None = None,
        consumer: str = "",
    ) -> None:
        """Settle one delivery on ``verdict``; never raises. ``counted``: the consumer whose
        durable count this delivery's start moved, if it did; ``consumer``: whose verdict
        it is, where the verdict does not say (a commit, a duplicate)."""
        consumer = verdict.consumer or consumer
        try:
            await self._settle(delivery, verdict, counted, consumer)
        except AlreadySettled as exc:  # a bug in the worker or an adapter: never a success
            self._settled_twice(delivery, exc)
        except Exception as exc:
            self.stats["settlement-failed"] += 1
            self.log.error(
                "settlement failed, broker will redeliver",
                message_id=delivery.message_id,
                consumer=consumer,
                attempt=verdict.attempt,
                verb=verdict.verb,
                outcome="settlement-failed",
                error=exc,
                settled=delivery.settled,
            )

    async def _settle(
        self, delivery: Delivery, verdict: Verdict, counted: str | None, consumer: str
    ) -> None:
        verb = verdict.verb
        try:
            if verb is Verb.ACK:
                await delivery.ack()
            elif verb is Verb.NACK:
                await self._give_back(delivery, verdict, counted, consumer)
            else:
                assert verdict.reason is not None
                await delivery.dead_letter(verdict.reason)
        except SettlementLost as exc:
            self._lost(delivery, consumer, verdict.attempt, verb, exc)
            return
        self.stats[verb] += 1
        if verb is Verb.DEAD_LETTER:
            self.stats[f"dead-letter-{verdict.outcome}"] += 1
            self.log.warning(
                "dead-lettered",
                message_id=delivery.message_id,
                consumer=consumer,
                attempt=verdict.attempt,
                type=delivery.type,
                delivery_count=delivery.delivery_count,
                reason=verdict.reason,
                outcome=verdict.outcome,
            )

    async def _give_back(
        self, delivery: Delivery, verdict: Verdict, counted: str | None, consumer: str
    ) -> None:
        spends, delay = verdict.counted, verdict.delay
        if not spends and not verdict.bounded_elsewhere:
            if delivery.give_backs >= self.settings.max_give_backs:
                spends = True  # always this path: from here on it spends its count
                self.stats["give-backs-bounded"] += 1
                self.log.warning(
                    "give-back bound reached, counted from now on",
                    message_id=delivery.message_id,
                    consumer=consumer,
                    give_backs=delivery.give_backs,
                    outcome=verdict.outcome,
                    reason=verdict.reason,
                )
            elif verdict.outcome is not Outcome.PAUSED:  # a pause sets its own pace
                delay = give_back_delay(delivery.give_backs, delay)
        if not spends and counted is not None:  # take back the start it spent
            await self._refund(delivery, counted)
        await delivery.nack(delay, counted=spends)

    async def _refund(self, delivery: Delivery, consumer: str) -> None:
        """Refund the start, waiting for a database that is away (the pump is paused,
        and holding the delivery is what a paused worker does), unless stopping."""
        tries = 0
        while not await self._refunded(delivery, consumer):
            health = self._health
            if self.stopping:
                break
            if health.gate.is_set():
                tries += 1
                if tries >= _REFUND_TRIES:
                    break
                await asyncio.sleep(1.0)
                continue
            await health.wait_available()
        else:
            return
        self.stats["refund-lost"] += 1
        self.log.warning(
            "delivery count not refunded",
            message_id=delivery.message_id,
            consumer=consumer,
            delivery_count=delivery.delivery_count,
            outcome="refund-lost",
        )

    async def _refunded(self, delivery: Delivery, consumer: str) -> bool:
        # the shutdown waits for no database: a black-holed one would hold it for ever
        try:
            async with asyncio.timeout(_STOPPING_REFUND if self.stopping else None):
                return await attempts.refund(self._engine, delivery, consumer)
        except TimeoutError:
            return False

    async def _ack_many(self, deliveries: list[Delivery], consumer: str) -> None:
        failed: list[tuple[Delivery, Exception]] = []
        try:
            lost = set(await ack_many(deliveries))
        except AcksFailed as exc:  # the others went out
            lost, failed = set(), exc.failures
        except Exception as exc:  # nothing went out
            lost, failed = set(), [(delivery, exc) for delivery in deliveries]
        for delivery, error in failed:
            if isinstance(error, AlreadySettled):
                self._settled_twice(delivery, error)
                continue
            self.stats["settlement-failed"] += 1
            self.log.error(
                "settlement failed, broker will redeliver",
                message_id=delivery.message_id,
                consumer=consumer,
                attempt=0,
                verb=Verb.ACK,
                outcome="settlement-failed",
                error=error,
            )
        self.stats["ack"] += len(deliveries) - len(lost) - len(failed)
        for delivery in deliveries:
            if delivery in lost:
                self._lost(delivery, consumer, 0, Verb.ACK, None)

    def _lost(
        self,
        delivery: Delivery,
        consumer: str | None,
        attempt: int,
        verb: Verb,
        exc: BaseException | None,
    ) -> None:
        self.stats["settlement-lost"] += 1
        self.log.warning(
            "settlement lost, broker will redeliver",
            message_id=delivery.message_id,
            consumer=consumer,
            attempt=attempt,
            verb=verb,
            error=exc,
            outcome="settlement-lost",
        )

    def _settled_twice(self, delivery: Delivery, exc: AlreadySettled) -> None:
        self.stats["settled-twice"] += 1
        self.log.error(
            "bug: delivery settled twice",
            message_id=delivery.message_id,
            attempt=0,
            outcome="settled-twice",
            error=exc,
            exc_info=exc,
        )
