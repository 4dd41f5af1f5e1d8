"""The broker contract on the real RabbitMQ at 127.0.0.1:5672, in a throwaway vhost."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.contract.base import BrokerContract, Harness
from tests.rabbitmq.rabbit_helpers import HOST, PORT, REPO, all_depths, rabbitmqctl
from worker.brokers import Broker, DeadLetterInfo, OutgoingMessage
from worker.brokers.rabbitmq import RabbitMQAdmin, RabbitMQBroker, RabbitMQSettings, make_identity
from worker.settings import Settings

pytestmark = pytest.mark.rabbitmq


class RabbitMQHarness(Harness):
    name = "rabbitmq"
    patience = 20.0

    def __init__(self, settings: RabbitMQSettings) -> None:
        self.rabbit = settings
        self.admin = RabbitMQAdmin(settings, make_identity(settings))

    def broker(self, settings: Settings) -> Broker:
        return RabbitMQBroker(self.rabbit, make_identity(self.rabbit, settings.message_id_func))

    async def publish(self, messages: list[OutgoingMessage]) -> None:
        await self.admin.publish(messages)

    async def dead_letters(self) -> list[DeadLetterInfo]:
        return await self.admin.dead_letters(100)

    async def remaining(self) -> int:
        """Ready messages in the work and retry queues (consumers are closed: nothing unacked)."""
        depths = await all_depths(self.rabbit)
        return sum(n for name, n in depths.items() if name != self.rabbit.dead_letter_queue)

    async def close(self) -> None:
        await self.admin.close()


@pytest.fixture(scope="module")
def contract_vhost(pytestconfig: pytest.Config) -> Iterator[str]:
    root = pytestconfig.pluginmanager.get_plugin(str(REPO / "tests" / "conftest.py"))
    assert root is not None, "tests/conftest.py is not loaded"
    root.require_service(HOST, PORT, "RabbitMQ")
    if shutil.which("rabbitmqctl") is None:
        message = "rabbitmqctl is not on PATH: the contract tests cannot make a vhost"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    name = f"worker_contract_{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


class TestRabbitMQContract(BrokerContract):
    @pytest.fixture
    async def harness(self, contract_vhost: str) -> AsyncIterator[Harness]:
        queue = f"c{uuid.uuid4().hex[:8]}"
        settings = RabbitMQSettings(
            url=f"amqp://guest:guest@{HOST}:{PORT}/{contract_vhost}",
            queue=queue,
            exchange=f"{queue}.in",
            retry_delays=[0.2, 0.5],
            reconnect_interval=0.3,
            settle_timeout=5.0,
        )
        harness = RabbitMQHarness(settings)
        yield harness
        await harness.close()
