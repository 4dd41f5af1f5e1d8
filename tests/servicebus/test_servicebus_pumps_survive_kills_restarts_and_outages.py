"""The acceptance scenario on Service Bus, in one process: several pumps, one namespace.

Three workers share a queue carrying credits of which a fifth were sent twice
(a producer's retry). One worker is killed mid-stream: its client is cut off,
so its settlements fail and the messages it held locked come back only when
their locks run out, to whichever worker is free. A fourth worker starts as the
replacement. The balances must come out exact and every message id must be
marked exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from urllib.parse import urlsplit

from pydantic import SecretStr
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from handlers.credit import Account, CreditRequested, apply_credit
from tests.servicebus.fake import FakeClient, FakeServiceBus
from tests.support.proxy import TcpProxy
from tests.support.pumps import engine_for, running_pump
from tests.support.waiting import wait_for
from worker.brokers import OutgoingMessage
from worker.brokers.servicebus import ServiceBusAdmin, ServiceBusConsumer, ServiceBusSettings
from worker.db import create_engine
from worker.inbox import InboxMarker
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings

CREDITS, ACCOUNTS = 300, 10
CONNECTION_STRING = (
    "Endpoint=sb://fake.servicebus.windows.net/;SharedAccessKeyName=t;SharedAccessKey=s"
)


class Process:
    """A worker process's network: ``kill`` cuts every client it made and will make."""

    def __init__(self, bus: FakeServiceBus) -> None:
        self.bus = bus
        self.killed = False
        self.clients: list[FakeClient] = []

    def __call__(self) -> FakeClient:
        client = self.bus.client()
        self.clients.append(client)
        if self.killed:
            self.bus.sever(client)
        return client

    def kill(self) -> None:
        self.killed = True
        for client in self.clients:
            self.bus.sever(client)


class Worker:
    def __init__(
        self,
        bus: FakeServiceBus,
        sb: ServiceBusSettings,
        settings: Settings,
        name: str,
        handlers: Registry | None = None,
    ) -> None:
        self.process = Process(bus)
        self.consumer = ServiceBusConsumer(sb, self.process)
        self.engine: AsyncEngine = create_engine(
            settings.database_url, pool_size=settings.pool_size
        )
        handlers = registry() if handlers is None else handlers
        self.pump = Pump(self.consumer, self.engine, handlers, settings, name=name)
        self.task = asyncio.create_task(self.pump.run())

    async def stop(self) -> None:
        self.pump.stop()
        async with asyncio.timeout(30):
            await self.task
        await self.engine.dispose()


def registry(
    hold: asyncio.Event | None = None, busy: Callable[[], bool] = lambda: False
) -> Registry:
    """The credit handler; with ``hold``, every handler call once ``busy()`` says so waits
    for it (a worker that is sure to hold deliveries when it is killed)."""
    handlers = Registry()

    @handlers.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        if hold is not None and busy():
            await hold.wait()
        await asyncio.sleep(0.002)  # keep every worker holding a few locks
        await apply_credit(ctx, message)

    return handlers


def credits() -> tuple[list[OutgoingMessage], dict[str, Decimal]]:
    messages: list[OutgoingMessage] = []
    expected: dict[str, Decimal] = {}
    for n in range(CREDITS):
        account, amount = f"acct-{n % ACCOUNTS}", Decimal(n % 7 + 1)
        body = json.dumps({"account_id": account, "amount": str(amount)}).encode()
        message = OutgoingMessage(f"credit-{n}", "CreditRequested", body)
        messages += [message, message] if n % 5 == 0 else [message]
        expected[account] = expected.get(account, Decimal(0)) + amount
    return messages, expected


