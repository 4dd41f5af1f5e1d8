"""Service Bus settings and connecting, against the fake: WORKER_SERVICEBUS_* and its
one-line complaints, the clients a connection string or a namespace makes, and a start
that fails or hangs."""

from __future__ import annotations

import asyncio
import sys
import types
from typing import Any

import pytest
import structlog
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import ServiceBusAuthenticationError, ServiceBusAuthorizationError

from tests.servicebus.fake import Entity, FakeServiceBus
from tests.servicebus.sb_helpers import StartConsumer
from tests.servicebus.sb_settings import CONNECTION_STRING, SECRET, sb_settings
from worker.brokers import open_admin, open_broker
from worker.brokers.servicebus import (
    Connector,
    ServiceBusAdmin,
    ServiceBusConsumer,
    load_settings,
)
from worker.errors import BrokerUnavailable, ConfigurationError
from worker.settings import Settings


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_SERVICEBUS_CONNECTION_STRING", CONNECTION_STRING)
    monkeypatch.setenv("WORKER_SERVICEBUS_TOPIC", "events")
    monkeypatch.setenv("WORKER_SERVICEBUS_SUBSCRIPTION", "billing")
    monkeypatch.setenv("WORKER_SERVICEBUS_TYPE_MAPPING", '{"events/billing": "Invoice"}')
    monkeypatch.setenv("WORKER_SERVICEBUS_MAX_LOCK_RENEWAL", "120")
    settings = load_settings()
    assert settings.entity == "events/billing"
    assert settings.type_mapping == {"events/billing": "Invoice"}
    assert settings.max_lock_renewal == 120.0
    assert settings.connection_string is not None
    assert SECRET not in repr(settings)


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"NAMESPACE": "x.servicebus.windows.net", "QUEUE": "q"}, "exactly one of"),
        ({}, "exactly one of WORKER_SERVICEBUS_QUEUE"),
        ({"TOPIC": "events"}, "needs WORKER_SERVICEBUS_SUBSCRIPTION"),
        ({"QUEUE": "q", "RECEIVE_WAIT": "0"}, "WORKER_SERVICEBUS_RECEIVE_WAIT='0'"),
        ({"QUEUE": "q", "TRY_TIMEOUT": "-1"}, "WORKER_SERVICEBUS_TRY_TIMEOUT"),
    ],
)
def test_bad_settings_are_one_line_and_never_show_the_secret(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], complaint: str
) -> None:
    monkeypatch.setenv("WORKER_SERVICEBUS_CONNECTION_STRING", CONNECTION_STRING)
    for name, value in env.items():
        monkeypatch.setenv(f"WORKER_SERVICEBUS_{name}", value)
    with pytest.raises(ConfigurationError) as error:
        load_settings()
    assert complaint in str(error.value)
    assert "\n" not in str(error.value) and SECRET not in str(error.value)


async def test_connection_string_clients_always_bound_each_attempt() -> None:
    client = Connector(sb_settings(try_timeout=7.0, retry_total=2))()
    try:
        assert isinstance(client, ServiceBusClient)
        assert client.fully_qualified_namespace == "fake.servicebus.windows.net"
        assert client._config.try_timeout == 7.0 and client._config.retry_total == 2
    finally:
        await client.close()


async def test_a_namespace_authenticates_with_default_azure_credential(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[Any] = []

    class DefaultAzureCredential:
        closed = False

        def __init__(self) -> None:
            made.append(self)

        async def get_token(self, *scopes: str, **kwargs: Any) -> Any:
            raise AssertionError("no token is fetched before the first connection")

        async def close(self) -> None:
            self.closed = True

    module = types.ModuleType("azure.identity.aio")
    module.DefaultAzureCredential = DefaultAzureCredential  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "azure.identity.aio", module)
    settings = sb_settings(connection_string=None, namespace="prod.servicebus.windows.net")
    connector = Connector(settings)
    first, second = connector(), connector()
    assert first.fully_qualified_namespace == "prod.servicebus.windows.net"  # type: ignore[attr-defined]
    assert len(made) == 1  # one credential for every client, closed once at the end
    await first.close()
    await second.close()
    await connector.close()
    assert made[0].closed


def test_a_namespace_without_azure_identity_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "azure.identity.aio", None)
    settings = sb_settings(connection_string=None, namespace="prod.servicebus.windows.net")
    with pytest.raises(ConfigurationError, match=r"idempotent-worker\[azure\]"):
        Connector(settings)


async def test_worker_broker_servicebus_opens_this_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_SERVICEBUS_CONNECTION_STRING", CONNECTION_STRING)
    monkeypatch.setenv("WORKER_SERVICEBUS_QUEUE", "work")
    settings = Settings(broker="servicebus", max_deliveries=10)
    with structlog.testing.capture_logs() as logs:
        broker = open_broker(settings)
    assert isinstance(broker, ServiceBusConsumer) and broker.name == "servicebus"
    assert any("MaxDeliveryCount" in entry["event"] for entry in logs)
    await broker.close()
    admin = open_admin(settings)
    assert isinstance(admin, ServiceBusAdmin)
    await admin.close()


async def test_a_missing_entity_stops_the_start_as_a_configuration_error(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    """No retry creates the queue: the start-up retry must stop at once, not wait it out."""
    with pytest.raises(ConfigurationError) as caught:
        await consumers(queue="nowhere")
    message = str(caught.value)
    assert "MessagingEntityNotFoundError" in message and "nowhere" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "refusal",
    [
        lambda: ServiceBusAuthenticationError(message="Unauthorized access: token expired"),
        lambda: ServiceBusAuthorizationError(message="Manage,Listen claims required"),
    ],
)
async def test_refused_credentials_stop_the_start_as_a_configuration_error(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer, refusal: Any
) -> None:
    bus.fail("open", refusal)
    with pytest.raises(ConfigurationError, match="Service Bus entity work: ServiceBusAuth"):
        await consumers()


async def test_a_connection_reset_at_start_is_broker_unavailable_with_its_reason(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    """Transient: the start-up retry tries again, and its line says why."""
    bus.fail("open")  # ServiceBusConnectionError
    with pytest.raises(BrokerUnavailable) as caught:
        await consumers()
    assert str(caught.value) == (
        "Service Bus entity work: ServiceBusConnectionError: open: injected fault"
    )
    consumer = await consumers()  # the fault is gone: the next try starts
    assert consumer.ready


async def test_a_hanging_open_is_bounded_and_its_reason_is_never_empty(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    bus.hang("open")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(BrokerUnavailable) as caught:
        await consumers(try_timeout=0.2)
    assert loop.time() - started < 5
    # TimeoutError() has no text: the line names its type, never "...: " with nothing after
    assert str(caught.value) == "Service Bus entity work: TimeoutError"
