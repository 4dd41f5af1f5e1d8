"""The adapter's pure parts: settings, dedup key, type, delivery count, TLS. No broker needed."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from worker.brokers.rabbitmq import (
    RabbitMQConsumer,
    RabbitMQSettings,
    content_hash_id,
    copy_message,
    delivery_count,
    make_identity,
    message_type,
    ssl_context,
)
from worker.errors import BrokerUnavailable, ConfigurationError
from worker.settings import load


@dataclass
class Raw:
    """Just the attributes the adapter reads from an aio-pika IncomingMessage."""

    body: bytes = b"{}"
    message_id: str | None = None
    type: str | None = None
    headers: dict[str, Any] = field(default_factory=dict)
    redelivered: bool = False
    content_type: str | None = None
    content_encoding: str | None = None
    priority: int | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    timestamp: Any = None
    app_id: str | None = None


def msg(**attributes: Any) -> Any:
    """A :class:`Raw` typed as what the adapter's functions accept."""
    return Raw(**attributes)


def identity(raw: Raw, **settings: Any) -> str | None:
    func = make_identity(RabbitMQSettings(**settings))
    result: str | None = func(raw)
    return result


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_RABBITMQ_QUEUE", "billing")
    monkeypatch.setenv("WORKER_RABBITMQ_RETRY_DELAYS", "[0.5, 2, 10]")
    monkeypatch.setenv("WORKER_RABBITMQ_BINDING_KEYS", '["credit.*", "debit.*"]')
    settings = load(RabbitMQSettings)
    assert settings.retry_delays == [0.5, 2.0, 10.0]
    assert settings.binding_keys == ["credit.*", "debit.*"]
    assert settings.retry_queue(0.5) == "billing.delay.500ms"
    assert (settings.dead_letter_exchange, settings.dead_letter_queue) == (
        "billing.dlx",
        "billing.dlq",
    )


def test_a_bad_url_is_one_line_without_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_RABBITMQ_URL", "http://ops:hunter2@rabbit:5672/")
    with pytest.raises(ConfigurationError) as caught:
        load(RabbitMQSettings)
    message = str(caught.value)
    assert "WORKER_RABBITMQ_URL" in message and "amqp://" in message
    assert "hunter2" not in message and "\n" not in message


@pytest.mark.parametrize("delays", ["[5, 1]", "[1, 1]", "[0, 1]", "[-1]"])
def test_retry_delays_must_ascend(monkeypatch: pytest.MonkeyPatch, delays: str) -> None:
    monkeypatch.setenv("WORKER_RABBITMQ_RETRY_DELAYS", delays)
    with pytest.raises(ConfigurationError, match="WORKER_RABBITMQ_RETRY_DELAYS"):
        load(RabbitMQSettings)


@pytest.mark.parametrize(
    ("count", "requested", "expected"),
    [
        (1, None, 1.0),  # backoff grows with the delivery count ...
        (2, None, 5.0),
        (3, None, 30.0),
        (9, None, 30.0),  # ... and stays at the longest queue
        (1, 0.0, None),  # Retry(delay=0): requeue at once
        (1, 3.0, 5.0),  # Retry(delay=3): the shortest queue at least that long
        (1, 99.0, 30.0),
    ],
)
def test_retry_queue_choice(count: int, requested: float | None, expected: float | None) -> None:
    settings = RabbitMQSettings(retry_delays=[1, 5, 30])
    assert settings.retry_delay(count, requested) == expected


def test_no_retry_queues_means_immediate_requeue() -> None:
    assert RabbitMQSettings(retry_delays=[]).retry_delay(3, None) is None


def test_dedup_key_message_id_then_cloudevents_then_none() -> None:
    assert identity(msg(message_id="m-1")) == "m-1"
    event = {"ce-id": "42", "ce-source": "/billing"}
    assert identity(msg(message_id="random-by-aiormq", headers=event)) == '["/billing","42"]'
    assert identity(msg(headers={"cloudEvents:id": "42", "cloudEvents:source": "/b"})) == (
        '["/b","42"]'
    )
    assert identity(msg(headers={"ce-id": b"42", "ce_source": b"/b"})) == '["/b","42"]'
    assert identity(msg(headers={"ce-id": "42"})) is None  # an id without its source is not unique
    assert identity(msg()) is None
    assert identity(msg(message_id="")) is None


def test_content_hash_only_when_enabled() -> None:
    raw = msg(body=b'{"amount": "1"}', type="CreditRequested")
    assert identity(raw) is None
    hashed = identity(raw, content_hash_ids=True)
    assert hashed == content_hash_id(raw) and hashed is not None and hashed.startswith("sha256:")
    other_type = msg(body=raw.body, type="DebitRequested")
    assert identity(other_type, content_hash_ids=True) != hashed
    assert identity(msg(message_id="m-1"), content_hash_ids=True) == "m-1"  # ids still win