async def test_several_pumps_duplicates_and_a_killed_worker(database_url: str) -> None:
    bus = FakeServiceBus()
    queue = bus.create_queue("work", lock_duration=3.0, max_delivery_count=10)
    sb = ServiceBusSettings(
        connection_string=SecretStr(CONNECTION_STRING),
        queue="work",
        receive_wait=0.2,
        reconnect_backoff=0.05,
        reconnect_backoff_max=0.2,
    )
    settings = Settings(
        database_url=database_url,
        concurrency=4,
        max_deliveries=5,
        retry_backoff=0.001,
        retry_backoff_max=0.02,
        grace_period=5.0,
    )
    messages, expected = credits()
    admin = ServiceBusAdmin(sb, bus.client)
    # The victim holds what it takes once it has acked 20 until it is killed: a fast
    # machine otherwise drained its share between two looks, holding nothing. (Counted in
    # acks, not handler calls: a group that ran again would count its members twice.)
    hold = asyncio.Event()
    victim: Worker | None = None

    def busy() -> bool:
        return victim is not None and victim.pump.stats["ack"] >= 20

    victim = Worker(bus, sb, settings, "worker-0", registry(hold, busy))
    workers = [victim, *(Worker(bus, sb, settings, f"worker-{n}") for n in (1, 2))]

    async def produce() -> None:
        for start in range(0, len(messages), 40):
            await admin.publish(messages[start : start + 40])
            await asyncio.sleep(0.05)

    producer = asyncio.create_task(produce())
    await wait_for(
        lambda: victim.pump.stats["ack"] >= 20 and victim.consumer.unsettled > 0,
        30,
        "the first worker to be busy",
        step=0.02,
    )
    victim.process.kill()
    hold.set()  # its handlers finish now, into a connection that is gone
    await victim.stop()  # nothing it held can be settled now: its locks must run out
    workers.append(Worker(bus, sb, settings, "replacement"))

    await producer
    await wait_for(lambda: bus.idle, 60, "every message settled", step=0.02)
    for worker in workers[1:]:
        await worker.stop()
    await admin.close()

    engine = create_engine(database_url, pool_size=1)
    try:
        async with engine.connect() as connection:
            rows = await connection.execute(select(Account.id, Account.balance))
            balances = {row.id: Decimal(row.balance) for row in rows}
            markers = (
                await connection.execute(select(func.count()).select_from(InboxMarker))
            ).scalar()
    finally:
        await engine.dispose()
    assert balances == expected
    assert markers == CREDITS
    assert queue.dead_letter is not None and queue.dead_letter.count == 0
    assert queue.stats["lock_expired"] >= 1  # the killed worker's locks ran out
    totals = sum((w.pump.stats for w in workers), Counter[str]())
    assert totals["committed"] == CREDITS
    assert totals["duplicate"] >= CREDITS // 5
    assert victim.pump.stats["settlement-lost"] + victim.consumer.stats["receive_failed"] >= 1


RESTARTS, HELD = 10, 8


async def test_graceful_restarts_holding_a_full_prefetch_spend_no_delivery(
    database_url: str,
) -> None:
    """A rolling deploy is not the message's fault: its delivery count must not grow.

    Each worker takes a full prefetch and is stopped while every handler is still
    running (cancelled after the grace period, then given back by the pump). With
    counted give-backs the tenth restart would be the tenth delivery: far past
    WORKER_MAX_DELIVERIES=2, and past the entity's MaxDeliveryCount of 3.
    """
    bus = FakeServiceBus()
    queue = bus.create_queue("work", lock_duration=5.0, max_delivery_count=3)
    sb = ServiceBusSettings(
        connection_string=SecretStr(CONNECTION_STRING), queue="work", receive_wait=0.2
    )
    settings = Settings(
        database_url=database_url, concurrency=4, max_deliveries=2, grace_period=0.1
    )
    release = asyncio.Event()
    counts: dict[str, list[int]] = {}
    handlers = Registry()

    @handlers.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        counts.setdefault(ctx.message_id, []).append(ctx.delivery_count)
        await release.wait()  # until the last worker: every earlier one is stopped mid-run
        await apply_credit(ctx, message)

    admin = ServiceBusAdmin(sb, bus.client)
    body = json.dumps({"account_id": "acct", "amount": "1"}).encode()
    await admin.publish([OutgoingMessage(f"m-{n}", "CreditRequested", body) for n in range(HELD)])
    await admin.close()

    for restart in range(RESTARTS + 1):
        if restart == RESTARTS:
            release.set()
        consumer = ServiceBusConsumer(sb, bus.client)
        async with (
            engine_for(settings.database_url, pool_size=settings.pool_size) as engine,
            running_pump(consumer, engine, handlers, settings, name=f"restart-{restart}") as pump,
        ):
            if restart < RESTARTS:
                await wait_for(lambda: pump.in_flight == 4, 10, "four handlers running", step=0.02)
            else:
                await wait_for(
                    lambda: pump.stats["ack"] == HELD, 20, "every message acked", step=0.02
                )

    assert queue.dead_letter is not None and queue.dead_letter.count == 0
    assert queue.count == 0 and queue.stats["lock_expired"] == 0
    every = [count for seen in counts.values() for count in seen]
    assert set(counts) == {f"m-{n}" for n in range(HELD)}
    assert set(every) == {1}, counts  # every delivery of every message was its first


