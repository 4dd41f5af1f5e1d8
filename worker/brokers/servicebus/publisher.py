"""The outbox relay's Service Bus :class:`~worker.brokers.outgoing.Publisher`.

Senders of its own, one per destination entity (a relay may run without a consumer);
``send_messages`` returning is the broker's confirm, so a row leaves the outbox only
once Service Bus has taken its message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from azure.servicebus import ServiceBusMessage
from azure.servicebus.exceptions import (
    MessageSizeExceededError,
    MessagingEntityDisabledError,
    MessagingEntityNotFoundError,
    ServiceBusError,
)

from worker.brokers.outgoing import Outgoing
from worker.brokers.servicebus.client import ClientFactory, Sender
from worker.brokers.servicebus.settings import ServiceBusSettings
from worker.errors import BrokerUnavailable
from worker.logs import scrub


class ServiceBusPublisher:
    """azure-servicebus senders, one per entity; ``send_messages`` returning is the confirm."""

    name = "servicebus"

    def __init__(
        self,
        servicebus: ServiceBusSettings,
        client_factory: ClientFactory,
        timeout: float,
    ) -> None:
        self.servicebus = servicebus
        self.timeout = timeout
        self._factory = client_factory
        self._client: Any = None
        self._senders: dict[str, Sender] = {}

    def _sender(self, destination: str) -> Sender:
        sender = self._senders.get(destination)
        if sender is None:
            if self._client is None:
                self._client = self._factory()
            kind, colon, entity = destination.partition(":")
            if colon and kind == "topic":
                sender = self._client.get_topic_sender(entity)
            else:
                sender = self._client.get_queue_sender(entity if colon else destination)
            self._senders[destination] = sender
        return sender

    def outgoing(self, message: Outgoing) -> ServiceBusMessage:
        properties: dict[str | bytes, Any] = {k: v for k, v in message.headers.items()}
        properties[self.servicebus.type_property] = message.type
        return ServiceBusMessage(
            message.body,
            message_id=message.message_id,
            subject=message.type,
            session_id=None,
            partition_key=None,
            content_type="application/json",
            application_properties=properties,
        )

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        refused = (
            MessageSizeExceededError,
            MessagingEntityNotFoundError,
            MessagingEntityDisabledError,
        )
        results: list[str | None] = []
        try:
            async with asyncio.timeout(self.timeout):
                for message in messages:  # one by one: a refusal names its message
                    destination = message.destination or message.type
                    try:
                        await self._sender(destination).send_messages(self.outgoing(message))
                    except refused as exc:
                        results.append(f"{destination!r}: {type(exc).__name__}: {exc}")
                        continue
                    results.append(None)
        except TimeoutError:
            raise BrokerUnavailable(f"servicebus: no send within {self.timeout}s") from None
        except (ServiceBusError, OSError) as exc:
            raise BrokerUnavailable(f"servicebus: {scrub(str(exc))}") from None
        return results

    async def close(self) -> None:
        for sender in self._senders.values():
            with contextlib.suppress(Exception):
                await sender.close()
        self._senders = {}
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
        self._client = None


__all__ = ["ServiceBusPublisher"]
