"""Conflict policies on one row: database wins, client wins, merge; changed vs deleted.

Every test makes two writers really collide on the ``products`` row: A loads
it, B commits a change, then A writes from its stale read.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from decimal import Decimal
from typing import Any, cast

import pytest
from sqlalchemy import Table, delete, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm.exc import StaleDataError

from handlers.credit import Account, CreditRequested
from handlers.pricing import Product
from tests.concurrency.concurrency_helpers import count, record_statements
from tests.support.database import ACCOUNTS
from tests.support.pumps import MakeSettings, RunPumps
from worker import concurrency, rejections
from worker.brokers.memory import MemoryBroker
from worker.concurrency import Policy, RowChanged, save
from worker.context import PumpSession, session_factory
from worker.db import Failure, classify
from worker.errors import MergeConflict, RowDeleted
from worker.registry import Context, Registry
from worker.retry import backoff

PRODUCTS = cast(Table, Product.__table__)


async def seed(engine: AsyncEngine, version: int = 1) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            insert(PRODUCTS).values(id="p1", name="lamp", price=Decimal("10.00"), version=version)
        )


async def theirs(engine: AsyncEngine, **values: Any) -> None:
    """B: another writer commits a change, moving the token."""

    async def write() -> None:
        async with engine.begin() as connection:
            await connection.execute(
                update(PRODUCTS)
                .where(PRODUCTS.c.id == "p1")
                .values(**values, version=PRODUCTS.c.version + 1)
            )

    await another_replica(write())


async def another_replica(write: Coroutine[Any, Any, None]) -> None:
    """Run ``write`` as another replica would: outside this handler's context, where the
    pump refuses every commit (worker.db.HANDLER_RUNNING)."""
    await asyncio.create_task(write, context=contextvars.Context())


async def row(engine: AsyncEngine) -> tuple[str, Decimal, int]:
    async with engine.connect() as connection:
        found = (await connection.execute(select(PRODUCTS).where(PRODUCTS.c.id == "p1"))).one()
    return found.name, Decimal(found.price), found.version


class Attempt:
    """A: a handler's context on a fresh pump session, the way the pump makes one."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.session: PumpSession = session_factory(engine)()
        self.ctx = Context(self.session, "m1", "test", 1, 1, {})

    async def load(self) -> Product:
        return await self.session.get_one(Product, "p1")

    async def commit(self) -> None:
        from sqlalchemy.ext.asyncio import AsyncSession

        await AsyncSession.commit(self.session)
        await AsyncSession.close(self.session)

    async def close(self) -> None:
        from sqlalchemy.ext.asyncio import AsyncSession

        await AsyncSession.close(self.session)


@pytest.fixture
async def a(engine: AsyncEngine) -> AsyncIterator[Attempt]:
    await seed(engine)
    attempt = Attempt(engine)
    yield attempt
    await attempt.close()


async def test_database_wins_raises_a_conflict_the_pump_retries(
    engine: AsyncEngine, a: Attempt
) -> None:
    product = await a.load()
    await theirs(engine, name="lantern")
    product.price = Decimal("11.00")
    with pytest.raises(RowChanged) as raised:
        await save(a.ctx, product)
    assert isinstance(raised.value, StaleDataError)
    assert classify(raised.value) is Failure.CONFLICT  # the pump's database-wins retry
    assert await row(engine) == ("lantern", Decimal("10.00"), 2)


async def test_client_wins_adopts_the_current_token_and_writes_our_whole_row(
    engine: AsyncEngine, a: Attempt
) -> None:
    product = await a.load()
    await theirs(engine, name="lantern", price=Decimal("12.00"))
    product.price = Decimal("11.00")
    assert await save(a.ctx, product, policy=Policy.CLIENT_WINS) is True
    await a.commit()
    assert await row(engine) == ("lamp", Decimal("11.00"), 3)  # ours, all of it
    assert product.version == 3


async def test_merge_keeps_their_untouched_fields_and_our_changed_ones(
    engine: AsyncEngine, a: Attempt
) -> None:
    """A row-wide token makes independent fields collide; merge resolves that without a loss."""
    product = await a.load()
    await theirs(engine, name="lantern")
    product.price = Decimal("11.00")
    assert await save(a.ctx, product, policy=Policy.MERGE) is True
    await a.commit()
    assert await row(engine) == ("lantern", Decimal("11.00"), 3)
    assert (product.name, product.version) == ("lantern", 3)