async def test_a_database_outage_longer_than_lock_renewal_spends_no_delivery(
    postgres_only_url: str,
) -> None:
    """PostgreSQL is cut for longer than several lock renewal windows and lock durations.

    Every message the worker holds meanwhile (in an attempt, waiting in the pump, or
    fetched and untaken) must come back with its count unchanged: with counted
    give-backs, the entity's MaxDeliveryCount of 3 would dead-letter them unread.
    """
    target = urlsplit(postgres_only_url.replace("postgresql+asyncpg", "postgresql"))
    proxy = TcpProxy(target.port or 5432)
    await proxy.start()
    proxied = postgres_only_url.replace(f":{target.port}/", f":{proxy.port}/")
    bus = FakeServiceBus()
    queue = bus.create_queue("work", lock_duration=3.0, max_delivery_count=3)
    sb = ServiceBusSettings(
        connection_string=SecretStr(CONNECTION_STRING),
        queue="work",
        receive_wait=0.2,
        max_lock_renewal=1.5,
    )
    settings = Settings(
        database_url=proxied,
        concurrency=4,
        max_deliveries=2,
        max_attempts=100,
        retry_backoff=0.001,
        retry_backoff_max=0.01,
        db_probe_backoff_max=0.2,
        grace_period=2.0,
    )
    counts: list[int] = []
    handlers = Registry()

    @handlers.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        counts.append(ctx.delivery_count)
        await asyncio.sleep(0.01)
        await apply_credit(ctx, message)

    total = 60
    body = json.dumps({"account_id": "acct", "amount": "1"}).encode()
    admin = ServiceBusAdmin(sb, bus.client)
    await admin.publish([OutgoingMessage(f"m-{n}", "CreditRequested", body) for n in range(total)])
    await admin.close()
    consumer = ServiceBusConsumer(sb, bus.client)
    try:
        async with (
            engine_for(proxied, pool_size=6) as engine,
            running_pump(consumer, engine, handlers, settings, name="outage") as pump,
        ):
            await wait_for(lambda: pump.stats["ack"] >= 10, 20, "some work done", step=0.02)
            await proxy.cut()
            await wait_for(lambda: not pump.ready, 10, "the pump to pause", step=0.02)
            await asyncio.sleep(8.0)  # > 5 renewal windows, > 2 lock durations
            await proxy.start()
            await wait_for(lambda: bus.idle, 60, "every message settled", step=0.02)
    finally:
        with contextlib.suppress(Exception):
            await proxy.cut()

    assert queue.dead_letter is not None and queue.dead_letter.count == 0
    assert queue.stats["lock_expired"] == 0
    assert pump.stats["ack"] >= total and pump.stats["dead-letter"] == 0
    assert set(counts) == {1}, sorted(counts)  # every attempt ran on a first delivery
    assert consumer.stats["withdrawn"] + consumer.stats["reclaimed"] >= 1
    engine = create_engine(postgres_only_url, pool_size=1)
    try:
        async with engine.connect() as connection:
            balance = await connection.scalar(select(Account.balance).where(Account.id == "acct"))
    finally:
        await engine.dispose()
    assert balance is not None
    assert Decimal(balance) == total
