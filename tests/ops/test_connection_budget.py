"""The connection budget counts every engine a worker pod really opens.

``connections_per_pod`` (tests/ops/deploy_helpers.py) is the formula docs/operations.md
states and the kustomize and chart checks use. These tests run the code that opens the
engines (``worker run``'s start-up, the inbox monitor, the Kafka consumer with database
offsets) with ``worker.db.create_engine`` recorded, and compare what they asked for
with what the formula counts. No connection is made: every database here is unreachable.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

import pytest

from tests.ops.deploy_helpers import connections_per_pod
from worker import db
from worker.errors import BrokerUnavailable
from worker.settings import Settings

NOWHERE = "postgresql+asyncpg://worker:secret@127.0.0.1:1/worker"


class Recorder:
    """``worker.db.create_engine``, recording (pool_size, max_overflow) of every engine."""

    def __init__(self) -> None:
        self.engines: list[tuple[int, int]] = []
        self._real = db.create_engine

    def __call__(self, url: str, *, pool_size: int = 5, max_overflow: int | None = None) -> Any:
        engine = self._real(url, pool_size=pool_size, max_overflow=max_overflow)
        pool: Any = engine.sync_engine.pool
        self.engines.append((pool.size(), pool._max_overflow))
        return engine


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorded = Recorder()
    monkeypatch.setattr(db, "create_engine", recorded)
    # the Kafka store binds the name when it is first imported (perhaps by an earlier test)
    monkeypatch.setattr("worker.brokers.kafka.store.create_engine", recorded)
    for name in [n for n in os.environ if n.startswith("WORKER_")]:
        monkeypatch.delenv(name)
    return recorded


def test_the_pump_engine_is_pool_plus_overflow(recorder: Recorder) -> None:
    from worker.cli import _run

    env = {"WORKER_CONCURRENCY": "8", "WORKER_DB_POOL_SIZE": "10", "WORKER_DB_MAX_OVERFLOW": "1"}
    settings = Settings(
        database_url=NOWHERE,
        concurrency=8,
        db_pool_size=10,
        db_max_overflow=1,
        handlers="handlers",
        start_timeout=0,  # no retries of the start: it fails at once
    )
    with pytest.raises(OSError):  # the database does not answer (`worker run` exits 1)
        asyncio.run(_run(settings))
    assert recorder.engines == [(10, 1)]
    assert connections_per_pod(env, "memory") == {"pump": 11}


def test_the_inbox_monitor_holds_one_connection(recorder: Recorder) -> None:
    from worker.metrics import InboxMonitor

    async def start_and_stop() -> None:
        monitor = InboxMonitor(NOWHERE, timedelta(days=1), interval=3600)
        await monitor.start()
        await monitor.stop()

    asyncio.run(start_and_stop())
    # pool_size 1; the overflow SQLAlchemy allows is never used: one poll at a time
    [(pool, _overflow)] = recorder.engines
    assert pool == 1
    assert connections_per_pod({"WORKER_OPS_PORT": "8080"}, "rabbitmq")["inbox-monitor"] == pool


@pytest.mark.parametrize(
    "variable", [("WORKER_KAFKA_OFFSETS", "database"), ("WORKER_DELIVERY_COUNTS", "database")]
)
def test_kafka_database_offsets_open_an_engine_of_four(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch, variable: tuple[str, str]
) -> None:
    from worker.brokers import open_broker

    monkeypatch.setenv("WORKER_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("WORKER_KAFKA_TOPICS", "work")
    monkeypatch.setenv("WORKER_KAFKA_GROUP_ID", "worker")
    monkeypatch.setenv(*variable)
    counts = "database" if variable[0] == "WORKER_DELIVERY_COUNTS" else "broker"
    settings = Settings(database_url=NOWHERE, broker="kafka", delivery_counts=counts)
    broker: Any = open_broker(settings)

    async def start() -> None:
        with pytest.raises(BrokerUnavailable):
            await broker.start(prefetch=1)  # the engine first, then the unreachable brokers

    asyncio.run(start())
    assert recorder.engines == [(2, 2)]
    counted = connections_per_pod(dict([variable]), "kafka")
    assert counted["kafka-offsets"] == 2 + 2
    # the counts default to the database: a second engine unless both are the broker's
    assert connections_per_pod({}, "kafka")["kafka-offsets"] == 2 + 2
    both_broker = {"WORKER_KAFKA_OFFSETS": "broker", "WORKER_DELIVERY_COUNTS": "broker"}
    assert "kafka-offsets" not in connections_per_pod(both_broker, "kafka")
    assert "kafka-offsets" not in connections_per_pod(dict([variable]), "rabbitmq")
