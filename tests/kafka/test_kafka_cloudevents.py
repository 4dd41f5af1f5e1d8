"""One CloudEvent through RabbitMQ and through Kafka is one inbox marker (issue 14 item 4)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any

import pytest

from handlers.credit import CreditRequested, apply_credit
from tests.kafka.kafka_helpers import committed_is, produce
from tests.support.database import balances, fetch
from tests.support.waiting import wait_for
from worker.brokers import Broker, OutgoingMessage
from worker.brokers.kafka import KafkaBroker, KafkaSettings
from worker.brokers.rabbitmq import RabbitMQAdmin, RabbitMQBroker, RabbitMQSettings, make_identity
from worker.db import create_engine
from worker.pump import Pump
from worker.registry import Context, Registry

pytestmark = [pytest.mark.kafka, pytest.mark.rabbitmq, pytest.mark.postgres]


def registry() -> Registry:
    reg = Registry()

    @reg.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        await apply_credit(ctx, message)

    return reg


async def pump_until(
    broker: Broker, url: str, settings: Any, done: Callable[[Pump], Awaitable[bool]]
) -> dict[str, int]:
    engine = create_engine(url)
    pump = Pump(broker, engine, registry(), settings)
    running = asyncio.create_task(pump.run())
    try:
        await wait_for(lambda: done(pump), 30, "the pump's settlement", step=0.2)
    finally:
        pump.stop()
        await asyncio.wait_for(running, 30)
        await engine.dispose()
    return dict(pump.stats)


async def test_a_cloudevent_bridged_through_both_brokers_is_applied_once(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    rabbit_settings: Callable[..., RabbitMQSettings],
    bootstrap: str,
    postgres_only_url: str,
    make_settings: Callable[..., Any],
) -> None:
    url = postgres_only_url
    body = json.dumps({"account_id": "acct-ce", "amount": "4.20"}).encode()
    source, event_id = "/bridge/orders", "évé-1"  # not ASCII: both adapters escape it alike
    settings = make_settings(database_url=url)

    # through RabbitMQ: aio-pika stamps a random message_id, the CloudEvents pair wins
    rabbit = rabbit_settings()
    admin = RabbitMQAdmin(rabbit, make_identity(rabbit))
    try:
        headers = {"ce-id": event_id, "ce-source": source, "ce-type": "CreditRequested"}
        await admin.publish([OutgoingMessage(None, "CreditRequested", body, headers)])
    finally:
        await admin.close()

    async def committed_one(pump: Pump) -> bool:
        return pump.stats["committed"] == 1

    first = await pump_until(
        RabbitMQBroker(rabbit, make_identity(rabbit)), url, settings, committed_one
    )
    assert first.get("committed") == 1, first

    # the same event through Kafka, with a message-id header of the bridge's own
    topic = await new_topic(1)
    ce = {"ce_id": event_id, "ce_source": source, "ce_type": "CreditRequested"}
    await produce(bootstrap, topic, [(None, body, {**ce, "message-id": "bridge-42"}, 0)])
    kafka = kafka_settings(topic)

    async def settled(pump: Pump) -> bool:
        return await committed_is(bootstrap, kafka.group_id, topic, 1)

    second = await pump_until(KafkaBroker(settings, kafka), url, settings, settled)
    assert second.get("duplicate") == 1 and "committed" not in second, second

    rows = await fetch(url, "SELECT message_id, consumer FROM inbox")
    assert [tuple(row) for row in rows] == [
        (json.dumps([source, event_id], separators=(",", ":")), "credit")
    ]
    assert await balances(url) == {"acct-ce": Decimal("4.20")}
