"""Helpers for the Kafka tests: settings for the Tansu test broker, topics, offsets, workers.

Tansu itself, waiting, queries and worker processes are shared: tests/support/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from decimal import Decimal
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # type: ignore[import-untyped]
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped]

from tests.support.credits import credit_body
from tests.support.processes import WorkerProcess, clean_env, free_port
from tests.support.tansu import tansu_binary
from worker.brokers.kafka import KafkaConsumer, KafkaSettings
from worker.delivery import Delivery
from worker.settings import Settings

# Test-broker quirks, in the tests only (see docs/kafka.md, "Testing"):
# - Tansu holds a group join for session_timeout/2, and a member that stops in
#   generation 0 does not leave the group (aiokafka skips LeaveGroup then), so
#   the next join waits a whole session timeout: keep both short.
# - its "latest" offset lookup is unreliable: new groups start at "earliest".
# - the idempotent producer fails on it: off.
TEST_QUIRKS: dict[str, Any] = {
    "session_timeout_ms": 2000,
    "heartbeat_interval_ms": 500,
    "auto_offset_reset": "earliest",
    "idempotent_producer": False,
}


# -- topics, records, offsets -----------------------------------------------------------


MakeTopic = Callable[[int], Awaitable[str]]
"""The ``new_topic`` fixture: ``await new_topic(partitions)``, a topic of the test's own."""


@contextlib.asynccontextmanager
async def consuming(
    kafka: KafkaSettings, settings: Settings | None = None, *, prefetch: int = 4
) -> AsyncIterator[KafkaConsumer]:
    """A started consumer without a pump: the test takes its deliveries with :func:`receive`."""
    broker = KafkaConsumer(settings or transport_settings(), kafka)
    await broker.start(prefetch=prefetch)
    try:
        yield broker
    finally:
        await broker.stop_receiving()
        await broker.close()


async def receive(broker: KafkaConsumer, seconds: float = 15.0) -> Delivery:
    async with asyncio.timeout(seconds):
        return await broker.receive()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def settings_for(bootstrap: str, topic: str, **overrides: Any) -> KafkaSettings:
    """Settings with short timings and the test-broker quirks; a fresh group unless given."""
    values: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "topics": topic,
        "group_id": unique("g"),
        "commit_interval": 0.1,
        "redelivery_delay": 0.05,
        "redelivery_delay_max": 0.5,
        "rebalance_grace": 5.0,
        **TEST_QUIRKS,
    }
    values.update(overrides)
    return KafkaSettings(**values)


async def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()


Record = tuple[bytes | None, bytes, dict[str, str], int | None]
"""key, value, headers, partition (None: by key)."""


async def produce(bootstrap: str, topic: str, records: Iterable[Record]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        pending = []
        for key, value, headers, partition in records:
            raw = [(name, content.encode()) for name, content in headers.items()]
            pending.append(
                await producer.send(topic, value, key=key, headers=raw, partition=partition)
            )
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


def credit(
    message_id: str | None, account: str, amount: Decimal | str, **headers: str
) -> tuple[bytes, dict[str, str]]:
    body = credit_body(account, amount)
    if message_id is not None:
        headers.setdefault("message-id", message_id)
    headers.setdefault("type", "CreditRequested")
    return body, headers


async def committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    """The group's committed offsets (-1: none), read with ``committed()``.

    Test-broker quirk: ``list_consumer_group_offsets`` fails on Tansu.
    """
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group)
    await consumer.start()
    try:
        result = {}
        for number in range(partitions):
            offset = await consumer.committed(TopicPartition(topic, number))
            result[number] = -1 if offset is None else offset
        return result
    finally:
        await consumer.stop()


async def committed_is(bootstrap: str, group: str, topic: str, offset: int) -> bool:
    """True when the group committed ``offset`` on the topic's only partition."""
    return (await committed(bootstrap, group, topic, 1)) == {0: offset}


