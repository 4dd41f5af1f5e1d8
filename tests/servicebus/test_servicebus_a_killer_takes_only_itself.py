"""A message that kills the process takes only itself to the dead-letter sub-queue (Service Bus).

The namespace is the fake (tests/servicebus/fake.py), so each "process" lives in this
one: a worker is its own Service Bus clients plus its own database connections, behind a
loopback proxy. A death cuts both at once, as a killed pod would leave them: in-flight
transactions roll back, nothing is settled, and the entity re-offers every message the
worker held locked when its locks run out, each with a higher delivery count. The
replacement worker counts starts instead, and runs a suspect that came back after a
counted start alone, so the killer is dead-lettered after exactly WORKER_MAX_DELIVERIES
deaths and no valid message is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from decimal import Decimal

import pytest
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import AsyncEngine

from handlers.credit import CreditRequested, apply_credit
from tests.servicebus.fake import FakeClient, FakeServiceBus
from tests.support.database import balances, scalar
from tests.support.proxy import TcpProxy, proxied
from worker.brokers import OutgoingMessage
from worker.brokers.servicebus import ServiceBusAdmin, ServiceBusConsumer, ServiceBusSettings
from worker.context import Context
from worker.db import create_engine
from worker.pump import Pump
from worker.registry import Registry
from worker.settings import Settings

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(300)]

CONNECTION_STRING = (
    "Endpoint=sb://fake.servicebus.windows.net/;SharedAccessKeyName=t;SharedAccessKey=s"
)
VALID, MAX_DELIVERIES = 200, 5


class Process:
    """One worker process: its pump, its Service Bus clients and its database connections."""

    def __init__(
        self,
        bus: FakeServiceBus,
        sb: ServiceBusSettings,
        settings: Settings,
        database: TcpProxy,
        url: str,
        handlers: Registry,
    ) -> None:
        self.bus = bus
        self.database = database
        self.clients: list[FakeClient] = []
        self.dead = False
        self.engine: AsyncEngine = create_engine(url, pool_size=settings.pool_size)
        self.pump = Pump(ServiceBusConsumer(sb, self.client), self.engine, handlers, settings)
        self.task = asyncio.create_task(self.pump.run())

    def client(self) -> FakeClient:
        client = self.bus.client()
        self.clients.append(client)
        if self.dead:
            self.bus.sever(client)
        return client

    async def die(self) -> None:
        """Gone at once: no settlement, no rollback of its own, no refund."""
        self.dead = True
        for client in self.clients:
            self.bus.sever(client)
        await self.database.refuse()
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task
        await self.engine.dispose()

    async def stop(self) -> None:
        self.pump.stop()
        async with asyncio.timeout(30):
            await self.task
        await self.engine.dispose()


@pytest.mark.parametrize(
    ("batch_size", "killers"),
    [(1, ["kill-1"]), (1, ["kill-1", "kill-2"]), (16, ["kill-1", "kill-2"])],
    ids=["per-message", "per-message-two-killers", "batch-two-killers"],
)
async def test_a_killer_is_dead_lettered_alone_after_max_deliveries_deaths(
    postgres_only_url: str, batch_size: int, killers: list[str]
) -> None:
    bus = FakeServiceBus()
    # the entity's own limit sits above the worker's: it counts every return, held or not
    queue = bus.create_queue("work", lock_duration=5.0, max_delivery_count=100)  # its minimum
    sb = ServiceBusSettings(
        connection_string=SecretStr(CONNECTION_STRING),
        queue="work",
        receive_wait=0.2,
        reconnect_backoff=0.05,
        reconnect_backoff_max=0.2,
    )
    settings = Settings(
        database_url=postgres_only_url,
        concurrency=16,
        max_deliveries=MAX_DELIVERIES,
        batch_size=batch_size,
        retry_backoff=0.001,
        retry_backoff_max=0.02,
        grace_period=2.0,
    )
    deaths: Counter[str] = Counter()
    dying = asyncio.Event()
    handlers = Registry()

    @handlers.handler("Credit", CreditRequested, consumer="credit", key=lambda m: m.account_id)
    async def credit_or_die(ctx: Context, message: CreditRequested) -> None:
        if ctx.message_id in killers:
            deaths[ctx.message_id] += 1
            dying.set()
            await asyncio.Event().wait()  # the process is gone: nothing after this runs
        await apply_credit(ctx, message)

    messages = [
        OutgoingMessage(f"ok-{n:03d}", "Credit", _body(f"acct-{n % 10}", "1.00"))
        for n in range(VALID)
    ]
    for index, killer in enumerate(killers):
        messages.insert((index + 1) * VALID // (len(killers) + 1), _message(killer))
    admin = ServiceBusAdmin(sb, bus.client)
    await admin.publish(messages)
    await admin.close()

    restarts = 0
    database, url = await proxied(postgres_only_url)
    worker = Process(bus, sb, settings, database, url, handlers)
    deadline = time.monotonic() + 240
    try:
        while True:
            done = await scalar(postgres_only_url, "SELECT count(*) FROM inbox")
            if done == VALID and queue.count == 0:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{done}/{VALID} applied after {restarts} deaths: {dict(deaths)}")
            if dying.is_set():
                dying.clear()
                await worker.die()
                restarts += 1
                database, url = await proxied(postgres_only_url)
                worker = Process(bus, sb, settings, database, url, handlers)
            await asyncio.sleep(0.05)
        await worker.stop()
    finally:
        if not worker.task.done():
            await worker.die()
        await database.close()
    assert queue.dead_letter is not None
    dead = sorted(str(stored.message_id) for stored in queue.dead_letter.messages())
    report = {"deaths": dict(deaths), "restarts": restarts, "dead letters": dead}
    print(f"\nservicebus killer ({batch_size=}, {killers=}): {report}")
    assert dead == sorted(killers), report  # no valid message dead-lettered
    assert await balances(postgres_only_url) == {
        f"acct-{n}": Decimal(VALID // 10) for n in range(10)
    }
    if batch_size == 1 or len(killers) == 1:  # each killer: exactly WORKER_MAX_DELIVERIES
        assert deaths == dict.fromkeys(killers, MAX_DELIVERIES), report
    else:  # a batch is one unit of work: a killer in the batch another killer took down
        # spent that count as its bystander, and goes one death earlier
        assert all(MAX_DELIVERIES - 1 <= deaths[k] <= MAX_DELIVERIES for k in killers), report
    assert restarts <= sum(deaths.values()), report


def _body(account: str, amount: str) -> bytes:
    return json.dumps({"account_id": account, "amount": amount}).encode()


def _message(message_id: str) -> OutgoingMessage:
    return OutgoingMessage(message_id, "Credit", _body("x", "1"))
