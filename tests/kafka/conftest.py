"""Kafka fixtures: unique topics and groups per test on the session's Tansu broker.

The ``tansu`` fixture itself is in tests/conftest.py (the contract suite uses it too).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kafka.kafka_helpers import KafkaWorker, create_topic, settings_for, unique
from tests.support.tansu import Tansu
from worker.brokers.kafka import KafkaSettings


@pytest.fixture
def bootstrap(tansu: Tansu) -> str:
    return tansu.bootstrap


@pytest.fixture
def new_topic(bootstrap: str) -> Callable[[int], Awaitable[str]]:
    """Create a topic unique to the test with ``partitions`` partitions."""

    async def make(partitions: int) -> str:
        name = unique("t")
        await create_topic(bootstrap, name, partitions)
        return name

    return make


@pytest.fixture
def kafka_settings(bootstrap: str) -> Callable[..., KafkaSettings]:
    """Settings for ``topic`` with a group unique to the test and the test-broker quirks."""
    group = unique("g")

    def make(topic: str, **overrides: Any) -> KafkaSettings:
        overrides.setdefault("group_id", group)
        return settings_for(bootstrap, topic, **overrides)

    return make


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[[dict[str, str], str], KafkaWorker]]:
    """Start ``worker run`` processes; any still running at the end are killed by PID."""
    started: list[KafkaWorker] = []

    def start(env: dict[str, str], name: str) -> KafkaWorker:
        worker = KafkaWorker(env, tmp_path / f"{name}.log")
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()
