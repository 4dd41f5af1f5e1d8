"""What real Kafka producers send is applied once (issue 23, real producers): the official
CloudEvents SDK's Kafka binding in binary and structured mode, sent with confluent-kafka;
plain JSON (a UTF-8 BOM too) sent with aiokafka; an event whose source + id is too long
for the inbox; and structured events no handler can run, dead-lettered with the reason.
docs/producers.md says what each producer sets.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped]
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.v1.event import CloudEvent

from tests.kafka.kafka_helpers import committed_is, header, read_all
from tests.support.credits import credit_registry
from tests.support.database import balances, fetch
from tests.support.pumps import MakeSettings, engine_for, running_pump
from tests.support.waiting import wait_for
from worker.brokers.cloudevents import DIGEST_PREFIX, event_key
from worker.brokers.kafka import KafkaConsumer, KafkaSettings
from worker.pump import Pump

pytestmark = pytest.mark.kafka

BOM = b"\xef\xbb\xbf"


def credit_event(event_id: str, source: str, amount: str, data: Any = None) -> CloudEvent:
    body = {"account_id": "acct-k", "amount": amount}
    return CloudEvent(
        attributes={"id": event_id, "source": source, "type": "CreditRequested"},
        data=body if data is None else data,
    )


def confluent_produce(bootstrap: str, topic: str, messages: list[ce_kafka.KafkaMessage]) -> None:
    """confluent-kafka, as the CloudEvents SDK's docs show it: headers, key and value."""
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    failures: list[Any] = []
    for message in messages:
        producer.produce(
            topic,
            value=message.value,
            key=message.key,
            headers=list(message.headers.items()),
            partition=0,
            on_delivery=lambda error, _: failures.append(error) if error else None,
        )
    assert producer.flush(30) == 0 and failures == [], failures


async def aiokafka_produce(
    bootstrap: str, topic: str, records: list[tuple[bytes, dict[str, bytes]]]
) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for value, headers in records:
            await producer.send_and_wait(topic, value, headers=list(headers.items()), partition=0)
    finally:
        await producer.stop()


async def run_until_committed(
    bootstrap: str, kafka: KafkaSettings, url: str, make_settings: MakeSettings, offset: int
) -> Pump:
    settings = make_settings(database_url=url)
    topic = kafka.topic_list[0]
    async with (
        engine_for(url) as engine,
        running_pump(KafkaConsumer(settings, kafka), engine, credit_registry(), settings) as pump,
    ):
        await wait_for(
            lambda: committed_is(bootstrap, kafka.group_id, topic, offset),
            60,
            f"offset {offset}",
            step=0.3,
        )
    return pump


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    database = tmp_path / "worker.db"
    shutil.copy(sqlite_template, database)
    return f"sqlite+aiosqlite:///{database}"


async def test_sdk_events_in_both_modes_through_confluent_kafka_are_applied_once(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    bootstrap: str,
    sqlite_url: str,
    make_settings: MakeSettings,
) -> None:
    topic = await new_topic(1)
    event = credit_event("e-1", "/shop", "1.25")
    raw = json.dumps({"account_id": "acct-k", "amount": "2.00"}).encode()
    as_bytes = credit_event("e-2", "/shop", "", data=raw)  # the SDK sends it as data_base64
    long_source = "urn:shop:" + "s" * 300
    long = credit_event("e-3", long_source, "4.00")
    messages = [
        ce_kafka.to_binary_event(event),
        ce_kafka.to_structured_event(event),  # the same event again: a duplicate
        ce_kafka.to_structured_event(as_bytes),
        ce_kafka.to_binary_event(long),
        ce_kafka.to_structured_event(long),
    ]
    assert b"data_base64" in messages[2].value
    assert messages[1].headers == {"content-type": b"application/cloudevents+json"}
    await asyncio.to_thread(confluent_produce, bootstrap, topic, messages)

    pump = await run_until_committed(bootstrap, kafka_settings(topic), sqlite_url, make_settings, 5)
    assert (pump.stats["committed"], pump.stats["duplicate"]) == (3, 2), dict(pump.stats)
    assert "dead-letter" not in pump.stats
    assert await balances(sqlite_url) == {"acct-k": Decimal("7.25")}
    keys = {row[0] for row in await fetch(sqlite_url, "SELECT message_id FROM inbox")}
    digest = event_key(long_source, "e-3")
    assert keys == {'["/shop","e-1"]', '["/shop","e-2"]', digest}
    assert digest.startswith(DIGEST_PREFIX) and len(digest) < 255


async def test_plain_json_from_aiokafka_with_and_without_a_bom_is_applied(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    bootstrap: str,
    sqlite_url: str,
    make_settings: MakeSettings,
) -> None:
    topic = await new_topic(1)
    plain = json.dumps({"account_id": "acct-k", "amount": "1.00"}).encode()
    structured = json.dumps(
        {
            "specversion": "1.0",
            "id": "bom-1",
            "source": "/windows",
            "type": "CreditRequested",
            "data": {"account_id": "acct-k", "amount": "0.50"},
        }
    ).encode()
    typed = {"type": b"CreditRequested"}
    await aiokafka_produce(
        bootstrap,
        topic,
        [
            (plain, {**typed, "message-id": b"p-1"}),
            (BOM + plain, {**typed, "message-id": b"p-2"}),
            (BOM + structured, {"content-type": b"application/cloudevents+json"}),
        ],
    )
    pump = await run_until_committed(bootstrap, kafka_settings(topic), sqlite_url, make_settings, 3)
    assert pump.stats["committed"] == 3 and "dead-letter" not in pump.stats, dict(pump.stats)
    assert await balances(sqlite_url) == {"acct-k": Decimal("2.50")}


async def test_structured_events_no_handler_can_run_go_to_the_dead_letter_topic_once(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    bootstrap: str,
    sqlite_url: str,
    make_settings: MakeSettings,
) -> None:
    topic = await new_topic(1)
    structured = {"content-type": b"application/cloudevents+json", "message-id": b"m"}
    await aiokafka_produce(
        bootstrap,
        topic,
        [
            (b'["not", "an", "object"]', structured),
            (b'{"id": "1", "type": "CreditRequested", "data": {}}', structured),  # no source
            (b"{not json", structured),
        ],
    )
    kafka = kafka_settings(topic)
    pump = await run_until_committed(bootstrap, kafka, sqlite_url, make_settings, 3)
    assert pump.stats["dead-letter"] == 3 and "nack" not in pump.stats, dict(pump.stats)
    letters, _ = await read_all(bootstrap, f"{topic}.DLT", 4)  # Tansu: 4 partitions
    letters.sort(key=lambda r: int(header(r, "dlt-original-offset") or -1))
    assert [header(r, "dlt-delivery-count") for r in letters] == ["1", "1", "1"]
    assert [header(r, "dlt-reason") for r in letters] == [
        "structured CloudEvent is a JSON array, not an object",
        "structured CloudEvent: no source",
        "structured CloudEvent is not JSON: Expecting property name enclosed in double quotes:"
        " line 1 column 2 (char 1)",
    ]
