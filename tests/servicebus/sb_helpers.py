"""Messages and waits the Service Bus adapter tests share: send to the fake, take from a
consumer, poll a condition."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from azure.servicebus import ServiceBusMessage

from tests.servicebus.fake import FakeServiceBus
from worker.brokers.servicebus import ServiceBusConsumer
from worker.delivery import Delivery

StartConsumer = Callable[..., Awaitable[ServiceBusConsumer]]
"""The ``consumers`` fixture (tests/servicebus/conftest.py): ``await consumers(slots,
**settings)`` starts a consumer on the fake, closed at the end of the test."""


async def send(bus: FakeServiceBus, *messages: ServiceBusMessage, queue: str = "work") -> None:
    sender = bus.client().get_queue_sender(queue)
    await sender.send_messages(list(messages))


def msg(message_id: Any = "m-1", **kwargs: Any) -> ServiceBusMessage:
    kwargs.setdefault("application_properties", {"type": "CreditRequested"})
    message = ServiceBusMessage(b'{"amount": "1"}', message_id=message_id, **kwargs)
    message.message_id = message_id  # the SDK invents one for None
    return message


async def take(consumer: ServiceBusConsumer, seconds: float = 3.0) -> Delivery:
    async with asyncio.timeout(seconds):
        return await consumer.receive()
