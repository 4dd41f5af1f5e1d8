"""The race from the design notes: check-then-insert is no protection; the constraint is."""

from __future__ import annotations

import asyncio
from decimal import Decimal

from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.database import ACCOUNTS
from tests.support.pumps import MakeSettings, RunPumps
from worker.brokers.memory import MemoryBroker
from worker.db import Failure, classify, create_engine
from worker.inbox import InboxMarker
from worker.registry import Context, Registry

PAUSE = 0.2  # a real pause between check and save, so both replicas really are in it


async def _seed(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        await connection.execute(ACCOUNTS.insert().values(id="a", balance=0, version=1))
        await connection.execute(
            text("CREATE TABLE naive_inbox (message_id VARCHAR(255), consumer VARCHAR(255))")
        )


async def _check_then_save(engine: AsyncEngine, marker_table: str, barrier: asyncio.Barrier) -> str:
    """One replica's naive attempt: look, pause, credit, insert the marker, commit."""
    async with AsyncSession(engine) as session:
        seen = await session.scalar(
            text(f"SELECT count(*) FROM {marker_table} WHERE message_id = 'm1' AND consumer = 'c'")
        )
        await barrier.wait()  # both replicas have looked and seen nothing
        await asyncio.sleep(PAUSE)
        if seen:
            return "skipped"
        try:
            await session.execute(text("UPDATE accounts SET balance = balance + 10 WHERE id = 'a'"))
            await session.execute(
                text(f"INSERT INTO {marker_table} (message_id, consumer) VALUES ('m1', 'c')")
            )
            await session.commit()
        except IntegrityError as exc:
            return classify(exc).value
        return "committed"


async def _totals(engine: AsyncEngine, marker_table: str) -> tuple[Decimal, int]:
    async with engine.connect() as connection:
        balance = await connection.scalar(text("SELECT balance FROM accounts WHERE id = 'a'"))
        count = await connection.scalar(text(f"SELECT count(*) FROM {marker_table}"))
    return Decimal(balance), int(count)


async def test_without_the_constraint_both_replicas_apply_the_credit(database_url: str) -> None:
    engines = [create_engine(database_url) for _ in range(2)]
    try:
        await _seed(engines[0])
        barrier = asyncio.Barrier(2)
        results = await asyncio.gather(
            *(_check_then_save(e, "naive_inbox", barrier) for e in engines)
        )
        assert results == ["committed", "committed"]
        assert await _totals(engines[0], "naive_inbox") == (Decimal(20), 2)  # credited twice
    finally:
        for engine in engines:
            await engine.dispose()


async def test_with_the_constraint_one_commits_and_the_other_is_a_duplicate(
    database_url: str,
) -> None:
    engines = [create_engine(database_url) for _ in range(2)]
    try:
        await _seed(engines[0])
        barrier = asyncio.Barrier(2)
        results = await asyncio.gather(*(_check_then_save(e, "inbox", barrier) for e in engines))
        assert sorted(results) == ["committed", Failure.DUPLICATE.value]
        assert await _totals(engines[0], "inbox") == (Decimal(10), 1)
    finally:
        for engine in engines:
            await engine.dispose()


async def test_two_pumps_given_the_same_message_at_once_apply_it_once(
    database_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    in_handler = 0
    overlapped = False
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def slow_credit(ctx: Context, message: CreditRequested) -> None:
        nonlocal in_handler, overlapped
        in_handler += 1
        await asyncio.sleep(PAUSE)
        overlapped = overlapped or in_handler > 1
        await apply_credit(ctx, message)
        in_handler -= 1

    engines = [create_engine(database_url) for _ in range(2)]
    broker = MemoryBroker()
    try:
        async with run_pumps(
            [broker.connect(), broker.connect()], engines, registry, make_settings()
        ) as pumps:
            broker.publish(
                "m1", "CreditRequested", {"account_id": "a", "amount": "10"}, to_all=True
            )
            await broker.wait_idle(timeout=10)
        assert [verb for verb, _, _ in broker.history] == ["ack", "ack"]
        assert sorted(p.stats["committed"] for p in pumps) == [0, 1]
        assert sorted(p.stats["duplicate"] for p in pumps) == [0, 1]
        async with engines[0].connect() as connection:
            assert await connection.scalar(select(Account.balance)) == Decimal(10)
            assert await connection.scalar(select(func.count()).select_from(InboxMarker)) == 1
        # the loser waited on the winner's uncommitted marker instead of running the handler
        assert not overlapped
    finally:
        for engine in engines:
            await engine.dispose()


async def test_all_or_nothing_a_failed_business_write_leaves_no_marker(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit_then_fail(ctx: Context, message: CreditRequested) -> None:
        await apply_credit(ctx, message)
        await ctx.session.flush()  # the credit reached the database inside the transaction
        raise RuntimeError("the handler failed after writing")

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings(max_deliveries=1)):
        broker.publish("m1", "CreditRequested", {"account_id": "a", "amount": "10"})
        await broker.wait_idle(timeout=10)
    assert [verb for verb, _, _ in broker.history] == ["dead-letter"]
    async with engine.connect() as connection:
        assert await connection.scalar(select(func.count()).select_from(InboxMarker)) == 0
        assert await connection.scalar(select(func.count()).select_from(Account)) == 0
