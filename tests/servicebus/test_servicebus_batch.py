"""Batch mode on Service Bus (the fake): each message's own lock renewer keeps renewing
while it waits in a batch and while the batch runs, so a batch longer than the lock
duration still completes every message, once."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from azure.servicebus import ServiceBusMessage

from handlers.credit import CreditRequested
from tests.servicebus.fake import FakeServiceBus
from tests.servicebus.sb_settings import sb_settings
from tests.support.pumps import engine_for, running_pump
from tests.support.waiting import wait_for
from worker.brokers.servicebus import ServiceBusConsumer
from worker.registry import BatchContext, Registry
from worker.settings import Settings


async def test_a_batch_longer_than_the_lock_completes_every_message(
    bus: FakeServiceBus, sqlite_template: Path, tmp_path: Path
) -> None:
    queue = bus.create_queue("work", lock_duration=4.0)
    sender = bus.client().get_queue_sender("work")
    body = json.dumps({"account_id": "a", "amount": "1"}).encode()

    def message(message_id: str) -> ServiceBusMessage:
        properties: dict[str | bytes, Any] = {"type": "CreditRequested"}
        return ServiceBusMessage(body, message_id=message_id, application_properties=properties)

    sizes: list[int] = []
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit", batch=True)
    async def slow(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
        if ctx.message_ids == ["warm"]:  # a type's first unit runs alone, and quickly here,
            return  # so the next ones share a group (worker/intake.py)
        sizes.append(len(messages))
        await asyncio.sleep(5.0)  # past the 4 s lock: only renewal keeps the locks

    path = tmp_path / "worker.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite+aiosqlite:///{path}"
    settings = Settings(database_url=url, concurrency=1, batch_size=4)
    consumer = ServiceBusConsumer(sb_settings(), bus.client)
    stats = queue.stats
    async with (
        engine_for(url) as engine,
        running_pump(consumer, engine, registry, settings, name="sb-batch") as pump,
    ):
        await sender.send_messages([message("warm")])
        await wait_for(lambda: stats["complete"] >= 1, 15, "the first complete")
        await sender.send_messages([message(f"m-{n}") for n in range(4)])
        await wait_for(lambda: stats["complete"] >= 5, 15, "four completes")
    assert sizes == [4]  # one batch, never redelivered
    assert stats["renewed"] >= 4 and stats["lock_expired"] == 0
    assert stats["complete"] == 5 and pump.stats["committed"] == 5
