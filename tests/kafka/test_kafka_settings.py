"""``WORKER_KAFKA_*`` settings and how a record's dedup key is found (no broker needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from worker.brokers import open_admin, open_broker
from worker.brokers.kafka import (
    KafkaAdmin,
    KafkaConsumer,
    KafkaSettings,
    header_message_id,
    load_kafka_settings,
)
from worker.brokers.rabbitmq import default_message_id as rabbitmq_message_id
from worker.errors import ConfigurationError
from worker.settings import Settings


@dataclass
class FakeRecord:
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    topic: str = "orders"
    partition: int = 3
    offset: int = 42


def record_id(*headers: tuple[str, bytes]) -> str | None:
    return header_message_id("message-id")(FakeRecord(list(headers)))


def test_the_producer_header_is_the_dedup_key() -> None:
    assert record_id(("message-id", b"order-7"), ("other", b"x")) == "order-7"
    assert record_id(("message-id", b"order-7"), ("ce_id", b"x")) == "order-7"  # half a pair


def test_a_cloudevent_is_keyed_by_source_and_id_first() -> None:
    assert record_id(("ce_id", b"e-1"), ("ce_source", b"/billing")) == '["/billing","e-1"]'
    both = record_id(("message-id", b"order-7"), ("ce_id", b"e-1"), ("ce_source", b"/billing"))
    assert both == '["/billing","e-1"]'


@pytest.mark.parametrize(
    ("source", "event_id"),
    [("/billing", "42"), ("urn:x y", 'a"b'), ("/caf\u00e9", "\u00fc\\n"), ("a b", "c")],
)
def test_one_cloudevents_key_across_brokers(source: str, event_id: str) -> None:
    """Issue 14 item 4: the same event through RabbitMQ and Kafka gets the same key."""
    source, event_id = (s.encode().decode("unicode_escape") for s in (source, event_id))
    amqp = SimpleNamespace(
        message_id="random-by-aiormq",
        headers={"ce-id": event_id, "ce-source": source},
        content_type="application/json",  # binary mode: the data's type
        body=b"{}",
    )
    kafka = record_id(
        ("message-id", b"random"), ("ce_id", event_id.encode()), ("ce_source", source.encode())
    )
    assert kafka == rabbitmq_message_id(cast(Any, amqp))
    assert json.loads(kafka or "") == [source, event_id]


def test_the_offset_is_the_last_resort() -> None:
    assert record_id(("other", b"x")) == "orders/3/42"


@pytest.mark.parametrize(
    "headers",
    [
        [("message-id", b"")],
        [("message-id", b"\xff\xfe")],
        [("ce_id", b"e-1")],
        [("ce_source", b"/billing")],
    ],
    ids=["empty-header", "not-utf8", "ce-id-alone", "ce-source-alone"],
)
def test_an_unusable_id_is_none_not_a_fallback(headers: list[tuple[str, bytes]]) -> None:
    assert record_id(*headers) is None


def test_the_header_name_is_a_setting() -> None:
    identity = header_message_id("x-id")
    assert identity(FakeRecord([("message-id", b"a"), ("x-id", b"b")])) == "b"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("TOPICS", "SECURITY_PROTOCOL", "SASL_USERNAME", "SASL_PASSWORD"):
        monkeypatch.delenv(f"WORKER_KAFKA_{name}", raising=False)
    monkeypatch.setenv("WORKER_KAFKA_TOPICS", "orders, payments")
    return monkeypatch


def test_settings_from_the_environment(env: pytest.MonkeyPatch) -> None:
    env.setenv("WORKER_KAFKA_TOPIC_TYPES", '{"orders": "OrderPlaced"}')
    env.setenv("WORKER_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    env.setenv("WORKER_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    env.setenv("WORKER_KAFKA_SASL_USERNAME", "svc")
    env.setenv("WORKER_KAFKA_SASL_PASSWORD", "s3cret")
    env.setenv("WORKER_KAFKA_MAX_REQUEST_SIZE", "4194304")
    kafka = load_kafka_settings()
    assert kafka.max_request_size == 4 * 1024 * 1024
    assert kafka.topic_list == ["orders", "payments"]
    assert kafka.topic_types == {"orders": "OrderPlaced"}
    assert kafka.dead_letter_topic("orders") == "orders.DLT"
    options = kafka.client_options()
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert options["sasl_plain_password"] == "s3cret"
    assert "s3cret" not in repr(kafka)
    settings = Settings(broker="kafka")
    assert isinstance(open_broker(settings), KafkaConsumer)  # builds without connecting
    assert isinstance(open_admin(settings), KafkaAdmin)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"WORKER_KAFKA_TOPICS": " , "}, "WORKER_KAFKA_TOPICS: name at least one topic"),
        ({"WORKER_KAFKA_TOPICS": "a,a.DLT"}, "a dead-letter topic cannot be consumed"),
        ({"WORKER_KAFKA_COMMIT_INTERVAL": "0"}, "WORKER_KAFKA_COMMIT_INTERVAL='0'"),
        ({"WORKER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "WORKER_KAFKA_SASL_USERNAME and"),
        ({"WORKER_KAFKA_HEARTBEAT_INTERVAL_MS": "20000"}, "at most a third"),
        ({"WORKER_KAFKA_ORDERING": "keys"}, "WORKER_KAFKA_ORDERING='keys'"),
        ({"WORKER_KAFKA_MAX_REQUEST_SIZE": "10"}, "WORKER_KAFKA_MAX_REQUEST_SIZE='10'"),
        ({"WORKER_KAFKA_SSL_CERTFILE": "/c.pem"}, "CERTFILE and WORKER_KAFKA_SSL_KEYFILE"),
        (
            {"WORKER_KAFKA_SECURITY_PROTOCOL": "SSL", "WORKER_KAFKA_SSL_CAFILE": "/nope/ca.pem"},
            "WORKER_KAFKA_SSL_*",
        ),
    ],
)
def test_bad_settings_are_one_line(
    env: pytest.MonkeyPatch, variables: dict[str, str], message: str
) -> None:
    for name, value in variables.items():
        env.setenv(name, value)
    with pytest.raises(ConfigurationError) as caught:
        load_kafka_settings()
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_bad_value_never_shows_the_password(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("WORKER_KAFKA_SASL_PASSWORD", "hunter2")
    env.setenv("WORKER_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXTT")
    with pytest.raises(ConfigurationError) as caught:
        load_kafka_settings()
    assert "WORKER_KAFKA_SECURITY_PROTOCOL" in str(caught.value)
    assert "hunter2" not in str(caught.value)


def test_defaults_are_production_values() -> None:
    kafka = KafkaSettings(topics="t")
    assert kafka.session_timeout_ms == 45_000 and kafka.idempotent_producer
    assert kafka.ordering == "partition" and kafka.max_request_size == 1024 * 1024
    assert kafka.max_buffered_bytes == 8 * 1024 * 1024 and kafka.watchdog_margin == 30.0
    assert kafka.message_id_header == "message-id" and kafka.dead_letter_suffix == ".DLT"