def test_message_id_func_replaces_the_default() -> None:
    func = make_identity(RabbitMQSettings(), "operator:attrgetter")
    assert callable(func)  # resolved from "module:function" like every adapter's


def test_type_from_property_or_cloudevents() -> None:
    assert message_type(msg(type="CreditRequested")) == "CreditRequested"
    assert message_type(msg(headers={"ce-type": "Credit"})) == "Credit"
    assert message_type(msg()) is None


@pytest.mark.parametrize(
    ("headers", "redelivered", "expected"),
    [
        ({"x-delivery-count": 0}, False, 1),  # quorum queue, first delivery
        ({"x-delivery-count": 2}, True, 3),  # nacked / consumer vanished twice
        ({"x-worker-deliveries": 3, "x-delivery-count": 0}, False, 4),  # back from a retry queue
        ({"x-worker-deliveries": 3, "x-delivery-count": 1}, True, 5),
        ({}, False, 1),  # classic queue
        ({}, True, 2),  # classic queue only says "at least once before"
        ({"x-worker-deliveries": "garbage"}, False, 1),
    ],
)
def test_delivery_count(headers: dict[str, Any], redelivered: bool, expected: int) -> None:
    assert delivery_count(msg(headers=headers, redelivered=redelivered)) == expected


def test_copy_drops_broker_bookkeeping_and_stays_persistent() -> None:
    raw = msg(
        body=b"x",
        message_id="m",
        type="T",
        headers={"x-death": [{}], "x-delivery-count": 2, "x-worker-reason": "old", "trace": "t"},
    )
    copy = copy_message(raw, **{"x-worker-deliveries": 2})
    assert copy.headers == {"trace": "t", "x-worker-deliveries": 2}
    assert (copy.message_id, copy.type, copy.body) == ("m", "T", b"x")
    assert copy.delivery_mode == 2


# -- TLS ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A throwaway self-signed certificate and key (it doubles as its own CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not on PATH")
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    command = "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    command += f" -keyout {key} -out {cert} -days 1 -subj /CN=worker-test"
    subprocess.run(command.split(), check=True, capture_output=True, timeout=30)
    return cert, key


def test_plain_amqp_has_no_tls_context() -> None:
    assert ssl_context(RabbitMQSettings(url="amqp://h/")) is None


def test_tls_options_without_amqps_are_a_configuration_error(
    certificate: tuple[Path, Path],
) -> None:
    with pytest.raises(ConfigurationError, match="amqps"):
        ssl_context(RabbitMQSettings(url="amqp://h/", tls_ca_file=str(certificate[0])))


def test_amqps_verifies_by_default() -> None:
    context = ssl_context(RabbitMQSettings(url="amqps://h/"))
    assert context is not None
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_tls_context_from_settings(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    settings = RabbitMQSettings(
        url="amqps://u:p@rabbit:5671/", tls_ca_file=str(cert), tls_cert_file=str(cert),
        tls_key_file=str(key),
    )  # fmt: skip
    context = ssl_context(settings)
    assert context is not None
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "worker-test"),),)]
    assert context.verify_mode == ssl.CERT_REQUIRED


def test_tls_verify_off(certificate: tuple[Path, Path]) -> None:
    context = ssl_context(RabbitMQSettings(url="amqps://h/", tls_verify=False))
    assert context is not None
    assert context.verify_mode == ssl.CERT_NONE and not context.check_hostname


@pytest.mark.parametrize("setting", ["tls_ca_file", "tls_cert_file"])
def test_missing_tls_file_names_the_variable(setting: str, tmp_path: Path) -> None:
    values: dict[str, Any] = {"url": "amqps://h/", setting: str(tmp_path / "missing.pem")}
    settings = RabbitMQSettings(**values)
    with pytest.raises(ConfigurationError, match=setting.upper()):
        ssl_context(settings)


async def test_the_context_reaches_aio_pika_and_the_password_stays_out(
    monkeypatch: pytest.MonkeyPatch, certificate: tuple[Path, Path]
) -> None:
    seen: dict[str, Any] = {}

    async def refuse(url: str, **kwargs: Any) -> Any:
        seen.update(kwargs, url=url)
        raise ConnectionRefusedError(f"cannot reach {url}")

    monkeypatch.setattr(aio_pika, "connect_robust", refuse)
    settings = RabbitMQSettings(
        url="amqps://ops:hunter2@rabbit:5671/prod", tls_ca_file=str(certificate[0])
    )
    broker = RabbitMQConsumer(settings, make_identity(settings))
    with pytest.raises(BrokerUnavailable) as caught:
        await broker.start(prefetch=4)
    assert isinstance(seen["ssl_context"], ssl.SSLContext)
    assert seen["ssl_context"].get_ca_certs()
    assert "hunter2" not in str(caught.value) and "ops:***@rabbit" in str(caught.value)
    assert not broker.ready
