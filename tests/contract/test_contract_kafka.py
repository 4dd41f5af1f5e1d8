"""The broker contract on Kafka: the session's Tansu test broker (see docs/kafka.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.contract.base import BATCH_MODE, BrokerContract, Harness
from tests.kafka.kafka_helpers import create_topic, lag, settings_for, unique
from tests.support.tansu import Tansu
from worker.brokers import Broker, DeadLetterInfo, OutgoingMessage
from worker.brokers.kafka import KafkaAdmin, KafkaConsumer, KafkaSettings
from worker.settings import Settings

pytestmark = pytest.mark.kafka

PARTITIONS = 2


class KafkaHarness(Harness):
    name = "kafka"
    patience = 30.0  # group joins on the test broker wait for session timeouts

    def __init__(self, bootstrap: str, settings: KafkaSettings) -> None:
        self.bootstrap = bootstrap
        self.kafka = settings
        self.admin = KafkaAdmin(settings)

    def pump_settings(self) -> dict[str, Any]:
        return {"concurrency": 2}

    def broker(self, settings: Settings) -> Broker:
        return KafkaConsumer(settings, self.kafka)

    async def publish(self, messages: list[OutgoingMessage]) -> None:
        await self.admin.publish(messages)

    async def dead_letters(self) -> list[DeadLetterInfo]:
        return await self.admin.dead_letters(100)

    async def remaining(self) -> int:
        """Consumer lag of the group: records not yet committed past."""
        topic = self.kafka.topic_list[0]
        return await lag(self.bootstrap, self.kafka.group_id, topic, PARTITIONS)

    async def close(self) -> None:
        await self.admin.close()


class TestKafkaContract(BrokerContract):
    @pytest.fixture
    async def harness(self, tansu: Tansu) -> AsyncIterator[Harness]:
        topic = unique("contract")
        await create_topic(tansu.bootstrap, topic, PARTITIONS)
        harness = KafkaHarness(tansu.bootstrap, settings_for(tansu.bootstrap, topic))
        yield harness
        await harness.close()


class TestKafkaKeyOrderingContract(BrokerContract):
    """The same contract with ``WORKER_KAFKA_ORDERING=key``."""

    @pytest.fixture
    async def harness(self, tansu: Tansu) -> AsyncIterator[Harness]:
        topic = unique("contract")
        await create_topic(tansu.bootstrap, topic, PARTITIONS)
        settings = settings_for(tansu.bootstrap, topic, ordering="key")
        harness = KafkaHarness(tansu.bootstrap, settings)
        yield harness
        await harness.close()


class BatchKafkaHarness(KafkaHarness):
    mode = BATCH_MODE


class TestKafkaBatchContract(BrokerContract):
    """The same contract in batch mode: batches of one partition's records."""

    @pytest.fixture
    async def harness(self, tansu: Tansu) -> AsyncIterator[Harness]:
        topic = unique("contract")
        await create_topic(tansu.bootstrap, topic, PARTITIONS)
        harness = BatchKafkaHarness(tansu.bootstrap, settings_for(tansu.bootstrap, topic))
        yield harness
        await harness.close()
