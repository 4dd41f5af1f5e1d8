"""What a failed start says: BrokerUnavailable (the start-up retry tries again) or
ConfigurationError (it stops at once), always with a reason. The unreachable broker and
the refused idempotent producer are in test_kafka_offsets.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, UnknownError  # type: ignore[import-untyped]

from tests.kafka.kafka_helpers import authenticating_tansu, transport_settings
from worker.brokers.kafka import KafkaConsumer, KafkaSettings, start_producer
from worker.brokers.kafka.settings import describe
from worker.errors import BrokerUnavailable, ConfigurationError

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def guarded() -> Iterator[str]:
    with authenticating_tansu() as bootstrap:
        yield bootstrap


def login(
    kafka_settings: Callable[..., KafkaSettings], bootstrap: str, mechanism: str
) -> KafkaSettings:
    return kafka_settings(
        "t",
        bootstrap_servers=bootstrap,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=mechanism,
        sasl_username="worker",
        sasl_password="not-the-password",
    )


async def test_a_refused_login_is_a_configuration_error_naming_the_settings(
    guarded: str, kafka_settings: Callable[..., KafkaSettings]
) -> None:
    """SCRAM against a broker that knows no such user: aiokafka lets the failed exchange
    escape as a bare KeyError ('v'), which no retry fixes."""
    kafka = login(kafka_settings, guarded, "SCRAM-SHA-256")
    broker = KafkaConsumer(transport_settings(), kafka)
    with pytest.raises(ConfigurationError) as caught:
        await broker.start(prefetch=1)
    message = str(caught.value)
    assert message.startswith(f"kafka at {guarded} refused the login (")
    assert "WORKER_KAFKA_SASL_*" in message and "\n" not in message
    assert "not-the-password" not in message
    assert not broker.ready
    await broker.close()
    with pytest.raises(ConfigurationError, match="refused the login"):
        await start_producer(kafka)  # worker publish, worker dlq, the outbox relay


async def test_a_connection_the_broker_drops_during_the_login_is_broker_unavailable(
    guarded: str, kafka_settings: Callable[..., KafkaSettings]
) -> None:
    """Tansu closes a PLAIN login without a word, as a reset would: nothing tells the two
    apart (the second connection, which asks for the real cause, is dropped too), so it
    is BrokerUnavailable, with aiokafka's reason."""
    broker = KafkaConsumer(transport_settings(), login(kafka_settings, guarded, "PLAIN"))
    with pytest.raises(BrokerUnavailable) as caught:
        await broker.start(prefetch=1)
    assert str(caught.value).startswith(f"kafka at {guarded}: KafkaConnectionError: ")
    await broker.close()


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (TimeoutError(), "TimeoutError"),
        (KafkaConnectionError(), "KafkaConnectionError"),
        (UnknownError(), "[Error -1] UnknownError"),
        (KafkaConnectionError("Unable to bootstrap"), "KafkaConnectionError: Unable to bootstrap"),
        (KeyError("v"), "KeyError: 'v'"),
    ],
)
def test_an_error_without_text_is_named_by_its_type(error: Any, line: str) -> None:
    assert describe(error) == line
