"""The broker contract on Azure Service Bus: against the fake always, a real namespace on demand.

The connected tier runs when ``WORKER_TEST_SERVICEBUS_CONNECTION_STRING`` is set
(a namespace or the emulator). It uses ``WORKER_TEST_SERVICEBUS_QUEUE`` when
given (emptied first: the emulator only has the queues of its config file),
otherwise it creates a uniquely named queue, which needs the Manage right, and
deletes it afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from azure.servicebus import ServiceBusReceiveMode, ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.aio.management import ServiceBusAdministrationClient
from pydantic import SecretStr

from tests.contract.base import BATCH_MODE, BrokerContract, Harness
from tests.servicebus.fake import Entity, FakeServiceBus
from worker.brokers import Broker, DeadLetterInfo, OutgoingMessage
from worker.brokers.servicebus import (
    ClientFactory,
    Connector,
    ServiceBusAdmin,
    ServiceBusSettings,
    open_broker,
)
from worker.settings import Settings

FAKE_CONNECTION_STRING = (
    "Endpoint=sb://fake.servicebus.windows.net/;SharedAccessKeyName=test;SharedAccessKey=secret"
)
CONNECTED = os.environ.get("WORKER_TEST_SERVICEBUS_CONNECTION_STRING")


class ServiceBusHarness(Harness):
    """Publishes and lists dead letters through the adapter's own admin."""

    name = "servicebus"

    def __init__(self, settings: ServiceBusSettings, client_factory: ClientFactory) -> None:
        self.sb = settings
        self.client_factory = client_factory
        self.admin = ServiceBusAdmin(settings, client_factory)

    def broker(self, settings: Settings) -> Broker:
        return open_broker(settings, servicebus=self.sb, client_factory=self.client_factory)

    async def publish(self, messages: list[OutgoingMessage]) -> None:
        await self.admin.publish(messages)

    async def dead_letters(self) -> list[DeadLetterInfo]:
        return await self.admin.dead_letters(100)

    async def close(self) -> None:
        await self.admin.close()


class FakeHarness(ServiceBusHarness):
    name = "servicebus-fake"
    patience = 10.0

    def __init__(self) -> None:
        self.bus = FakeServiceBus()
        self.queue: Entity = self.bus.create_queue("work", lock_duration=5.0)
        settings = ServiceBusSettings(
            connection_string=SecretStr(FAKE_CONNECTION_STRING), queue="work", receive_wait=0.2
        )
        super().__init__(settings, self.bus.client)

    async def remaining(self) -> int:
        return self.queue.count


class TestServiceBusFakeContract(BrokerContract):
    @pytest.fixture
    async def harness(self) -> AsyncIterator[Harness]:
        harness = FakeHarness()
        yield harness
        await harness.close()


class BatchFakeHarness(FakeHarness):
    mode = BATCH_MODE


class TestServiceBusFakeBatchContract(BrokerContract):
    """The same contract in batch mode, on the fake."""

    @pytest.fixture
    async def harness(self) -> AsyncIterator[Harness]:
        harness = BatchFakeHarness()
        yield harness
        await harness.close()


# -- the connected tier ------------------------------------------------------------


class ConnectedHarness(ServiceBusHarness):
    name = "servicebus-connected"
    patience = 60.0

    def __init__(self, connection_string: str, queue: str) -> None:
        settings = ServiceBusSettings(
            connection_string=SecretStr(connection_string),
            queue=queue,
            receive_wait=1.0,
            try_timeout=20.0,
        )
        super().__init__(settings, Connector(settings))
        self.connection_string = connection_string
        self.queue = queue

    async def remaining(self) -> int:
        """Peek (which sees locked messages too) through a fresh client."""
        async with ServiceBusClient.from_connection_string(self.connection_string) as client:
            receiver = client.get_queue_receiver(self.queue)
            async with receiver:
                count, sequence = 0, 0
                while page := await receiver.peek_messages(100, sequence_number=sequence):
                    count += len(page)
                    sequence = (page[-1].sequence_number or 0) + 1
                return count


async def _purge(connection_string: str, queue: str) -> None:
    async with ServiceBusClient.from_connection_string(connection_string) as client:
        for sub_queue in (None, ServiceBusSubQueue.DEAD_LETTER):
            receiver = client.get_queue_receiver(
                queue, sub_queue=sub_queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
            )
            async with receiver:
                for _ in range(1000):
                    if not await receiver.receive_messages(100, max_wait_time=2):
                        break


@pytest.mark.skipif(
    not CONNECTED,
    reason="WORKER_TEST_SERVICEBUS_CONNECTION_STRING is not set: the connected tier needs a "
    "real Service Bus namespace or the emulator",
)
class TestServiceBusConnectedContract(BrokerContract):
    @pytest.fixture
    async def harness(self) -> AsyncIterator[Harness]:
        assert CONNECTED is not None
        given = os.environ.get("WORKER_TEST_SERVICEBUS_QUEUE")
        queue = given or f"worker-test-{uuid.uuid4().hex[:10]}"
        if given:
            await _purge(CONNECTED, queue)
        else:
            async with ServiceBusAdministrationClient.from_connection_string(CONNECTED) as mgmt:
                await mgmt.create_queue(
                    queue, lock_duration=timedelta(seconds=30), max_delivery_count=10
                )
        harness = ConnectedHarness(CONNECTED, queue)
        try:
            yield harness
        finally:
            await harness.close()
            if given:
                await _purge(CONNECTED, queue)
            else:
                async with ServiceBusAdministrationClient.from_connection_string(CONNECTED) as m:
                    await m.delete_queue(queue)