async def test_merge_fails_only_when_both_changed_one_field_differently(
    engine: AsyncEngine, a: Attempt
) -> None:
    product = await a.load()
    await theirs(engine, price=Decimal("12.00"))
    product.price = Decimal("11.00")
    with pytest.raises(MergeConflict) as raised:
        await save(a.ctx, product, policy=Policy.MERGE)
    assert raised.value.fields == ("price",)
    assert raised.value.subject == "products:p1"
    assert await row(engine) == ("lamp", Decimal("12.00"), 2)


async def test_merge_compares_by_value_so_an_equal_change_is_no_conflict(
    engine: AsyncEngine, a: Attempt
) -> None:
    product = await a.load()
    await theirs(engine, price=Decimal("11.0"))  # the same value, another object and scale
    product.price = Decimal("11.00")
    assert await save(a.ctx, product, policy=Policy.MERGE) is False  # nothing left to write
    await a.commit()
    assert await row(engine) == ("lamp", Decimal("11.00"), 2)  # no second bump
    assert product.version == 2


@pytest.mark.parametrize("policy", list(Policy))
async def test_a_vanished_row_is_deleted_not_changed(
    policy: Policy, engine: AsyncEngine, a: Attempt
) -> None:
    product = await a.load()
    async with engine.begin() as connection:
        await connection.execute(delete(PRODUCTS))
    product.price = Decimal("11.00")
    with pytest.raises(RowDeleted) as raised:
        await save(a.ctx, product, policy=policy)
    assert (raised.value.subject, raised.value.expected) == ("products:p1", 1)
    assert not isinstance(raised.value, StaleDataError)  # so the pump does not retry it


async def test_a_no_op_writes_nothing_and_leaves_other_readers_valid(
    engine: AsyncEngine, a: Attempt
) -> None:
    statements = record_statements(engine)
    other = Attempt(engine)
    try:
        mine, theirs_copy = await a.load(), await other.load()
        statements.clear()
        mine.price = Decimal("10.00")  # the value it already has
        assert await save(a.ctx, mine) is False
        await a.commit()
        assert not [s for s in statements if s.startswith("UPDATE")]
        theirs_copy.name = "lantern"
        assert await save(other.ctx, theirs_copy) is True  # its token is still current
        await other.commit()
    finally:
        await other.close()
    assert await row(engine) == ("lantern", Decimal("10.00"), 2)


async def test_large_tokens_are_compared_by_value(engine: AsyncEngine) -> None:
    await seed(engine, version=100_000)
    first = Attempt(engine)
    try:
        product = await first.load()
        product.price = Decimal("11.00")
        assert await save(first.ctx, product, policy=Policy.MERGE) is True
        await first.commit()
    finally:
        await first.close()
    assert await row(engine) == ("lamp", Decimal("11.00"), 100_001)


