"""The broker contract on the real RabbitMQ at 127.0.0.1:5672, in the session's throwaway vhost.

tests/rabbitmq/ relies on these tests for the plain wire checks: commit and
duplicate acked (the queues empty), and poison (a body failing the schema, an
unknown type) dead-lettered at once with the reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from tests.contract.base import BATCH_MODE, BrokerContract, Harness
from tests.rabbitmq.rabbit_helpers import all_depths, declare
from worker.brokers import Broker, DeadLetterInfo, OutgoingMessage
from worker.brokers.rabbitmq import RabbitMQAdmin, RabbitMQConsumer, RabbitMQSettings, make_identity
from worker.settings import Settings

pytestmark = pytest.mark.rabbitmq


class RabbitMQHarness(Harness):
    name = "rabbitmq"
    patience = 20.0

    def __init__(self, settings: RabbitMQSettings) -> None:
        self.rabbit = settings
        self.admin = RabbitMQAdmin(settings, make_identity(settings))

    def broker(self, settings: Settings) -> Broker:
        return RabbitMQConsumer(self.rabbit, make_identity(self.rabbit, settings.message_id_func))

    async def publish(self, messages: list[OutgoingMessage]) -> None:
        await declare(self.rabbit)  # what a worker's start declares (`worker publish` doesn't)
        await self.admin.publish(messages)

    async def dead_letters(self) -> list[DeadLetterInfo]:
        return await self.admin.dead_letters(100)

    async def remaining(self) -> int:
        """Ready messages in the work and retry queues (consumers are closed: nothing unacked)."""
        depths = await all_depths(self.rabbit)
        return sum(n for name, n in depths.items() if name != self.rabbit.dead_letter_queue)

    async def close(self) -> None:
        await self.admin.close()


class TestRabbitMQContract(BrokerContract):
    @pytest.fixture
    async def harness(
        self, rabbit_settings: Callable[..., RabbitMQSettings]
    ) -> AsyncIterator[Harness]:
        harness = RabbitMQHarness(rabbit_settings())
        yield harness
        await harness.close()


class BatchRabbitMQHarness(RabbitMQHarness):
    mode = BATCH_MODE


class TestRabbitMQBatchContract(BrokerContract):
    """The same contract in batch mode (acks of a batch go out as multiple-acks where safe)."""

    @pytest.fixture
    async def harness(
        self, rabbit_settings: Callable[..., RabbitMQSettings]
    ) -> AsyncIterator[Harness]:
        harness = BatchRabbitMQHarness(rabbit_settings())
        yield harness
        await harness.close()
