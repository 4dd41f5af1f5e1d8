"""One CloudEvent through RabbitMQ and through Kafka is one inbox marker (issue 14 item 4),
in binary mode and in structured mode (issue 23)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from decimal import Decimal

import confluent_kafka
import pika
import pytest
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.v1.event import CloudEvent

from tests.kafka.kafka_helpers import committed_is, produce
from tests.rabbitmq.rabbit_helpers import declare
from tests.support.credits import credit_registry
from tests.support.database import balances, fetch
from tests.support.pumps import MakeSettings, engine_for, running_pump
from tests.support.waiting import wait_for
from worker.brokers import Broker, OutgoingMessage
from worker.brokers.cloudevents import event_key
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


def pika_publish(rabbit: RabbitMQSettings, message: ce_rabbitmq.RabbitMQMessage) -> None:
    """The CloudEvents SDK's RabbitMQ message, published by pika with a confirm."""
    connection = pika.BlockingConnection(pika.URLParameters(rabbit.url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        properties = pika.BasicProperties(
            content_type=message.content_type, headers=dict(message.headers)
        )
        channel.basic_publish("", rabbit.queue, message.body, properties)
    finally:
        connection.close()


def confluent_produce(bootstrap: str, topic: str, message: ce_kafka.KafkaMessage) -> None:
    """The CloudEvents SDK's Kafka message, produced by confluent-kafka."""
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    producer.produce(topic, message.value, message.key, headers=list(message.headers.items()))
    assert producer.flush(30) == 0


@pytest.mark.parametrize(
    ("amqp_mode", "kafka_mode"), [("structured", "binary"), ("binary", "structured")]
)
async def test_one_event_structured_over_one_broker_and_binary_over_the_other_is_applied_once(
    amqp_mode: str,
    kafka_mode: str,
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    rabbit_settings: Callable[..., RabbitMQSettings],
    bootstrap: str,
    postgres_only_url: str,
    make_settings: MakeSettings,
) -> None:
    """Issue 23: the SDK's structured and binary modes, sent with pika and confluent-kafka,
    to handlers sharing one database: one marker, one credit."""
    url = postgres_only_url
    settings = make_settings(database_url=url)
    source, event_id = "/bridge/orders", f"évé-{amqp_mode}"
    event = CloudEvent(
        attributes={"id": event_id, "source": source, "type": "CreditRequested"},
        data={"account_id": "acct-ce", "amount": "4.20"},
    )
    to_amqp = {"binary": ce_rabbitmq.to_binary_event, "structured": ce_rabbitmq.to_structured_event}
    to_kafka = {"binary": ce_kafka.to_binary_event, "structured": ce_kafka.to_structured_event}

    rabbit = rabbit_settings()
    consumer = RabbitMQConsumer(rabbit, make_identity(rabbit))
    await consumer.start(prefetch=1)  # declares the topology, so the publish has a queue
    await consumer.close()
    await asyncio.to_thread(pika_publish, rabbit, to_amqp[amqp_mode](event))

    async def committed_one(pump: Pump) -> bool:
        return pump.stats["committed"] == 1

    first = await pump_until(
        RabbitMQConsumer(rabbit, make_identity(rabbit)), url, settings, committed_one
    )
    assert first.get("committed") == 1, first

    topic = await new_topic(1)
    await asyncio.to_thread(confluent_produce, bootstrap, topic, to_kafka[kafka_mode](event))
    kafka = kafka_settings(topic)

    async def settled(pump: Pump) -> bool:
        return await committed_is(bootstrap, kafka.group_id, topic, 1)

    second = await pump_until(KafkaConsumer(settings, kafka), url, settings, settled)
    assert second.get("duplicate") == 1 and "committed" not in second, second

    rows = await fetch(url, "SELECT message_id, consumer FROM inbox")
    assert [tuple(row) for row in rows] == [(event_key(source, event_id), "credit")]
    assert await balances(url) == {"acct-ce": Decimal("4.20")}
