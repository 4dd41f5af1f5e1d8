"""ChangeProductPrice: a command guarded by the sender's expected version (HTTP If-Match)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any, cast

import pytest
from sqlalchemy import Table, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from handlers.pricing import ChangeProductPrice, Product, change_price
from tests.support.pumps import MakeSettings, RunPumps
from worker.brokers.memory import MemoryBroker
from worker.registry import Context, Registry
from worker.rejections import Rejection

PRODUCTS = cast(Table, Product.__table__)
REJECTIONS = cast(Table, Rejection.__table__)


def pricing_registry() -> Registry:
    registry = Registry()
    registry.handler("ChangeProductPrice", ChangeProductPrice, consumer="pricing")(change_price)
    return registry


async def seed(engine: AsyncEngine, price: str = "10.00", version: int = 1) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            insert(PRODUCTS).values(id="p1", name="lamp", price=Decimal(price), version=version)
        )


async def product(engine: AsyncEngine) -> tuple[Decimal, int]:
    async with engine.connect() as connection:
        row = (await connection.execute(select(PRODUCTS.c.price, PRODUCTS.c.version))).one()
    return Decimal(row.price), row.version


async def rejections(engine: AsyncEngine) -> list[tuple[Any, ...]]:
    columns = (
        REJECTIONS.c.message_id,
        REJECTIONS.c.consumer,
        REJECTIONS.c.reason,
        REJECTIONS.c.subject,
        REJECTIONS.c.expected_version,
        REJECTIONS.c.actual_version,
    )
    async with engine.connect() as connection:
        return [
            tuple(r) for r in await connection.execute(select(*columns).order_by(REJECTIONS.c.id))
        ]


def command(price: str, expected: int, product_id: str = "p1") -> dict[str, Any]:
    return {"product_id": product_id, "price": price, "expected_version": expected}


async def run(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, *messages: Any
) -> Any:
    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], pricing_registry(), make_settings()) as [
        pump
    ]:
        for message_id, body in messages:
            broker.publish(message_id, "ChangeProductPrice", body)
            await broker.wait_idle(5)
    return pump, broker


async def test_a_matching_version_is_applied(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    await seed(engine)
    _, broker = await run(engine, make_settings, run_pumps, ("m1", command("12.50", 1)))
    assert await product(engine) == (Decimal("12.50"), 2)
    assert [verb for verb, _, _ in broker.history] == ["ack"]
    assert await rejections(engine) == []


async def test_a_stale_sender_is_rejected_recorded_acked_and_not_retried(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    await seed(engine, price="20.00", version=2)  # someone changed it after the sender looked
    with capture_logs() as logs:
        pump, broker = await run(
            engine,
            make_settings,
            run_pumps,
            ("m1", command("12.50", 1)),
            ("m1", command("12.50", 1)),
        )  # and the broker redelivers it
    assert await product(engine) == (Decimal("20.00"), 2)  # not applied over newer data
    assert await rejections(engine) == [
        ("m1", "pricing", "precondition-failed", "products:p1", 1, 2)
    ]
    assert [verb for verb, _, _ in broker.history] == ["ack", "ack"]  # acked, never nacked
    assert pump.stats["precondition-failed"] == 1 and pump.stats["duplicate"] == 1
    assert not [key for key in pump.stats if key.startswith("retried")]
    [line] = [entry for entry in logs if entry["event"] == "precondition-failed"]
    assert (line["message_id"], line["consumer"], line["expected"], line["actual"]) == (
        "m1",
        "pricing",
        1,
        2,
    )


async def test_the_guard_is_the_senders_version_not_a_fresh_read(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """The trap: guard on the version just loaded and the stale decision wins anyway."""
    await seed(engine, price="20.00", version=2)
    registry = Registry()

    @registry.handler("ChangeProductPrice", ChangeProductPrice, consumer="naive")
    async def naive(ctx: Context, message: ChangeProductPrice) -> None:
        row = await ctx.session.get_one(Product, message.product_id)  # version 2, guard on 2
        row.price = message.price

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings()):
        broker.publish("m1", "ChangeProductPrice", command("12.50", 1))
        await broker.wait_idle(5)
    assert await product(engine) == (Decimal("12.50"), 3)  # overwrote the newer price


async def test_concurrent_senders_with_one_expected_version_apply_once(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    await seed(engine)
    broker = MemoryBroker()
    settings = make_settings(concurrency=8)
    async with run_pumps([broker.connect()], [engine], pricing_registry(), settings) as [pump]:
        for n in range(8):
            broker.publish(f"m{n}", "ChangeProductPrice", command(f"{11 + n}.00", 1))
        await broker.wait_idle(10)
    _, version = await product(engine)
    assert version == 2
    assert pump.stats["committed"] == 1 and pump.stats["precondition-failed"] == 7
    rejected = await rejections(engine)
    assert len(rejected) == 7 and all(r[4:] == (1, 2) for r in rejected)
    assert not broker.dead_letters


async def test_a_no_op_does_not_move_the_version_and_large_versions_compare_by_value(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    await seed(engine, price="10.00", version=100_000)
    pump, _ = await run(
        engine,
        make_settings,
        run_pumps,
        ("m1", command("10.00", 100_000)),
        ("m2", command("11.00", 100_000)),
    )  # a second sender, same view
    assert await product(engine) == (Decimal("11.00"), 100_001)
    assert pump.stats["committed"] == 2
    assert await rejections(engine) == []


async def test_a_missing_product_is_recorded_as_deleted(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    pump, broker = await run(engine, make_settings, run_pumps, ("m1", command("1.00", 3, "gone")))
    assert await rejections(engine) == [("m1", "pricing", "deleted", "products:gone", 3, None)]
    assert pump.stats["deleted"] == 1
    assert [verb for verb, _, _ in broker.history] == ["ack"]


@pytest.mark.parametrize(
    "body",
    [
        {"product_id": "p1", "price": "1.00"},
        {"product_id": "p1", "price": "-1", "expected_version": 1},
        {"product_id": "p1", "price": "1.001", "expected_version": 1},
        {"product_id": "p1", "price": "1", "expected_version": 0},
    ],
)
async def test_a_malformed_command_is_dead_lettered(
    body: dict[str, Any], engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    _, broker = await run(engine, make_settings, run_pumps, ("m1", body))
    [letter] = broker.dead_letters
    assert letter.reason.startswith("invalid body for ChangeProductPrice")


async def test_a_rival_write_between_the_senders_read_and_the_update_is_caught(
    engine: AsyncEngine,
) -> None:
    """Directly: the guarded UPDATE matches nothing once the version moved."""
    await seed(engine)
    from sqlalchemy.ext.asyncio import AsyncSession

    from worker.context import session_factory
    from worker.errors import PreconditionFailed

    async with engine.begin() as connection:
        await connection.execute(update(PRODUCTS).values(price=Decimal(30), version=2))
    session = session_factory(engine)()
    try:
        with pytest.raises(PreconditionFailed) as raised:
            message = ChangeProductPrice(product_id="p1", price=Decimal(5), expected_version=1)
            await change_price(Context(session, "m1", "pricing", 1, 1, {}), message)
    finally:
        await AsyncSession.close(session)
    assert (raised.value.expected, raised.value.actual) == (1, 2)
