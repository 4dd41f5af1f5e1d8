"""Version tokens: two writers really collide, and without the token an update is lost."""

from __future__ import annotations

import asyncio
import random
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Integer, Numeric, String, func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.orm.exc import StaleDataError

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.database import ACCOUNTS
from tests.support.pumps import MakeSettings, RunPumps
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.inbox import InboxMarker
from worker.registry import Context, Registry


class _Unversioned(DeclarativeBase):
    pass


class PlainAccount(_Unversioned):
    """The same table, mapped without the token: what the trap looks like."""

    __tablename__ = "accounts"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    balance: Mapped[Decimal] = mapped_column(Numeric(18, 2))
    version: Mapped[int] = mapped_column(Integer)


async def _two_writers(engine: AsyncEngine, model: Any) -> Decimal:
    """A and B read the row; A adds 10 and commits; then B adds 5 from its stale read."""
    async with engine.begin() as connection:
        await connection.execute(ACCOUNTS.insert().values(id="a", balance=100, version=1))
    async with AsyncSession(engine) as a, AsyncSession(engine) as b:
        row_a = await a.get_one(model, "a")
        row_b = await b.get_one(model, "a")
        row_a.balance += 10
        await a.commit()
        row_b.balance += 5
        await b.commit()
    async with engine.connect() as connection:
        balance = await connection.scalar(select(Account.balance))
    assert balance is not None
    return Decimal(balance)


async def test_with_the_token_the_second_writer_gets_a_conflict(engine: AsyncEngine) -> None:
    with pytest.raises(StaleDataError):
        await _two_writers(engine, Account)
    async with engine.connect() as connection:
        row = (await connection.execute(select(Account.balance, Account.version))).one()
    assert (Decimal(row.balance), row.version) == (Decimal(110), 2)  # A's write, token moved


async def test_without_the_token_the_first_update_is_lost(engine: AsyncEngine) -> None:
    assert await _two_writers(engine, PlainAccount) == Decimal(105)  # A's +10 vanished


def _spread(
    messages: int, accounts: int
) -> tuple[list[tuple[str, str, Decimal]], dict[str, Decimal]]:
    rng = random.Random(42)
    stream, expected = [], {f"acct-{n}": Decimal(0) for n in range(accounts)}
    for n in range(messages):
        account, amount = f"acct-{n % accounts}", Decimal(rng.randint(1, 999)) / 100
        stream.append((f"m{n}", account, amount))
        expected[account] += amount
    return stream, expected


async def _balances(engine: AsyncEngine) -> dict[str, Decimal]:
    async with engine.connect() as connection:
        rows = await connection.execute(select(Account.id, Account.balance))
        return {row.id: Decimal(row.balance) for row in rows}


async def test_concurrent_credits_to_one_account_sum_exactly(
    database_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    stream, expected = _spread(messages=200, accounts=1)
    engines = [create_engine(database_url, pool_size=10) for _ in range(2)]
    broker = MemoryBroker()
    registry = Registry()
    registry.handler("CreditRequested", CreditRequested, consumer="credit")(apply_credit)
    settings = make_settings(concurrency=8, max_attempts=50)
    try:
        async with run_pumps(
            [broker.connect(), broker.connect()], engines, registry, settings
        ) as pumps:
            for message_id, account, amount in stream:
                broker.publish(
                    message_id, "CreditRequested", {"account_id": account, "amount": str(amount)}
                )
            await broker.wait_idle(timeout=60)
        assert await _balances(engines[0]) == expected
        assert not broker.dead_letters
        assert sum(p.stats["committed"] for p in pumps) == len(stream)
    finally:
        for engine in engines:
            await engine.dispose()


async def test_pump_without_the_token_loses_updates_on_postgresql(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """The same stream with an unversioned read-modify-write: PostgreSQL runs the two
    replicas' transactions truly in parallel, so credits vanish. (On SQLite the marker
    insert takes the file's write lock first, which serialises handlers; the two-writer
    test above proves the trap there.)"""
    stream, expected = _spread(messages=60, accounts=1)
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="plain-credit")
    async def plain_credit(ctx: Context, message: CreditRequested) -> None:
        account = await ctx.session.get(PlainAccount, message.account_id)
        await asyncio.sleep(0.01)  # work between read and write, where concurrency lives
        assert account is not None
        account.balance += message.amount

    engines = [create_engine(postgres_only_url, pool_size=10) for _ in range(2)]
    try:
        async with engines[0].begin() as connection:
            await connection.execute(ACCOUNTS.insert().values(id="acct-0", balance=0, version=1))
        broker = MemoryBroker()
        settings = make_settings(database_url=postgres_only_url, concurrency=8)
        async with run_pumps([broker.connect(), broker.connect()], engines, registry, settings):
            for message_id, account, amount in stream:
                broker.publish(
                    message_id, "CreditRequested", {"account_id": account, "amount": str(amount)}
                )
            await broker.wait_idle(timeout=60)
        async with engines[0].connect() as connection:
            markers = await connection.scalar(select(func.count()).select_from(InboxMarker))
        assert markers == len(stream)  # every message "processed" exactly once...
        assert (await _balances(engines[0]))["acct-0"] < expected["acct-0"]  # ...yet money vanished
    finally:
        for engine in engines:
            await engine.dispose()
