"""Faults that are not the message's own: outages, contention, restarts, slow twins.

Each test here would fail on the pump as it was before these rules: a database
that flaps more often than WORKER_MAX_DELIVERIES, hot keys, a swallowed database
error, an ack lost on the last allowed delivery, a hung message, a schema that is
behind the code, graceful restarts with a full prefetch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from decimal import Decimal

from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.credits import credit_registry
from tests.support.database import marker_count
from tests.support.proxy import proxied
from tests.support.pumps import MakeSettings, RunPumps
from tests.support.waiting import wait_for
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.registry import Context, Registry

CREDIT = {"account_id": "a", "amount": "1"}


async def balance(engine: AsyncEngine, account: str) -> Decimal:
    async with engine.connect() as connection:
        value = await connection.scalar(select(Account.balance).where(Account.id == account))
    return Decimal(value or 0)


def counts(broker: MemoryBroker) -> Counter[int]:
    """How many settlements the broker saw at each delivery count."""
    return Counter(count for _, _, count in broker.history)


async def test_a_database_flapping_more_often_than_max_deliveries_dead_letters_nothing(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    proxy, url = await proxied(postgres_only_url)
    engine = create_engine(url, pool_size=6)
    direct = create_engine(postgres_only_url)
    broker = MemoryBroker()
    settings = make_settings(
        database_url=url, concurrency=4, max_deliveries=2, db_probe_backoff_max=0.1
    )
    total, outages = 300, 5  # more outages than deliveries allowed
    try:
        async with run_pumps([broker.connect()], [engine], credit_registry(), settings) as pumps:
            for n in range(total):
                broker.publish(f"m{n}", "CreditRequested", CREDIT)
            for _ in range(outages):
                await wait_for(lambda: pumps[0].ready, 20, "the pump to resume")
                await asyncio.sleep(0.15)  # some work, some of it in flight at the cut
                await proxy.cut()
                await wait_for(lambda: not pumps[0].health.available, 10, "the pause")
                await proxy.start()
            await broker.wait_idle(timeout=60)
        assert await balance(direct, "a") == total
        assert await marker_count(direct) == total
    finally:
        await engine.dispose()
        await direct.dispose()
        with contextlib.suppress(Exception):
            await proxy.cut()
    assert broker.dead_letters == []
    assert pumps[0].health.outages >= outages
    assert pumps[0].stats["paused"] >= 1  # deliveries were given back during the outages
    assert set(counts(broker)) == {1}  # ... and not one of them spent a delivery


async def test_same_key_deliveries_run_in_order_while_other_keys_flow(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    release = asyncio.Event()
    order: list[str] = []
    running: Counter[str] = Counter()
    overlap: list[str] = []
    registry = Registry()

    # inbox=False: no marker before the handler, so on SQLite the held delivery holds no
    # write lock while it waits (the wait is the key's, not the database's)
    @registry.handler(
        "CreditRequested",
        CreditRequested,
        consumer="credit",
        key=lambda m: m.account_id,
        inbox=False,
    )
    async def credit(ctx: Context, message: CreditRequested) -> None:
        running[message.account_id] += 1
        if running[message.account_id] > 1:
            overlap.append(ctx.message_id)
        try:
            if ctx.message_id == "hot-0":
                await release.wait()  # the first delivery of the hot key holds it
            await apply_credit(ctx, message)
            order.append(ctx.message_id)
        finally:
            running[message.account_id] -= 1

    broker = MemoryBroker()
    settings = make_settings(concurrency=2)
    async with run_pumps([broker.connect()], [engine], registry, settings) as pumps:
        for n in range(3):  # more same-key deliveries than workers, all ahead of the others
            broker.publish(f"hot-{n}", "CreditRequested", {"account_id": "hot", "amount": "1"})
        for n in range(10):
            broker.publish(f"cold-{n}", "CreditRequested", {"account_id": f"c{n}", "amount": "1"})
        # with "hot" held, every other key still goes through on the free worker
        await wait_for(lambda: sum(m.startswith("cold") for m in order) == 10, 20, "cold keys")
        assert not any(m.startswith("hot") for m in order)
        release.set()
        await broker.wait_idle(timeout=20)
    assert [m for m in order if m.startswith("hot")] == ["hot-0", "hot-1", "hot-2"]
    assert overlap == []  # never two deliveries of one key at once
    assert await balance(engine, "hot") == 3
    assert pumps[0].stats["parked"] == 2


async def test_a_swallowed_database_error_is_never_acked(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """``try: INSERT ... except IntegrityError: pass`` without a savepoint: on PostgreSQL the
    transaction is aborted and COMMIT would quietly roll back, marker and all. The pump
    refuses to commit (on SQLite too, where it would commit: the handler is wrong on both)."""
    async with engine.begin() as connection:
        await connection.execute(text("CREATE TABLE seen_orders (number VARCHAR(20) PRIMARY KEY)"))
        await connection.execute(text("INSERT INTO seen_orders VALUES ('A-1')"))
    registry = Registry()

    @registry.handler("Careless", CreditRequested, consumer="careless")
    async def careless(ctx: Context, message: CreditRequested) -> None:
        await apply_credit(ctx, message)
        with contextlib.suppress(IntegrityError):  # the classic mistake: no begin_nested()
            await ctx.session.execute(text("INSERT INTO seen_orders VALUES ('A-1')"))

    @registry.handler("Careful", CreditRequested, consumer="careful")
    async def careful(ctx: Context, message: CreditRequested) -> None:
        try:
            async with ctx.session.begin_nested():
                await ctx.session.execute(text("INSERT INTO seen_orders VALUES ('A-1')"))
        except IntegrityError:
            pass  # the savepoint undid the failed insert: the transaction is healthy
        await apply_credit(ctx, message)

    broker = MemoryBroker()
    with capture_logs() as logs:
        async with run_pumps(
            [broker.connect()], [engine], registry, make_settings(max_deliveries=2)
        ) as pumps:
            broker.publish("careless", "Careless", {"account_id": "x", "amount": "1"})
            broker.publish("careful", "Careful", {"account_id": "y", "amount": "1"})
            await broker.wait_idle(timeout=20)
    assert [v for v, m, _ in broker.history if m == "careless"] == ["nack", "dead-letter"]
    assert [v for v, m, _ in broker.history if m == "careful"] == ["ack"]
    assert await balance(engine, "x") == 0 and await balance(engine, "y") == 1
    assert pumps[0].stats["committed"] == 1
    swallowed = [e for e in logs if e["event"] == "handler swallowed a database error"]
    assert len(swallowed) == 2 and all("begin_nested" in e["hint"] for e in swallowed)
    assert all(e["message_id"] == "careless" and e["consumer"] == "careless" for e in swallowed)


async def test_an_ack_lost_on_the_last_allowed_delivery_is_a_duplicate_not_a_dead_letter(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    broker = MemoryBroker()
    settings = make_settings(max_deliveries=1)
    async with run_pumps([broker.connect()], [engine], credit_registry(), settings) as pumps:
        broker.publish("m1", "CreditRequested", CREDIT, lose_acks=1)  # committed, ack lost
        await broker.wait_idle(timeout=10)
    assert broker.history == [("ack", "m1", 1), ("ack", "m1", 2)]
    assert broker.dead_letters == []
    assert pumps[0].stats["duplicate"] == 1 and await balance(engine, "a") == 1


async def test_over_the_limit_and_not_done_is_dead_lettered(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """The inbox check before the over-count dead letter must not let unfinished work run."""
    registry = Registry()
    calls = Counter[str]()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def fails(ctx: Context, message: CreditRequested) -> None:
        calls["runs"] += 1
        raise RuntimeError("ledger says no")

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings(max_deliveries=2)):
        broker.publish("m1", "CreditRequested", CREDIT)
        await broker.wait_idle(timeout=10)
    assert [v for v, _, _ in broker.history] == ["nack", "dead-letter"]
    assert calls["runs"] == 2


async def test_a_hung_message_does_not_capture_the_pump(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """Its redeliveries (the broker's lock expired) wait on its uncommitted marker only for
    WORKER_MARKER_LOCK_TIMEOUT, then go back uncounted; valid messages keep flowing."""
    engine = create_engine(postgres_only_url, pool_size=6)
    hang = asyncio.Event()
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        if ctx.message_id == "hung" and ctx.delivery_count == 1:
            await hang.wait()  # far longer than the broker's lock
        await apply_credit(ctx, message)

    broker = MemoryBroker(visibility_timeout=0.5)
    settings = make_settings(
        database_url=postgres_only_url, concurrency=4, marker_lock_timeout=0.2, max_deliveries=3
    )
    try:
        async with run_pumps([broker.connect()], [engine], registry, settings) as pumps:
            broker.publish("hung", "CreditRequested", {"account_id": "h", "amount": "1"})
            # its redeliveries give up waiting on its marker, and go back uncounted
            await wait_for(lambda: pumps[0].stats["in-progress"] >= 3, 10, "redeliveries")
            for n in range(5):
                broker.publish(f"m{n}", "CreditRequested", CREDIT)
            await wait_for(lambda: pumps[0].stats["committed"] >= 5, 10, "the valid messages")
            hang.set()
            await broker.wait_idle(timeout=20)
        assert await balance(engine, "a") == 5 and await balance(engine, "h") == 1
    finally:
        await engine.dispose()
    # the expired lock counted once (the broker's redelivery); the give-backs spent nothing
    assert broker.dead_letters == []
    assert {count for verb, mid, count in broker.history if verb == "nack"} == {2}


async def test_a_hung_handler_is_cancelled_after_the_handler_timeout(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """On SQLite a hung attempt holds the database's write lock: the time limit bounds it."""
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        await apply_credit(ctx, message)  # holds the write lock on SQLite from here
        if ctx.message_id == "hung" and ctx.delivery_count == 1:
            await asyncio.sleep(60)

    broker = MemoryBroker()
    # "next" credits another account: on PostgreSQL it would otherwise wait on the hung
    # attempt's row lock and, on a loaded machine, run out of the same time limit
    settings = make_settings(handler_timeout=1.0, concurrency=2)
    async with run_pumps([broker.connect()], [engine], registry, settings):
        broker.publish("hung", "CreditRequested", CREDIT)
        broker.publish("next", "CreditRequested", {"account_id": "b", "amount": "1"})
        await broker.wait_idle(timeout=20)
    assert [v for v, m, _ in broker.history if m == "hung"] == ["nack", "ack"]
    assert [v for v, m, _ in broker.history if m == "next"] == ["ack"]
    assert await balance(engine, "a") == 1
    assert await balance(engine, "b") == 1


async def test_a_schema_behind_the_code_gives_back_uncounted_without_pausing(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """A rollout ahead of its migration: a missing table is not the message's fault. Its
    delivery goes back uncounted (bounded by its give-backs), and the pump stays ready."""
    registry = Registry()

    @registry.handler("Audit", CreditRequested, consumer="audit")
    async def audit(ctx: Context, message: CreditRequested) -> None:
        await ctx.session.execute(text("INSERT INTO audit_log (message_id) VALUES (:m)"),
                                  {"m": ctx.message_id})  # fmt: skip

    broker = MemoryBroker()
    async with run_pumps(
        [broker.connect()], [engine], registry, make_settings(max_deliveries=1)
    ) as pumps:
        broker.publish("m1", "Audit", CREDIT)
        await wait_for(lambda: pumps[0].stats["schema-behind"] >= 1, 10, "the give-back")
        assert pumps[0].ready and pumps[0].health.outages == 0  # no pause of the whole pump
        async with engine.begin() as connection:  # the migration lands
            await connection.execute(text("CREATE TABLE audit_log (message_id VARCHAR(255))"))
        await broker.wait_idle(timeout=30)
        assert pumps[0].ready
    assert broker.dead_letters == []
    assert broker.history[-1] == ("ack", "m1", 1)  # its count never moved


async def test_graceful_restarts_spend_no_delivery_counts(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """Ten rolling restarts of a worker that holds a full prefetch: nothing dead-lettered,
    every message still on its first delivery by count when it finally commits."""
    registry = Registry()
    seen: list[int] = []

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def slow(ctx: Context, message: CreditRequested) -> None:
        if slowly:
            await asyncio.sleep(5)  # cut short by the grace period
        seen.append(ctx.delivery_count)
        await apply_credit(ctx, message)

    broker = MemoryBroker()
    total = 12
    for n in range(total):
        broker.publish(f"m{n}", "CreditRequested", CREDIT)
    slowly = True
    # no grace: what is in a handler is cancelled, what is prefetched never started
    settings = make_settings(max_deliveries=1, concurrency=4, grace_period=0.0)
    for _ in range(10):
        async with run_pumps([broker.connect()], [engine], registry, settings) as [pump]:
            full: int = min(total, pump.prefetch)  # in a handler, or waiting for a worker

            def held(n: int = full) -> bool:
                return broker.in_flight == n

            await wait_for(held, 5, "a full prefetch")
    slowly = False
    async with run_pumps([broker.connect()], [engine], registry, settings):
        await broker.wait_idle(timeout=20)
    assert broker.dead_letters == []
    assert set(seen) == {1}
    assert await balance(engine, "a") == total
