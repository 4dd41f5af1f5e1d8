"""One CloudEvent through RabbitMQ and through Kafka is one inbox marker (issue 14 item 4)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from decimal import Decimal

import pytest

from tests.kafka.kafka_helpers import committed_is, produce
from tests.rabbitmq.rabbit_helpers import declare
from tests.support.credits import credit_registry
from tests.support.database import balances, fetch
from tests.support.pumps import MakeSettings, engine_for, running_pump
from tests.support.waiting import wait_for
from worker.brokers import Broker, OutgoingMessage
from worker.brokers.kafka import KafkaConsumer, KafkaSettings
from worker.brokers.rabbitmq import RabbitMQAdmin, RabbitMQConsumer, RabbitMQSettings, make_identity
from worker.pump import Pump
from worker.settings import Settings

pytestmark = [pytest.mark.kafka, pytest.mark.rabbitmq, pytest.mark.postgres]


async def pump_until(
    broker: Broker, url: str, settings: Settings, done: Callable[[Pump], Awaitable[bool]]
) -> dict[str, int]:
    async with (
        engine_for(url) as engine,
        running_pump(broker, engine, credit_registry(), settings) as pump,
    ):
        await wait_for(lambda: done(pump), 30, "the pump's settlement", step=0.2)
    return dict(pump.stats)


async def test_a_cloudevent_bridged_through_both_brokers_is_applied_once(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    rabbit_settings: Callable[..., RabbitMQSettings],
    bootstrap: str,
    postgres_only_url: str,
    make_settings: MakeSettings,
) -> None:
    url = postgres_only_url
    body = json.dumps({"account_id": "acct-ce", "amount": "4.20"}).encode()
    source, event_id = "/bridge/orders", "évé-1"  # not ASCII: both adapters escape it alike
    settings = make_settings(database_url=url)

    # through RabbitMQ: aio-pika stamps a random message_id, the CloudEvents pair wins
    rabbit = rabbit_settings()
    await declare(rabbit)  # as a worker's start would
    admin = RabbitMQAdmin(rabbit, make_identity(rabbit))
    try:
        headers = {"ce-id": event_id, "ce-source": source, "ce-type": "CreditRequested"}
        await admin.publish([OutgoingMessage(None, "CreditRequested", body, headers)])
    finally:
        await admin.close()

    async def committed_one(pump: Pump) -> bool:
        return pump.stats["committed"] == 1

    first = await pump_until(
        RabbitMQConsumer(rabbit, make_identity(rabbit)), url, settings, committed_one
    )
    assert first.get("committed") == 1, first

    # the same event through Kafka, with a message-id header of the bridge's own
    topic = await new_topic(1)
    ce = {"ce_id": event_id, "ce_source": source, "ce_type": "CreditRequested"}
    await produce(bootstrap, topic, [(None, body, {**ce, "message-id": "bridge-42"}, 0)])
    kafka = kafka_settings(topic)

    async def settled(pump: Pump) -> bool:
        return await committed_is(bootstrap, kafka.group_id, topic, 1)

    second = await pump_until(KafkaConsumer(settings, kafka), url, settings, settled)
    assert second.get("duplicate") == 1 and "committed" not in second, second

    rows = await fetch(url, "SELECT message_id, consumer FROM inbox")
    assert [tuple(row) for row in rows] == [
        (json.dumps([source, event_id], separators=(",", ":")), "credit")
    ]
    assert await balances(url) == {"acct-ce": Decimal("4.20")}
