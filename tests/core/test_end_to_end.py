"""Two pumps, one memory broker that duplicates and races: every balance exact."""

from __future__ import annotations

import random
from decimal import Decimal

from sqlalchemy import func, select

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.pumps import MakeSettings, RunPumps
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.inbox import InboxMarker
from worker.registry import Registry

MESSAGES, ACCOUNTS = 2_000, 20


async def test_two_pumps_2000_messages_with_duplicates_and_races(
    database_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    rng = random.Random(2026)
    expected = {f"acct-{n}": Decimal(0) for n in range(ACCOUNTS)}
    broker = MemoryBroker()
    registry = Registry()
    registry.handler("CreditRequested", CreditRequested, consumer="credit")(apply_credit)
    engines = [create_engine(database_url, pool_size=10) for _ in range(2)]
    settings = make_settings(concurrency=8, max_attempts=20)
    duplicated = raced = 0
    try:
        async with run_pumps(
            [broker.connect(), broker.connect()], engines, registry, settings
        ) as pumps:
            for n in range(MESSAGES):
                account, amount = (
                    f"acct-{rng.randrange(ACCOUNTS)}",
                    Decimal(rng.randint(1, 99_999)) / 100,
                )
                expected[account] += amount
                roll = rng.random()
                body = {"account_id": account, "amount": str(amount)}
                if roll < 0.30:
                    duplicated += 1
                    broker.publish(f"m{n}", "CreditRequested", body, copies=2)
                elif roll < 0.40:
                    raced += 1
                    broker.publish(f"m{n}", "CreditRequested", body, to_all=True)
                else:
                    broker.publish(f"m{n}", "CreditRequested", body)
            await broker.wait_idle(timeout=240)

        async with engines[0].connect() as connection:
            rows = await connection.execute(select(Account.id, Account.balance))
            balances = {row.id: Decimal(row.balance) for row in rows}
            marker_rows = await connection.execute(
                select(InboxMarker.message_id, InboxMarker.consumer, func.count()).group_by(
                    InboxMarker.message_id, InboxMarker.consumer
                )
            )
            per_key = [row[2] for row in marker_rows]
    finally:
        for engine in engines:
            await engine.dispose()

    assert balances == expected
    assert len(per_key) == MESSAGES and set(per_key) == {1}
    assert broker.idle and broker.in_flight == 0 and not broker.ready
    assert broker.dead_letters == []
    duplicates = sum(p.stats["duplicate"] for p in pumps)
    assert duplicates == duplicated + raced  # every extra copy was caught
    assert sum(p.stats["committed"] for p in pumps) == MESSAGES
    assert all(p.stats["committed"] > 0 for p in pumps)  # both replicas did real work
