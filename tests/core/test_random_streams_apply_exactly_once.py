"""Property: whatever the broker does (duplicates, races, lost acks, redeliveries after
failures), every credit is applied exactly once."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import TypedDict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.pumps import running_pumps
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.inbox import InboxMarker
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings


class Misbehaviour(TypedDict, total=False):
    """What :meth:`MemoryBroker.publish` may do wrong with a message."""

    copies: int
    to_all: bool
    lose_acks: int


MISBEHAVIOUR: dict[str, Misbehaviour] = {
    "plain": {},
    "producer-retry": {"copies": 2},
    "both-replicas": {"to_all": True},
    "ack-lost": {"lose_acks": 1},
    "fails-once": {},
}

streams = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.integers(min_value=1, max_value=99_999),
        st.sampled_from(sorted(MISBEHAVIOUR)),
    ),
    min_size=1,
    max_size=30,
)


async def scenario(url: str, stream: list[tuple[str, int, str]]) -> None:
    failed_once: set[str] = set()
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        if ctx.message_id.endswith("fails-once") and ctx.message_id not in failed_once:
            failed_once.add(ctx.message_id)
            raise RuntimeError("first delivery fails")
        await apply_credit(ctx, message)

    broker = MemoryBroker()
    engines = [create_engine(url, pool_size=4) for _ in range(2)]
    config = Settings(database_url=url, concurrency=4, max_attempts=20, retry_backoff=0.001)
    pumps = [Pump(broker.connect(), engine, registry, config) for engine in engines]
    expected: Counter[str] = Counter()
    async with running_pumps(pumps):
        for n, (account, cents, how) in enumerate(stream):
            expected[account] += cents
            body = {"account_id": account, "amount": str(Decimal(cents) / 100)}
            broker.publish(f"m{n}-{how}", "CreditRequested", body, **MISBEHAVIOUR[how])
        await broker.wait_idle(timeout=60)
    async with engines[0].connect() as connection:
        rows = await connection.execute(select(Account.id, Account.balance))
        balances = {row.id: int(Decimal(row.balance) * 100) for row in rows}
        markers = await connection.scalar(select(func.count()).select_from(InboxMarker))
    for engine in engines:
        await engine.dispose()
    assert balances == dict(expected)
    assert markers == len(stream)
    assert broker.dead_letters == [] and broker.idle


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams)
def test_every_credit_is_applied_exactly_once(
    sqlite_template: Path, stream: list[tuple[str, int, str]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "worker.db"
        shutil.copy(sqlite_template, path)
        asyncio.run(scenario(f"sqlite+aiosqlite:///{path}", stream))
