"""Kafka fixtures: one Tansu broker per test session, unique topics and groups per test."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kafka.kafka_helpers import Tansu, WorkerProcess, create_topic, settings_for, unique
from worker.brokers.kafka import KafkaSettings


@pytest.fixture(scope="session")
def tansu() -> Iterator[Tansu]:
    """An in-memory Tansu on a free loopback port, stopped (by PID) when the session ends."""
    broker = Tansu()
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


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
def spawn(tmp_path: Path) -> Iterator[Callable[[dict[str, str], str], WorkerProcess]]:
    """Start ``worker run`` processes; any still running at the end are killed by PID."""
    started: list[WorkerProcess] = []

    def start(env: dict[str, str], name: str) -> WorkerProcess:
        worker = WorkerProcess(env, tmp_path / f"{name}.log")
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()
