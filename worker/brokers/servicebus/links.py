"""Links: one client and its receiver, opened whole or not at all, retired, closed.

The consumer receives through one link at a time. When the SDK gives up (it retries
inside, then raises), the consumer's receive loop retires that link and opens a new one
with jittered backoff. A retired link stays open while messages it received are
unsettled, because a message can only be settled through the receiver that received
it. The give-back copies' sender is opened on the link's client on first use
(:mod:`~worker.brokers.servicebus.giveback`) and closed with it.

Opening the first link is the consumer's start, so :func:`open_error` says what a failed
open means: :class:`~worker.errors.ConfigurationError` for what no retry fixes (a
refused login or permission, an entity that does not exist),
:class:`~worker.errors.BrokerUnavailable` for the rest (a reset, a timeout).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from azure.servicebus import ServiceBusReceiveMode
from azure.servicebus.exceptions import (
    MessagingEntityNotFoundError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
)

from worker.brokers.servicebus.client import describe, quietly
from worker.errors import BrokerUnavailable, ConfigurationError

if TYPE_CHECKING:
    from worker.brokers.servicebus.client import Client, ClientFactory, Receiver, Sender
    from worker.brokers.servicebus.settings import ServiceBusSettings

# Refusals an open repeats however often it is tried.
_REFUSED: tuple[type[Exception], ...] = (
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
    MessagingEntityNotFoundError,
)


class Link:
    """One client and its receiver; retired links stay open until their messages settle."""

    __slots__ = ("client", "receiver", "retired", "sender", "unsettled")

    def __init__(self, client: Client, receiver: Receiver) -> None:
        self.client = client
        self.receiver = receiver
        self.sender: Sender | None = None  # for uncounted give-backs, opened on first use
        self.unsettled = 0
        self.retired = False


async def open_link(factory: ClientFactory, settings: ServiceBusSettings, prefetch: int) -> Link:
    """A new client and a PEEK_LOCK receiver on the entity, open, within the SDK call bound."""
    client = factory()
    options: dict[str, Any] = {
        "receive_mode": ServiceBusReceiveMode.PEEK_LOCK,
        "prefetch_count": prefetch,
    }
    receiver: Receiver
    if settings.queue:
        receiver = client.get_queue_receiver(settings.queue, **options)
    else:
        assert settings.topic and settings.subscription
        receiver = client.get_subscription_receiver(
            settings.topic, settings.subscription, **options
        )
    try:
        # try_timeout bounds each attempt inside the SDK; this bounds the whole open,
        # which can otherwise hang when the broker rejects the $cbs auth link.
        async with asyncio.timeout(settings.operation_bound):
            await receiver.__aenter__()
    except BaseException:
        await quietly(receiver.close())
        await quietly(client.close())
        raise
    return Link(client, receiver)


async def close_link(link: Link) -> None:
    if link.sender is not None:
        await quietly(link.sender.close())
    await quietly(link.receiver.close())
    await quietly(link.client.close())


def open_error(
    settings: ServiceBusSettings, exc: Exception
) -> BrokerUnavailable | ConfigurationError:
    """What a failed first open means: try again later, or fix the configuration."""
    where = f"Service Bus entity {settings.entity}"
    if isinstance(exc, _REFUSED):
        return ConfigurationError(f"{where}: {describe(exc)}")
    return BrokerUnavailable(f"{where}: {describe(exc)}")
