"""What real AMQP producers send is applied once (issue 23, real producers): the official
CloudEvents SDK's RabbitMQ binding in binary and structured mode, sent with pika; a
structured event retried through aio-pika (a new random ``message_id`` per publish);
kombu's JSON serializer; plain JSON with a UTF-8 BOM; an event whose source + id is too
long for the inbox; and structured events no handler can run, dead-lettered with the
reason. docs/producers.md says what each producer sets.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import aio_pika
import pika
import pytest
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.v1.event import CloudEvent
from kombu.connection import Connection
from kombu.utils.json import register_type

from tests.rabbitmq.rabbit_helpers import (
    credit_registry,
    dead_letter_reason,
    publish_raw,
    running,
    take_dead_letters,
)
from tests.support.database import balances, fetch
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.waiting import wait_for
from worker.brokers.cloudevents import DIGEST_PREFIX, STRUCTURED, event_key
from worker.brokers.rabbitmq import RabbitMQSettings
from worker.pump import Pump

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]

BOM = b"\xef\xbb\xbf"


def credit_event(event_id: str, source: str, amount: str, **attributes: Any) -> CloudEvent:
    return CloudEvent(
        attributes={"id": event_id, "source": source, "type": "CreditRequested", **attributes},
        data={"account_id": "acct-r", "amount": amount},
    )


def pika_publish(
    rabbit: RabbitMQSettings, messages: list[tuple[bytes, pika.BasicProperties]]
) -> None:
    """pika, blocking, with publisher confirms, to the work queue."""
    connection = pika.BlockingConnection(pika.URLParameters(rabbit.url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for body, properties in messages:
            channel.basic_publish("", rabbit.queue, body, properties)
    finally:
        connection.close()


def sdk_message(message: ce_rabbitmq.RabbitMQMessage) -> tuple[bytes, pika.BasicProperties]:
    """The SDK's RabbitMQ message as pika sends it: content_type, headers, body."""
    properties = pika.BasicProperties(
        content_type=message.content_type, headers=dict(message.headers), delivery_mode=2
    )
    return message.body, properties


async def settled(pump: Pump, count: int) -> None:
    def done() -> bool:
        return sum(pump.stats[verb] for verb in ("ack", "dead-letter")) >= count

    await wait_for(done, 30, f"{count} settlements")


