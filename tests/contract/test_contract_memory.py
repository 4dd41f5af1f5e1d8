"""The broker contract on the in-process memory broker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.contract.base import BATCH_MODE, BrokerContract, Harness
from worker.brokers import Broker, DeadLetterInfo, OutgoingMessage
from worker.brokers.memory import MemoryBroker
from worker.settings import Settings


class MemoryHarness(Harness):
    name = "memory"
    patience = 5.0

    def __init__(self) -> None:
        self.queue = MemoryBroker()

    async def publish(self, messages: list[OutgoingMessage]) -> None:
        for m in messages:
            self.queue.publish(m.message_id, m.type, m.body, dict(m.headers))

    def broker(self, settings: Settings) -> Broker:
        return self.queue.connect()

    async def dead_letters(self) -> list[DeadLetterInfo]:
        return [
            DeadLetterInfo(d.message.message_id, d.message.type, d.reason, d.message.body)
            for d in self.queue.dead_letters
        ]

    async def remaining(self) -> int:
        return len(self.queue.ready) + self.queue.in_flight + self.queue._delayed


class TestMemoryContract(BrokerContract):
    @pytest.fixture
    async def harness(self) -> AsyncIterator[Harness]:
        harness = MemoryHarness()
        yield harness
        await harness.close()


class BatchMemoryHarness(MemoryHarness):
    mode = BATCH_MODE


class TestMemoryBatchContract(BrokerContract):
    """The same contract in batch mode."""

    @pytest.fixture
    async def harness(self) -> AsyncIterator[Harness]:
        harness = BatchMemoryHarness()
        yield harness
        await harness.close()
