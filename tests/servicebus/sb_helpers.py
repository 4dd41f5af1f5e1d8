"""Messages and waits the Service Bus adapter tests share: send to the fake, take from a
consumer, poll a condition."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage

from tests.servicebus.fake import FakeServiceBus
from worker.brokers.servicebus import ServiceBusConsumer
from worker.delivery import Delivery


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


async def until(predicate: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"not true within {seconds}s")
        await asyncio.sleep(0.01)