async def test_resolution_is_bounded_and_backs_off_with_jitter(
    engine: AsyncEngine, a: Attempt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hot row that changes before every write: give up after ``attempts``, no livelock.

    The rival writes through A's own transaction: on SQLite, A's first UPDATE holds the
    database's write lock, so no other connection could commit before A's next round.
    """
    writes = 0
    real_write = concurrency._Row.write

    async def lose_every_time(row_: Any, session: Any, writes_: Any, token: Any) -> Any:
        nonlocal writes
        writes += 1
        await session.execute(
            update(PRODUCTS).values(name=f"lantern-{writes}", version=PRODUCTS.c.version + 1)
        )
        return await real_write(row_, session, writes_, token)

    delays: list[tuple[int, float]] = []

    def recording_backoff(attempt: int, base: float, cap: float) -> float:
        delays.append((attempt, backoff(attempt, base, cap)))
        return delays[-1][1]

    monkeypatch.setattr(concurrency._Row, "write", lose_every_time)
    monkeypatch.setattr(concurrency, "backoff", recording_backoff)
    product = await a.load()
    product.price = Decimal("11.00")
    with pytest.raises(RowChanged, match="still conflicting after 3 attempts"):
        await save(a.ctx, product, policy=Policy.MERGE, attempts=3)
    assert writes == 3
    assert [attempt for attempt, _ in delays] == [1, 2]
    assert all(0 <= delay <= 0.2 for _, delay in delays)


def test_backoff_is_jittered_and_capped() -> None:
    samples = [backoff(4, 0.01, 0.05) for _ in range(200)]
    assert all(0 <= s <= 0.05 for s in samples)
    assert len({round(s, 6) for s in samples}) > 150  # replicas do not retry in lockstep


# -- through the pump ------------------------------------------------------------------------


# On SQLite the pump's marker-first INSERT takes the database's one write lock for the
# whole attempt, so no other writer can commit between a handler's read and its write:
# the collisions below need handlers that skip the inbox (inbox=False) to happen there.


def account_registry(calls: Counter[str], deleting: AsyncEngine, mode: str) -> Registry:
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", inbox=False)
    async def credit(ctx: Context, message: CreditRequested) -> None:
        calls["credit"] += 1
        account = await ctx.session.get_one(Account, message.account_id)
        if calls["credit"] == 1:  # another writer strikes between our read and our write

            async def strike() -> None:
                async with deleting.begin() as connection:
                    if mode == "deleted":
                        await connection.execute(delete(ACCOUNTS))
                    else:
                        await connection.execute(
                            update(ACCOUNTS).values(
                                balance=Account.balance + 100, version=Account.version + 1
                            )
                        )

            await another_replica(strike())
        account.balance += message.amount

    return registry


@pytest.mark.parametrize("mode", ["deleted", "changed"])
async def test_pump_reports_a_deleted_row_and_retries_a_changed_one(
    mode: str, engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    async with engine.begin() as connection:
        await connection.execute(insert(ACCOUNTS).values(id="a", balance=0, version=1))
    calls: Counter[str] = Counter()
    broker = MemoryBroker()
    registry = account_registry(calls, engine, mode)
    async with run_pumps([broker.connect()], [engine], registry, make_settings()) as [pump]:
        broker.publish("m1", "Credit", {"account_id": "a", "amount": "5"})
        await broker.wait_idle(5)
    assert [verb for verb, _, _ in broker.history] == ["ack"]
    rejected = cast(Table, rejections.Rejection.__table__)
    if mode == "deleted":
        assert calls["credit"] == 1  # not retried: a retry would have re-created nothing
        assert pump.stats["deleted"] == 1
        assert await count(engine, ACCOUNTS) == 0
        assert (
            await count(
                engine, rejected, rejected.c.reason == "deleted", rejected.c.subject == "accounts:a"
            )
            == 1
        )
    else:
        assert calls["credit"] == 2  # database wins: re-run on a fresh session
        assert pump.stats["retried-conflict"] == 1
        async with engine.connect() as connection:
            assert await connection.scalar(select(Account.balance)) == Decimal(105)
        assert await count(engine, rejected) == 0


async def test_pump_retries_a_helper_conflict_and_records_a_merge_conflict(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    await seed(engine)
    calls: Counter[str] = Counter()
    registry = Registry()

    @registry.handler("Reprice", CreditRequested, consumer="reprice", inbox=False)
    async def reprice(ctx: Context, message: CreditRequested) -> None:
        calls[ctx.message_id] += 1
        product = await ctx.session.get_one(Product, "p1")
        if calls[ctx.message_id] == 1:
            await theirs(engine, price=Decimal("99.00"))
        product.price = message.amount
        policy = Policy.MERGE if ctx.message_id == "merge" else Policy.DATABASE_WINS
        await save(ctx, product, policy=policy)

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings()) as [pump]:
        broker.publish("dbwins", "Reprice", {"account_id": "-", "amount": "20"})
        await broker.wait_idle(5)
        broker.publish("merge", "Reprice", {"account_id": "-", "amount": "30"})
        await broker.wait_idle(5)
    assert calls == Counter({"dbwins": 2, "merge": 1})
    assert pump.stats["merge-conflict"] == 1
    assert await row(engine) == ("lamp", Decimal("99.00"), 4)  # dbwins applied, then theirs
    rejected = cast(Table, rejections.Rejection.__table__)
    assert (
        await count(
            engine,
            rejected,
            rejected.c.reason == "merge-conflict",
            rejected.c.detail == "fields: price",
        )
        == 1
    )
    assert [verb for verb, _, _ in broker.history] == ["ack", "ack"]


async def test_concurrent_merges_of_independent_fields_both_land(engine: AsyncEngine) -> None:
    await seed(engine)
    barrier = asyncio.Barrier(2)

    async def writer(field: str, value: Any) -> None:
        attempt = Attempt(engine)
        try:
            product = await attempt.load()
            await barrier.wait()  # both have read version 1
            setattr(product, field, value)
            await save(attempt.ctx, product, policy=Policy.MERGE)
            await attempt.commit()
        finally:
            await attempt.close()

    await asyncio.gather(writer("name", "lantern"), writer("price", Decimal("12.50")))
    assert await row(engine) == ("lantern", Decimal("12.50"), 3)
