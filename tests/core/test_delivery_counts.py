"""Delivery counts kept in the database (WORKER_DELIVERY_COUNTS=database) are spent only
by the message's own failures: an uncounted give-back refunds the count it took."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm.exc import StaleDataError

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.pumps import MakeSettings, RunPumps
from worker.attempts import DeliveryCount
from worker.brokers.memory import MemoryBroker
from worker.registry import Context, Registry


async def stored_counts(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as connection:
        rows = await connection.execute(select(DeliveryCount.message_id, DeliveryCount.deliveries))
        return {row[0]: row[1] for row in rows}


async def test_uncounted_give_backs_refund_the_stored_count(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """Four conflicts lost to other writers (retry budget spent: uncounted give-backs), then
    success: without the refund every give-back raised the stored count, and the message
    was dead-lettered as exhausted after WORKER_MAX_DELIVERIES=3 without its fault."""
    lost: list[int] = []
    registry = Registry()
    broker = MemoryBroker()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        if len(broker.history) < 4:  # four deliveries lose, however many attempts each
            lost.append(ctx.delivery_count)
            raise StaleDataError("another writer committed first")
        await apply_credit(ctx, message)

    settings = make_settings(
        delivery_counts="database",
        count_first_deliveries=True,
        max_deliveries=3,
        retry_budget=0.001,
    )
    async with run_pumps([broker.connect()], [engine], registry, settings):
        broker.publish("m-1", "CreditRequested", {"account_id": "a", "amount": "1"})
        await broker.wait_idle(timeout=20)
    assert broker.dead_letters == []
    assert set(lost) == {1}  # every attempt saw the count of a first delivery
    assert [verb for verb, _, _ in broker.history] == ["nack"] * 4 + ["ack"]
    assert await stored_counts(engine) == {"m-1": 1}  # the delivery that committed
    async with engine.connect() as connection:
        assert (await connection.execute(select(Account.balance))).scalar_one() == Decimal(1)


async def test_a_failure_of_its_own_still_spends_the_stored_count(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """The refund is for give-backs only: a handler's own exception keeps the count."""
    seen: list[int] = []
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        seen.append(ctx.delivery_count)
        raise RuntimeError("the message's own failure")

    broker = MemoryBroker()
    settings = make_settings(
        delivery_counts="database", count_first_deliveries=True, max_deliveries=3
    )
    async with run_pumps([broker.connect()], [engine], registry, settings):
        broker.publish("m-1", "CreditRequested", {"account_id": "a", "amount": "1"})
        await broker.wait_idle(timeout=20)
    assert seen == [1, 2, 3]
    assert len(broker.dead_letters) == 1
    assert await stored_counts(engine) == {"m-1": 3}
