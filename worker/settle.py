"""Settlement: the only code that acks, nacks or dead-letters a delivery.

Each item of a unit of work ends with one verdict (:mod:`worker.verdict`); this
module turns it into exactly one broker verb, and owns what goes with it:

- the acks of a unit of work go out together (``Settler.ack_many``: one frame where
  the broker allows it), twins of an acked item with them, as duplicates;
- an uncounted give-back refunds the durable count only if this delivery's start
  moved it (:mod:`worker.attempts`);
- an uncounted give-back that is the message's own path (not the environment's) is
  bounded: its delay grows with the message's ``give_backs``, and past
  ``WORKER_MAX_GIVE_BACKS`` it counts, so a message that always takes it still ends;
- a settlement the broker no longer accepts is "settlement lost": logged, counted,
  never a success (the broker redelivers); a second settlement of one delivery is a
  bug, logged loudly, never mistaken for a lost one; an adapter that raises anything
  else is logged and counted, and never ends the worker's loop.

Not shielded from cancellation: the only cancel is the shutdown's after its grace
period, and a settlement cut short is a redelivery the inbox absorbs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from worker import attempts
from worker.delivery import ack_many
from worker.errors import AlreadySettled, SettlementLost
from worker.verdict import GIVE_BACK_DELAY, Outcome, Verb, Verdict

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from worker.delivery import Delivery
    from worker.settings import Settings
    from worker.work import Item, Work

_MAX_GIVE_BACK_DELAY = 30.0


def give_back_delay(give_backs: int, floor: float | None) -> float:
    """An uncounted give-back's delay: doubling with the give-backs so far, up to 30 s."""
    grown = min(GIVE_BACK_DELAY * 2.0 ** min(give_backs, 16), _MAX_GIVE_BACK_DELAY)
    return max(grown, floor or 0.0)


class Settlement:
    """Settles the items of units of work for one pump."""

    def __init__(
        self,
        engine: AsyncEngine,
        settings: Settings,
        log: Any,
        stats: Counter[str],
    ) -> None:
        self._engine = engine
        self.settings = settings
        self.log = log
        self.stats = stats

    async def work(self, work: Work) -> None:
        """Every item of ``work`` (and its twins) ends settled or logged loudly."""
        acks: list[Item] = []
        for item in work.items:
            if item.deferred:
                continue  # runs again on its own (worker.intake)
            verdict = item.verdict
            assert verdict is not None  # the dispatch gives every item one
            if verdict.verb is Verb.ACK:
                acks.append(item)
                for twin in item.twins:  # the same id twice in one batch: the copy is done
                    twin.verdict = replace(verdict, outcome=Outcome.DUPLICATE)
                    twin.consumer = item.consumer
                    self.stats["duplicates-in-batch"] += 1
                    self.stats["duplicate"] += 1
                    self.log.info(
                        "duplicate",
                        message_id=twin.delivery.message_id,
                        consumer=item.consumer,
                        attempt=0,
                        outcome="duplicate",
                        twin=True,
                    )
                    acks.append(twin)
            else:
                await self.one(item, verdict)
        if len(acks) == 1:
            [item] = acks
            assert item.verdict is not None
            await self.one(item, item.verdict)
        elif acks:
            await self._ack_many(acks)

    async def one(self, item: Item, verdict: Verdict) -> None:
        """Settle one item on ``verdict``; never raises."""
        delivery = item.delivery
        try:
            await self._settle(item, verdict)
        except AlreadySettled as exc:  # a bug in the worker or an adapter: never a success
            self._settled_twice(delivery, exc)
        except Exception as exc:
            self.stats["settlement-failed"] += 1
            self.log.error(
                "settlement failed, broker will redeliver",
                message_id=delivery.message_id,
                consumer=item.consumer,
                attempt=verdict.attempt,
                verb=verdict.verb,
                outcome="settlement-failed",
                error=exc,
            )

    async def _settle(self, item: Item, verdict: Verdict) -> None:
        delivery = item.delivery
        verb = verdict.verb
        try:
            if verb is Verb.ACK:
                await delivery.ack()
            elif verb is Verb.NACK:
                await self._give_back(item, verdict)
            else:
                assert verdict.reason is not None
                await delivery.dead_letter(verdict.reason)
        except SettlementLost as exc:
            self._lost(delivery, item.consumer, verdict.attempt, verb, exc)
            return
        self.stats[verb] += 1
        if verb is Verb.DEAD_LETTER:
            self.stats[f"dead-letter-{verdict.outcome}"] += 1
            self.log.warning(
                "dead-lettered",
                message_id=delivery.message_id,
                consumer=item.consumer,
                attempt=verdict.attempt,
                type=delivery.type,
                delivery_count=delivery.delivery_count,
                reason=verdict.reason,
                outcome=verdict.outcome,
            )

    async def _give_back(self, item: Item, verdict: Verdict) -> None:
        delivery = item.delivery
        counted, delay = verdict.counted, verdict.delay
        if not counted and not verdict.environment:
            if delivery.give_backs >= self.settings.max_give_backs:
                counted = True  # always this path: from here on it spends its count
                self.stats["give-backs-bounded"] += 1
                self.log.warning(
                    "give-back bound reached, counted from now on",
                    message_id=delivery.message_id,
                    consumer=item.consumer,
                    give_backs=delivery.give_backs,
                    outcome=verdict.outcome,
                    reason=verdict.reason,
                )
            else:
                delay = give_back_delay(delivery.give_backs, delay)
        if not counted and item.counted is not None:  # take back the start it spent
            await attempts.refund(self._engine, delivery, item.counted)
            item.counted = None
        await delivery.nack(delay, counted=counted)

    async def _ack_many(self, items: list[Item]) -> None:
        deliveries = [item.delivery for item in items]
        try:
            lost = set(await ack_many(deliveries))
        except AlreadySettled as exc:
            self._settled_twice(deliveries[0], exc)
            return
        except Exception as exc:
            self.stats["settlement-failed"] += len(deliveries)
            self.log.error("settlement failed, broker will redeliver", error=exc, size=len(items))
            return
        self.stats["ack"] += len(deliveries) - len(lost)
        for item in items:
            if item.delivery in lost:
                self._lost(item.delivery, item.consumer, 0, Verb.ACK, None)

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