async def read_all(
    bootstrap: str, topic: str, partitions: int, seconds: float = 10.0
) -> tuple[list[Any], dict[int, int]]:
    """Every record of ``topic`` and each partition's high watermark, without a group.

    Test-broker quirk: ``highwater()`` (from fetch responses) is right on Tansu
    where ``end_offsets()``/"latest" are not to be trusted.
    """
    tps = [TopicPartition(topic, n) for n in range(partitions)]
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    records: list[Any] = []
    try:
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + seconds
        seen: dict[Any, int] = {tp: 0 for tp in tps}
        while True:
            batches = await consumer.getmany(timeout_ms=200)
            for tp, batch in batches.items():
                records.extend(batch)
                seen[tp] = batch[-1].offset + 1
            marks = {tp: consumer.highwater(tp) for tp in tps}
            if not batches and all(m is not None and seen[tp] >= m for tp, m in marks.items()):
                return records, {tp.partition: marks[tp] for tp in tps}
            if time.monotonic() > deadline:
                pytest.fail(f"reading {topic} did not reach its high watermarks: {marks} {seen}")
    finally:
        await consumer.stop()


async def topic_records(bootstrap: str, topic: str) -> list[Any]:
    """Every record of ``topic``; none when the topic does not exist."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        exists = topic in await consumer.topics()
        partitions = len(consumer.partitions_for_topic(topic) or ()) if exists else 0
    finally:
        await consumer.stop()
    return (await read_all(bootstrap, topic, partitions))[0] if partitions else []


async def lag(bootstrap: str, group: str, topic: str, partitions: int) -> int:
    """High watermark minus committed offset, summed over the partitions."""
    _, marks = await read_all(bootstrap, topic, partitions)
    done = await committed(bootstrap, group, topic, partitions)
    return sum(marks[n] - max(done[n], 0) for n in range(partitions))


def header(record: Any, name: str) -> str | None:
    values = [v for k, v in record.headers if k == name]
    return values[-1].decode() if values else None


@contextlib.contextmanager
def authenticating_tansu() -> Iterator[str]:
    """A Tansu of its own that requires SASL (``--authentication``) and knows no user: every
    login is refused. Yields its bootstrap address; stopped by its PID."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    process = subprocess.Popen(
        [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url",
         url, "--storage-engine", "memory://tansu/", "--authentication", "--silent"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 15
        while True:
            assert process.poll() is None, f"tansu exited with {process.returncode}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"tansu did not listen on {port}"
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


# -- worker processes -------------------------------------------------------------------


def worker_env(settings: KafkaSettings, database_url: str, **extra: str) -> dict[str, str]:
    """The environment of a ``python -m worker.cli`` process consuming with ``settings``."""
    env = clean_env()
    for name, value in settings.model_dump(exclude_none=True).items():
        if name in settings.model_fields_set or name in TEST_QUIRKS:
            env[f"WORKER_KAFKA_{name.upper()}"] = (
                json.dumps(value) if isinstance(value, dict) else str(value)
            )
    env.update(
        WORKER_BROKER="kafka",
        WORKER_DATABASE_URL=database_url,
        WORKER_LOG_FORMAT="json",
        WORKER_CONCURRENCY="8",
        WORKER_GRACE_PERIOD="10",
    )
    env.update(extra)
    return env


class KafkaWorker(WorkerProcess):
    """A ``worker run`` process on Kafka: it logs each partition assignment."""

    def assigned(self) -> list[str]:
        """The partitions of its latest assignment ([] before the first)."""
        assignments = self.events("partitions assigned")
        return list(assignments[-1]["partitions"]) if assignments else []


def stats(worker: WorkerProcess) -> dict[str, Any]:
    """The outcome counts a worker logged when it stopped gracefully."""
    stopped = worker.events("pump stopped")
    assert stopped, f"{worker.log_path.name}: no 'pump stopped' line"
    return stopped[-1]


def transport_settings(**overrides: Any) -> Settings:
    """Settings for a test of the Kafka transport alone: delivery counts from the adapter
    (no database behind the consumer), and one record of a partition out at a time (the
    adapter's flow without groups), unless the test asks otherwise."""
    values: dict[str, Any] = {"delivery_counts": "broker", "batch_size": 1, **overrides}
    return Settings(**values)
