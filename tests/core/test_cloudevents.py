"""CloudEvents in structured mode: the event read from its body, with the key of binary
mode on every adapter, and the memory broker running it (issue 23, real producers).

The bodies and headers are what the official CloudEvents SDK (``cloudevents``) writes
with its RabbitMQ and Kafka bindings; the brokers themselves are in
tests/rabbitmq/test_rabbitmq_producers.py and tests/kafka/test_kafka_producers.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.v1.event import CloudEvent
from sqlalchemy import select

from handlers.credit import Account, CreditRequested
from tests.support.credits import credit_registry
from tests.support.pumps import MakeSettings, running_pump
from worker.brokers.cloudevents import DIGEST_PREFIX, STRUCTURED, event_key, structured
from worker.brokers.kafka import header_message_id
from worker.brokers.memory import MemoryBroker
from worker.brokers.rabbitmq import default_message_id, message_type
from worker.db import create_engine
from worker.inbox import MESSAGE_ID_LENGTH, InboxMarker

CREDIT = {"account_id": "acct-ce", "amount": "12.50"}


def credit_event(event_id: str = "e-1", source: str = "/shop", **attributes: Any) -> CloudEvent:
    return CloudEvent(
        attributes={
            "id": event_id,
            "source": source,
            "type": "CreditRequested",
            "datacontenttype": "application/json",
            **attributes,
        },
        data=dict(CREDIT),
    )


@dataclass
class Amqp:
    """The attributes of an aio-pika IncomingMessage the adapter reads."""

    body: bytes
    content_type: str | None = None
    headers: dict[str, Any] = field(default_factory=dict)
    message_id: str | None = None
    type: str | None = None


@dataclass
class Record:
    """The attributes of an aiokafka ConsumerRecord the adapter reads."""

    value: bytes
    headers: list[tuple[str, bytes]]
    topic: str = "orders"
    partition: int = 0
    offset: int = 7


def amqp(message: ce_rabbitmq.RabbitMQMessage, **extra: Any) -> Any:
    return Amqp(message.body, message.content_type, dict(message.headers), **extra)


def record(message: ce_kafka.KafkaMessage) -> Any:
    return Record(message.value, list(message.headers.items()))


def test_a_structured_event_gives_its_type_and_its_data() -> None:
    message = ce_rabbitmq.to_structured_event(credit_event())
    assert message.content_type == STRUCTURED and message.headers == {}
    event = structured(message.content_type, message.body)
    assert event is not None and event.problem is None
    assert (event.key, event.type) == ('["/shop","e-1"]', "CreditRequested")
    assert CreditRequested.model_validate_json(event.data) == CreditRequested(**CREDIT)
    assert event.attributes["specversion"] == "1.0"


@pytest.mark.parametrize(
    ("source", "event_id"), [("/shop", "e-1"), ("urn:x y", 'a"b'), ("/caf\u00e9", "\u00fc\\n")]
)
def test_both_modes_on_both_brokers_give_one_key(source: str, event_id: str) -> None:
    """The SDK's binary and structured messages, through RabbitMQ's and Kafka's default
    dedup key: one string, so the inbox applies the event once whichever way it came."""
    event = credit_event(event_id, source)
    aiormq_ids = {"message_id": "random-by-aiormq"}  # aio-pika stamps one per publish
    keys = {
        "amqp binary": default_message_id(amqp(ce_rabbitmq.to_binary_event(event), **aiormq_ids)),
        "amqp structured": default_message_id(
            amqp(ce_rabbitmq.to_structured_event(event), **aiormq_ids)
        ),
        "kafka binary": header_message_id("message-id")(record(ce_kafka.to_binary_event(event))),
        "kafka structured": header_message_id("message-id")(
            record(ce_kafka.to_structured_event(event))
        ),
    }
    assert set(keys.values()) == {event_key(source, event_id)}, keys
    assert json.loads(event_key(source, event_id)) == [source, event_id]


def test_the_type_of_a_structured_amqp_message_is_the_events() -> None:
    message = amqp(ce_rabbitmq.to_structured_event(credit_event()), type="Other")
    assert message_type(message) == "CreditRequested"


def test_data_base64_is_the_body() -> None:
    raw = json.dumps(CREDIT).encode()
    event = CloudEvent(
        attributes={"id": "b-1", "source": "/bytes", "type": "CreditRequested"}, data=raw
    )
    message = ce_kafka.to_structured_event(event)
    assert b"data_base64" in message.value
    read = structured(STRUCTURED, message.value)
    assert read is not None and read.problem is None and read.data == raw


def test_numbers_keep_the_text_the_producer_wrote() -> None:
    """The data handed on is the JSON text the producer wrote, not a float's rounding of it.

    (pydantic itself still reads a JSON number through a float: a producer sends money as
    a string, docs/producers.md.)"""
    data = b'{"account_id": "a", "amount": 12345678901234567890.123456789}'
    body = b'{"id": "n-1", "source": "/n", "type": "CreditRequested", "data": ' + data + b"}"
    event = structured(STRUCTURED, body)
    assert event is not None and event.problem is None
    assert event.data == data.replace(b", ", b",").replace(b": ", b":")
    other = structured(STRUCTURED, b'{"id": "1", "source": "/", "type": "T", "data": [1E+2, 0.10]}')
    assert other is not None and other.data == b"[1E+2,0.10]"


def test_text_data_of_another_content_type_is_the_body_as_is() -> None:
    body = json.dumps(
        {
            "id": "x-1",
            "source": "/x",
            "type": "Xml",
            "datacontenttype": "application/xml",
            "data": "<credit/>",
        }
    ).encode()
    event = structured(STRUCTURED, body)
    assert event is not None and event.data == b"<credit/>"


@pytest.mark.parametrize(
    "content_type",
    [STRUCTURED, "application/cloudevents+json; charset=utf-8", "Application/CloudEvents+JSON"],
)
def test_the_content_type_is_read_as_a_media_type(content_type: str) -> None:
    body = ce_rabbitmq.to_structured_event(credit_event()).body
    event = structured(content_type, body)
    assert event is not None and event.key == '["/shop","e-1"]'


def test_a_structured_body_may_start_with_a_bom() -> None:
    body = b"\xef\xbb\xbf" + ce_rabbitmq.to_structured_event(credit_event()).body
    event = structured(STRUCTURED, body)
    assert event is not None and event.problem is None and event.key == '["/shop","e-1"]'


def test_other_content_types_are_binary_mode() -> None:
    assert structured("application/json", b"{}") is None
    assert structured(None, b"{}") is None


def test_an_identity_too_long_for_the_inbox_becomes_its_digest() -> None:
    source = "urn:" + "s" * 300
    key = event_key(source, "e-1")
    assert key.startswith(DIGEST_PREFIX) and len(key) == len(DIGEST_PREFIX) + 64
    assert key == event_key(source, "e-1")  # stable: every copy of the event has it
    assert key != event_key(source, "e-2")
    fits = "x" * (MESSAGE_ID_LENGTH - len('["",""]') - 1)
    assert event_key(fits, "e") == json.dumps([fits, "e"], separators=(",", ":"))
    assert len(event_key(fits, "e")) == MESSAGE_ID_LENGTH
    assert event_key(fits + "x", "e").startswith(DIGEST_PREFIX)


UNREADABLE = [
    (STRUCTURED, b"not json", "structured CloudEvent is not JSON"),
    (STRUCTURED, b"\xef\xbb\xbf[1, 2]", "structured CloudEvent is a JSON array, not an object"),
    (STRUCTURED, b"null", "structured CloudEvent is a JSON null, not an object"),
    (STRUCTURED, b'{"x": NaN}', "structured CloudEvent is not JSON: NaN is not JSON"),
    (STRUCTURED, b'{"source": "/s", "type": "T"}', "structured CloudEvent: no id"),
    (STRUCTURED, b'{"id": 42, "type": "T"}', "id is not a non-empty string, no source"),
    (STRUCTURED, b'{"id": "1", "source": "/s"}', "structured CloudEvent: no type"),
    (
        STRUCTURED,
        b'{"id": "1", "source": "/s", "type": "T", "data": {}, "data_base64": "e30="}',
        "structured CloudEvent: both data and data_base64",
    ),
    (
        STRUCTURED,
        b'{"id": "1", "source": "/s", "type": "T", "data_base64": "not base64!"}',
        "structured CloudEvent: data_base64 is not base64",
    ),
    (
        STRUCTURED,
        b'{"id": "1", "source": "/s", "type": "T", "datacontenttype": "text/plain",'
        b' "data": "\\ud800"}',
        "structured CloudEvent: data is not UTF-8 text",
    ),
    (
        "application/cloudevents-batch+json",
        b"[]",
        "unsupported CloudEvents content type 'application/cloudevents-batch+json'",
    ),
]


@pytest.mark.parametrize(("content_type", "body", "reason"), UNREADABLE)
def test_an_unreadable_event_says_why(content_type: str, body: bytes, reason: str) -> None:
    event = structured(content_type, body)
    assert event is not None and event.problem is not None
    assert reason in event.problem, event.problem


def test_attributes_join_the_headers_as_in_binary_mode() -> None:
    message = ce_rabbitmq.to_structured_event(credit_event(subject="acct-ce"))
    read = structured(message.content_type, message.body)
    assert read is not None and read.attributes["subject"] == "acct-ce"


# -- the memory broker ------------------------------------------------------------------


def structured_body(event_id: str = "e-1", source: str = "/shop") -> bytes:
    return ce_rabbitmq.to_structured_event(credit_event(event_id, source)).body


async def test_the_memory_broker_runs_structured_events_once(
    database_url: str, make_settings: MakeSettings
) -> None:
    broker = MemoryBroker()
    headers = {"content-type": STRUCTURED}
    broker.publish(None, None, structured_body(), headers, copies=2)  # a producer retry
    broker.publish(None, None, b'{"id": "e-2", "type": "CreditRequested"}', headers)  # no source
    broker.publish(None, None, b"[1]", headers)
    long_source = "urn:" + "s" * 300
    broker.publish(None, None, structured_body("e-3", long_source), headers)
    engine = create_engine(database_url)
    try:
        async with running_pump(broker.connect(), engine, credit_registry(), make_settings()):
            await broker.wait_idle(timeout=30)
        async with engine.connect() as connection:
            markers = set((await connection.execute(select(InboxMarker.message_id))).scalars())
            balance = (await connection.execute(select(Account.balance))).scalar_one()
    finally:
        await engine.dispose()
    assert markers == {'["/shop","e-1"]', event_key(long_source, "e-3")}
    assert Decimal(balance) == Decimal("25.00")
    reasons = sorted(letter.reason for letter in broker.dead_letters)
    assert reasons == [
        "structured CloudEvent is a JSON array, not an object",
        "structured CloudEvent: no source",
    ]
    # dead-lettered at once: one delivery each, never a nack
    assert broker.stats["nacked"] == 0 and broker.stats["redelivered"] == 0
