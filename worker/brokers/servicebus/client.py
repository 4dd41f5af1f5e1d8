"""The slice of the azure-servicebus SDK the adapter calls, and how clients are made.

The Protocols name exactly the SDK surface the consumer, the operator tools and the
publisher use, so the test fake (tests/servicebus/fake.py) implements no more and
no less; :class:`Connector` builds real clients from a connection string or a
namespace plus one shared azure-identity credential. The two small helpers at the end
name an SDK error and close an SDK object that may already be broken.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, Self

from azure.servicebus.aio import ServiceBusClient

from worker.errors import ConfigurationError

if TYPE_CHECKING:
    from azure.servicebus import ServiceBusReceivedMessage

    from worker.brokers.servicebus.settings import ServiceBusSettings

SEND_CHUNK = 100  # messages per send_messages call, at most


class Receiver(Protocol):
    async def __aenter__(self) -> Self: ...

    async def receive_messages(
        self, max_message_count: int | None = 1, max_wait_time: float | None = None
    ) -> list[ServiceBusReceivedMessage]: ...

    async def peek_messages(
        self, max_message_count: int = 1, *, sequence_number: int = 0
    ) -> list[ServiceBusReceivedMessage]: ...

    async def complete_message(self, message: ServiceBusReceivedMessage) -> None: ...

    async def abandon_message(self, message: ServiceBusReceivedMessage) -> None: ...

    async def dead_letter_message(
        self,
        message: ServiceBusReceivedMessage,
        reason: str | None = None,
        error_description: str | None = None,
    ) -> None: ...

    async def renew_message_lock(self, message: ServiceBusReceivedMessage) -> datetime: ...

    async def close(self) -> None: ...


class Sender(Protocol):
    async def send_messages(self, message: Any) -> None: ...

    async def close(self) -> None: ...


class Client(Protocol):
    def get_queue_receiver(self, queue_name: str, **kwargs: Any) -> Receiver: ...

    def get_subscription_receiver(
        self, topic_name: str, subscription_name: str, **kwargs: Any
    ) -> Receiver: ...

    def get_queue_sender(self, queue_name: str, **kwargs: Any) -> Sender: ...

    def get_topic_sender(self, topic_name: str, **kwargs: Any) -> Sender: ...

    async def close(self) -> None: ...


ClientFactory = Callable[[], Client]


class Connector:
    """Makes clients: from a connection string, or a namespace plus one shared credential."""

    def __init__(self, settings: ServiceBusSettings) -> None:
        self._settings = settings
        self._credential: Any = None
        if settings.connection_string is None:
            self._credential = _default_credential()

    def __call__(self) -> Client:
        settings = self._settings
        options: dict[str, Any] = {
            "retry_total": settings.retry_total,
            "try_timeout": settings.try_timeout,
        }
        if settings.connection_string is not None:
            secret = settings.connection_string.get_secret_value()
            return ServiceBusClient.from_connection_string(secret, **options)
        assert settings.namespace is not None
        return ServiceBusClient(settings.namespace, self._credential, **options)

    async def close(self) -> None:
        if self._credential is not None:
            await self._credential.close()


def _default_credential() -> Any:
    try:
        identity = importlib.import_module("azure.identity.aio")
    except ImportError:
        raise ConfigurationError(
            "WORKER_SERVICEBUS_NAMESPACE needs azure-identity: "
            "pip install 'idempotent-worker[azure]'"
        ) from None
    return identity.DefaultAzureCredential()


def describe(exc: BaseException) -> str:
    """An SDK error as one line: its type, and its text when it has one (never empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def quietly(closing: Awaitable[Any]) -> None:
    """Close something that may already be broken; there is nobody to report a failure to."""
    try:
        async with asyncio.timeout(10.0):
            await closing
    except Exception:  # a broken connection fails its own close
        pass


__all__ = [
    "SEND_CHUNK",
    "Client",
    "ClientFactory",
    "Connector",
    "Receiver",
    "Sender",
    "describe",
    "quietly",
]
