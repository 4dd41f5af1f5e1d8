"""A database outage pauses the pump: nothing is dead-lettered, the log is not flooded."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from decimal import Decimal
from urllib.parse import urlsplit

from sqlalchemy import select
from structlog.testing import capture_logs

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.proxy import TcpProxy
from tests.support.pumps import MakeSettings, RunPumps
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.registry import Context, Registry


async def test_outage_pauses_intake_and_loses_nothing(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    target = urlsplit(postgres_only_url.replace("postgresql+asyncpg", "postgresql"))
    proxy = TcpProxy(target.port or 5432)
    await proxy.start()
    proxied_url = postgres_only_url.replace(f":{target.port}/", f":{proxy.port}/")
    committed = asyncio.Event()
    done = 0
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        nonlocal done
        await asyncio.sleep(0.005)
        await apply_credit(ctx, message)
        done += 1
        if done == 40:
            committed.set()

    engine = create_engine(proxied_url, pool_size=6)
    direct = create_engine(postgres_only_url)
    broker = MemoryBroker()
    settings = make_settings(
        database_url=proxied_url,
        concurrency=4,
        max_deliveries=3,
        max_attempts=100,
        db_probe_backoff_max=0.2,
    )
    messages = 300
    try:
        with capture_logs() as logs:
            async with run_pumps([broker.connect()], [engine], registry, settings) as pumps:
                for n in range(messages):
                    broker.publish(f"m{n}", "CreditRequested", {"account_id": "a", "amount": "1"})
                await asyncio.wait_for(committed.wait(), 30)
                await proxy.cut()
                await asyncio.sleep(0.3)
                assert not pumps[0].ready  # paused: a readiness probe would say so
                taken_while_down = broker.stats["delivered"]
                await asyncio.sleep(1.0)
                assert broker.stats["delivered"] == taken_while_down  # no intake while paused
                await proxy.start()
                await broker.wait_idle(timeout=60)
                assert pumps[0].ready
        async with direct.connect() as connection:
            total = await connection.scalar(select(Account.balance).where(Account.id == "a"))
    finally:
        await engine.dispose()
        await direct.dispose()
        with contextlib.suppress(Exception):
            await proxy.cut()

    assert Decimal(total) == messages
    assert broker.dead_letters == []
    pump = pumps[0]
    assert pump.health.outages >= 1
    events = [entry["event"] for entry in logs]
    assert events.count("database unavailable, pausing intake") == pump.health.outages
    assert events.count("database available, resuming") == pump.health.outages
    assert "handler failed" not in events  # an outage is not the handler's fault
    # at most the in-flight deliveries (a group each worker) were given back, per outage
    assert 1 <= pump.stats["paused"] <= pump.prefetch * pump.health.outages
    assert broker.stats["nacked"] == pump.stats["paused"]
    assert sum(1 for entry in logs if entry.get("exc_info")) == 0  # no traceback flood


async def test_too_many_connections_pauses_instead_of_dead_lettering(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """SQLSTATE 53300 is the database saying "not now", not the message's fault; and
    loops already waiting for a delivery when the gate closed must hold, not burn counts."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from worker.db import Failure, classify

    role = f"worker_limited_{uuid.uuid4().hex[:8]}"
    database = postgres_only_url.rsplit("/", 1)[1]
    admin = create_engine(postgres_only_url)
    async with admin.begin() as connection:
        await connection.execute(text(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 1'))
        await connection.execute(text(f'GRANT ALL ON DATABASE "{database}" TO "{role}"'))
        await connection.execute(text(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{role}"'))
        await connection.execute(text(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{role}"'))
    limited_url = postgres_only_url.replace("postgres@", f"{role}@")
    hog = create_engine(limited_url, pool_size=1)
    # one pooled connection, no overflow: once the slot is free the worker fits its limit
    engine = create_async_engine(limited_url, pool_size=1, max_overflow=0)
    registry = Registry()
    registry.handler("CreditRequested", CreditRequested, consumer="credit")(apply_credit)
    broker = MemoryBroker()
    settings = make_settings(
        database_url=limited_url, concurrency=4, max_deliveries=2, db_probe_backoff_max=0.2
    )
    try:
        held = await hog.connect()  # the role's only connection slot is taken
        await held.execute(text("SELECT 1"))
        try:
            async with engine.connect():
                pass
        except Exception as exc:
            assert classify(exc) is Failure.CONNECTION
        else:
            raise AssertionError("the second connection should have been refused")
        async with run_pumps([broker.connect()], [engine], registry, settings) as pumps:
            for n in range(3):
                broker.publish(f"m{n}", "CreditRequested", {"account_id": "a", "amount": "1"})
            await asyncio.sleep(1.5)  # several probe rounds while refused
            assert not pumps[0].ready and broker.dead_letters == []
            # each in-flight delivery was given back at most once, then held: with
            # WORKER_MAX_DELIVERIES=2 a second give-back would have dead-lettered it
            assert broker.stats["nacked"] <= 3
            await held.close()
            await hog.dispose()  # the slot frees up
            await broker.wait_idle(timeout=30)
        async with admin.connect() as connection:
            total = await connection.scalar(select(Account.balance).where(Account.id == "a"))
        assert total is not None
        assert Decimal(total) == 3 and broker.dead_letters == [], (pumps[0].stats, broker.history)
        assert pumps[0].health.outages >= 1
    finally:
        await engine.dispose()
        await hog.dispose()
        async with admin.begin() as connection:
            await connection.execute(text(f'DROP OWNED BY "{role}"'))
            await connection.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
        await admin.dispose()