async def test_sdk_events_in_both_modes_through_pika_are_applied_once(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings()
    registry, seen = credit_registry()
    event = credit_event("e-1", "/shop", "1.25", subject="acct-r")
    other = credit_event("e-2", "/shop", "2.00")
    messages = [
        ce_rabbitmq.to_binary_event(event),
        ce_rabbitmq.to_structured_event(event),  # the same event again: a duplicate
        ce_rabbitmq.to_structured_event(other),
    ]
    assert messages[1].content_type == STRUCTURED and messages[1].headers == {}
    async with running(rabbit, pg, registry) as pump:
        await asyncio.to_thread(pika_publish, rabbit, [sdk_message(m) for m in messages])
        await settled(pump, 3)
    assert (pump.stats["committed"], pump.stats["duplicate"]) == (2, 1), dict(pump.stats)
    assert len(seen) == 2
    assert await balances(pg) == {"acct-r": Decimal("3.25")}
    keys = {row[0] for row in await fetch(pg, "SELECT message_id FROM inbox")}
    assert keys == {'["/shop","e-1"]', '["/shop","e-2"]'}


async def test_a_structured_retry_through_aio_pika_is_a_duplicate(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    """aiormq gives each publish a new random message_id; the event's own id still wins,
    data_base64 included."""
    rabbit = rabbit_settings()
    registry, _ = credit_registry()
    raw = json.dumps({"account_id": "acct-r", "amount": "0.75"}).encode()
    as_bytes = CloudEvent(
        attributes={"id": "b-1", "source": "/bytes", "type": "CreditRequested"}, data=raw
    )
    body = ce_rabbitmq.to_structured_event(as_bytes).body
    assert b"data_base64" in body
    async with running(rabbit, pg, registry) as pump:
        for _ in range(2):
            await publish_raw(rabbit, aio_pika.Message(body, content_type=STRUCTURED))
        await settled(pump, 2)
    assert (pump.stats["committed"], pump.stats["duplicate"]) == (1, 1), dict(pump.stats)
    assert await balances(pg) == {"acct-r": Decimal("0.75")}


async def test_a_cloudevents_identity_too_long_for_the_inbox_is_keyed_by_its_digest(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    """Before: dead-lettered although the message carried a short AMQP message_id."""
    rabbit = rabbit_settings()
    registry, _ = credit_registry()
    source = "urn:shop:" + "s" * 300
    event = credit_event("e-long", source, "5.00")
    binary = ce_rabbitmq.to_binary_event(event)
    async with running(rabbit, pg, registry) as pump:
        await publish_raw(
            rabbit,
            aio_pika.Message(binary.body, headers=dict(binary.headers), message_id="short-1"),
        )
        await asyncio.to_thread(
            pika_publish, rabbit, [sdk_message(ce_rabbitmq.to_structured_event(event))]
        )
        await settled(pump, 2)
    assert (pump.stats["committed"], pump.stats["duplicate"]) == (1, 1), dict(pump.stats)
    [(key,)] = await fetch(pg, "SELECT message_id FROM inbox")
    assert key == event_key(source, "e-long") and key.startswith(DIGEST_PREFIX)


@pytest.fixture
def kombu_decimal_as_string() -> Iterator[None]:
    """What docs/producers.md tells kombu users: a Decimal as a plain JSON string."""
    register_type(Decimal, None, str)
    try:
        yield
    finally:
        register_type(Decimal, "decimal", str, Decimal)  # kombu's own default again


def kombu_publish(rabbit: RabbitMQSettings, bodies: list[tuple[str, Any]]) -> None:
    with Connection(rabbit.url) as connection:  # type: ignore[no-untyped-call]
        producer = connection.Producer(serializer="json")
        for message_id, body in bodies:
            producer.publish(
                body, routing_key=rabbit.queue, message_id=message_id, type="CreditRequested"
            )


async def test_kombus_json_serializer(rabbit_settings: MakeRabbitSettings, pg: str) -> None:
    """kombu wraps a Decimal as {"__type__": "decimal", ...}: dead-lettered with a reason
    naming the field. A string amount, or a Decimal registered as a plain string, is applied."""
    rabbit = rabbit_settings()
    registry, _ = credit_registry()
    async with running(rabbit, pg, registry) as pump:
        await asyncio.to_thread(
            kombu_publish,
            rabbit,
            [
                ("k-1", {"account_id": "acct-r", "amount": Decimal("1.10")}),
                ("k-2", {"account_id": "acct-r", "amount": "2.20"}),
            ],
        )
        await settled(pump, 2)
    assert (pump.stats["committed"], pump.stats["dead-letter"]) == (1, 1), dict(pump.stats)
    [letter] = await take_dead_letters(rabbit)
    assert letter.message_id == "k-1" and b'"__type__": "decimal"' in letter.body
    assert dead_letter_reason(letter).startswith("invalid body for CreditRequested: amount:")
    assert await balances(pg) == {"acct-r": Decimal("2.20")}


async def test_kombu_with_decimal_registered_as_a_string(
    rabbit_settings: MakeRabbitSettings, pg: str, kombu_decimal_as_string: None
) -> None:
    rabbit = rabbit_settings()
    registry, _ = credit_registry()
    async with running(rabbit, pg, registry) as pump:
        body = {"account_id": "acct-r", "amount": Decimal("3.30")}
        await asyncio.to_thread(kombu_publish, rabbit, [("k-3", body)])
        await settled(pump, 1)
    assert pump.stats["committed"] == 1, dict(pump.stats)
    assert await balances(pg) == {"acct-r": Decimal("3.30")}


async def test_json_with_a_bom_from_pika_is_applied(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings()
    registry, _ = credit_registry()
    plain = json.dumps({"account_id": "acct-r", "amount": "1.00"}).encode()
    structured = ce_rabbitmq.to_structured_event(credit_event("bom-1", "/windows", "0.50"))
    messages = [
        (BOM + plain, pika.BasicProperties(message_id="p-1", type="CreditRequested")),
        (BOM + structured.body, pika.BasicProperties(content_type=STRUCTURED)),
    ]
    async with running(rabbit, pg, registry) as pump:
        await asyncio.to_thread(pika_publish, rabbit, messages)
        await settled(pump, 2)
    assert pump.stats["committed"] == 2 and "dead-letter" not in pump.stats, dict(pump.stats)
    assert await balances(pg) == {"acct-r": Decimal("1.50")}


async def test_structured_events_no_handler_can_run_are_dead_lettered_once(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings()
    registry, seen = credit_registry()
    bodies = {
        "array": (b'["not", "an", "object"]', STRUCTURED),
        "no-source": (b'{"id": "1", "type": "CreditRequested", "data": {}}', STRUCTURED),
        "not-json": (b"{not json", STRUCTURED),
        "batch": (b"[]", "application/cloudevents-batch+json"),
    }
    messages = [
        (body, pika.BasicProperties(content_type=kind, message_id=name))
        for name, (body, kind) in bodies.items()
    ]
    async with running(rabbit, pg, registry) as pump:
        await asyncio.to_thread(pika_publish, rabbit, messages)
        await settled(pump, 4)
        await asyncio.sleep(0.5)  # nothing comes back
    assert pump.stats["dead-letter"] == 4 and "nack" not in pump.stats, dict(pump.stats)
    assert seen == []
    reasons = {
        letter.message_id: dead_letter_reason(letter) for letter in await take_dead_letters(rabbit)
    }
    assert reasons == {
        "array": "structured CloudEvent is a JSON array, not an object",
        "no-source": "structured CloudEvent: no source",
        "not-json": "structured CloudEvent is not JSON: Expecting property name enclosed in"
        " double quotes: line 1 column 2 (char 1)",
        "batch": "unsupported CloudEvents content type 'application/cloudevents-batch+json'"
        " (the worker reads application/cloudevents+json)",
    }
