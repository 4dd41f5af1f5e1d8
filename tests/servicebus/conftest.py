"""Fixtures every Service Bus test file uses: a fake namespace and consumers on it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.servicebus.fake import Entity, FakeServiceBus
from tests.servicebus.sb_helpers import StartConsumer
from tests.servicebus.sb_settings import sb_settings
from worker.brokers.servicebus import ServiceBusConsumer


@pytest.fixture
def bus() -> FakeServiceBus:
    return FakeServiceBus()


@pytest.fixture
def queue(bus: FakeServiceBus) -> Entity:
    """The queue ``sb_settings()`` consumes, with a lock short enough to watch renewals."""
    return bus.create_queue("work", lock_duration=5.0)


@pytest.fixture
async def consumers(bus: FakeServiceBus) -> AsyncIterator[StartConsumer]:
    """Start consumers on the fake; every one is closed at the end."""
    started: list[ServiceBusConsumer] = []

    async def start(slots: int = 4, **overrides: Any) -> ServiceBusConsumer:
        """``slots`` is what the pump passes to ``start``: its concurrency."""
        consumer = ServiceBusConsumer(sb_settings(**overrides), bus.client)
        started.append(consumer)
        await consumer.start(slots)
        return consumer

    yield start
    for consumer in started:
        await consumer.close()
