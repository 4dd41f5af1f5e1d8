"""The partitioned inbox needs READ COMMITTED (its lookup must see commits made while it
waited for the key), whatever the database, the role or a handler made the default.

- A database whose ``default_transaction_isolation`` is REPEATABLE READ (``ALTER DATABASE``
  or ``ALTER ROLE ... SET``): every marker insert failed with 0A000, a counted failure, and
  every message ended dead-lettered. The worker's transactions now say their isolation
  (``BEGIN ISOLATION LEVEL READ COMMITTED``), so it works there: migrated, handled,
  deduplicated, and the housekeeping's rollover carries its claims as anywhere else.
- A handler that runs ``SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL
  REPEATABLE READ`` changes its pooled connection's default for good: later messages on
  that connection failed their marker insert. They no longer depend on that default.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import text

from handlers.credit import CreditRequested, apply_credit
from tests.support.database import admin, balances, execute, fetch, marker_count, own_database
from tests.support.migrations import migrate_with_the_example
from tests.support.pumps import running_pump
from worker import partitions, retention, rollover
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.registry import Context, Registry
from worker.settings import Settings

pytestmark = pytest.mark.postgres

PERIOD = timedelta(hours=1)
MESSAGES = 12
REPEATABLE_READ = "default_transaction_isolation = 'repeatable read'"


def _database(url: str) -> str:
    return url.rsplit("/", 1)[1]


@pytest.fixture
def repeatable_read_url() -> Iterator[str]:
    """A database whose every session starts in REPEATABLE READ, migrated to the
    partitioned inbox under that default (``worker migrate`` runs there too)."""
    with own_database("worker_rr") as url:
        asyncio.run(admin(f'ALTER DATABASE "{_database(url)}" SET {REPEATABLE_READ}'))
        migrate_with_the_example(url, inbox_layout="partitioned", partition_period=PERIOD)
        yield url


@pytest.fixture
def partitioned_url() -> Iterator[str]:
    with own_database("worker_iso") as url:
        migrate_with_the_example(url, inbox_layout="partitioned", partition_period=PERIOD)
        yield url


def _settings(url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": url,
        "inbox_layout": "partitioned",
        "inbox_partition_period": PERIOD,
        "concurrency": 4,
        "max_deliveries": 1,  # any counted failure dead-letters
        "broker_lock_timeout": timedelta(minutes=1),
        "message_ttl": timedelta(minutes=5),
        "dead_letter_margin": timedelta(0),
        "inbox_retention": 2 * PERIOD,
        "retry_backoff": 0.001,
        "retry_backoff_max": 0.01,
        "grace_period": 5.0,
        **overrides,
    }
    return Settings(**values)


async def _credits(url: str, registry: Registry, settings: Settings, pool: int) -> MemoryBroker:
    """MESSAGES credits (each published twice) through one pump; the broker once idle."""
    broker = MemoryBroker()
    engine = create_engine(url, pool_size=pool, max_overflow=0)
    try:
        async with running_pump(broker.connect(), engine, registry, settings):
            for n in range(MESSAGES):
                body = {"account_id": f"acct-{n % 3}", "amount": "1"}
                broker.publish(f"m{n}", "CreditRequested", body, copies=2)
            await broker.wait_idle(timeout=60)
    finally:
        await engine.dispose()
    return broker


async def _every_credit_applied_once(url: str, broker: MemoryBroker) -> None:
    assert [letter.reason for letter in broker.dead_letters] == []
    assert await marker_count(url) == MESSAGES
    assert await balances(url) == {f"acct-{n}": Decimal(MESSAGES // 3) for n in range(3)}


@pytest.mark.parametrize("batch_size", [1, 8], ids=["per-message", "batch"])
async def test_a_repeatable_read_database_default_dead_letters_nothing(
    repeatable_read_url: str, batch_size: int
) -> None:
    (default,) = await fetch(repeatable_read_url, "SHOW default_transaction_isolation")
    assert default[0] == "repeatable read"  # the database really is set so
    registry = Registry()
    registry.handler("CreditRequested", CreditRequested, consumer="credit")(apply_credit)
    settings = _settings(repeatable_read_url, batch_size=batch_size)
    broker = await _credits(repeatable_read_url, registry, settings, pool=4)
    await _every_credit_applied_once(repeatable_read_url, broker)


async def test_a_role_whose_default_is_repeatable_read_dead_letters_nothing(
    partitioned_url: str,
) -> None:
    role = f"worker_rr_{_database(partitioned_url)[-10:]}"
    await admin(f"CREATE ROLE {role} LOGIN SUPERUSER")
    try:
        await admin(f"ALTER ROLE {role} SET {REPEATABLE_READ}")
        url = partitioned_url.replace("//postgres@", f"//{role}@")
        registry = Registry()
        registry.handler("CreditRequested", CreditRequested, consumer="credit")(apply_credit)
        broker = await _credits(url, registry, _settings(url), pool=2)
        await _every_credit_applied_once(url, broker)
    finally:
        await admin(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
        )
        await admin(f"DROP ROLE IF EXISTS {role}")


async def test_a_handlers_session_isolation_stays_with_its_own_message(
    partitioned_url: str,
) -> None:
    """One pooled connection: every message after the first runs on the connection whose
    session default the first handler set to REPEATABLE READ."""
    changed: list[str] = []

    async def credit_and_change_the_session(ctx: Context, message: CreditRequested) -> None:
        await ctx.session.execute(
            text("SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        )
        changed.append(str(ctx.message_id))
        await apply_credit(ctx, message)

    registry = Registry()
    registry.handler("CreditRequested", CreditRequested, consumer="credit")(
        credit_and_change_the_session
    )
    settings = _settings(partitioned_url, concurrency=1)
    broker = await _credits(partitioned_url, registry, settings, pool=1)
    assert len(changed) == MESSAGES  # the session default really was changed, every time
    await _every_credit_applied_once(partitioned_url, broker)


async def test_rollover_carries_claims_on_a_repeatable_read_database(
    repeatable_read_url: str,
) -> None:
    """Dropping an expired partition moves its unfinished claims into the live ones: an
    INSERT through the parent, so through the admission function."""
    settings = _settings(repeatable_read_url)
    engine = create_engine(repeatable_read_url, pool_size=1)
    try:
        async with engine.connect() as connection:
            hour = rollover.boundary(await retention.database_now(connection), PERIOD)
        # a partition ahead (the old table covers everything before its cut); the pass is
        # told it is later, when that partition is past the retention
        lower = hour + 10 * PERIOD
        async with engine.begin() as connection:
            for statement in partitions.create_partition(lower, lower + PERIOD):
                await connection.exec_driver_sql(statement)
        expired = partitions.partition_name(lower)
        await execute(
            repeatable_read_url,
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED",  # this one says it itself
            "INSERT INTO inbox (message_id, consumer, stored_at, state, lease_until, "
            f"claimed_by) VALUES ('claim', 'mail', '{(lower + PERIOD / 2).isoformat()}', "
            "'claimed', now() + interval '1 hour', 'x')",
        )
        then = lower + PERIOD + 2 * PERIOD  # the retention
        result = await retention.purge(engine, settings, now=then)
    finally:
        await engine.dispose()
    assert result.rollover is not None and expired in result.rollover.dropped
    assert result.rollover.carried >= 1
    (row,) = await fetch(
        repeatable_read_url,
        "SELECT tableoid::regclass::text, state FROM inbox WHERE message_id = 'claim'",
    )
    assert row[0] != expired and row[1] == "claimed"
