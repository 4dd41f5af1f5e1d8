"""Real ``worker run`` processes on Kafka (Tansu) and PostgreSQL with offsets and delivery
counts in the database: SIGKILLs, a database outage, and a record that kills its worker.

The database outage is a loopback proxy between the workers and PostgreSQL that the
test cuts and restores (tests/support/proxy.py): the shared server is never restarted.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import signal
from collections import defaultdict
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.kafka.kafka_helpers import (
    KafkaWorker,
    credit,
    header,
    produce,
    read_all,
    topic_records,
    worker_env,
)
from tests.support.database import balances, fetch, marker_count, scalar
from tests.support.proxy import proxied
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaSettings

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

Spawn = Callable[[dict[str, str], str], KafkaWorker]


async def stored(url: str, group: str) -> dict[int, int]:
    rows = await fetch(
        url, f"SELECT partition, next_offset FROM consumer_offsets WHERE group_id = '{group}'"
    )
    return {int(row[0]): int(row[1]) for row in rows if row[1] is not None}


async def kill(worker: KafkaWorker) -> None:
    worker.signal(signal.SIGKILL)
    assert await asyncio.to_thread(worker.wait, 10) == -signal.SIGKILL


async def test_offsets_in_the_database_three_workers_kills_and_a_database_outage(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    postgres_only_url: str,
    spawn: Spawn,
) -> None:
    """Credits without message ids (their coordinates are their identity), three workers,
    two SIGKILLs and a cut between the workers and PostgreSQL while the stream goes on:
    every record applied exactly once, and the stored offsets equal the end offsets."""
    url, partitions, chunks, size = postgres_only_url, 4, 6, 100
    total = chunks * size
    topic = await new_topic(partitions)
    kafka = kafka_settings(topic, offsets="database", commit_interval=0.2)
    proxy, through_proxy = await proxied(url)
    env = worker_env(kafka, through_proxy, WORKER_DB_PROBE_BACKOFF_MAX="0.5")
    rng = random.Random(14)
    expected: defaultdict[str, Decimal] = defaultdict(Decimal)

    def chunk() -> list[Any]:
        out = []
        for _ in range(size):
            account = f"acct-{rng.randrange(12):02d}"
            amount = Decimal(rng.randint(1, 99_999)) / 100
            expected[account] += amount
            body, headers = credit(None, account, amount)  # no message-id header
            out.append((account.encode(), body, headers, None))
        return out

    live = {name: spawn(env, name) for name in ("a", "b", "c")}
    await wait_for(
        lambda: sum(len(w.assigned()) for w in live.values()) == partitions, 60, "three members"
    )
    try:
        for n in range(chunks):
            await produce(kafka.bootstrap_servers, topic, chunk())
            half = (n + 1) * size // 2
            if n == 1:  # a dies mid-stream with work in flight; its pod comes back
                await wait_for(functools.partial(_at_least, url, half), 60, "progress", step=0.1)
                await kill(live.pop("a"))
                live["a2"] = spawn(env, "a2")
                await started(live["a2"])
            elif n == 3:  # the database goes away for everyone, and comes back
                await wait_for(functools.partial(_at_least, url, half), 60, "progress", step=0.1)
                await proxy.cut()
                await asyncio.sleep(2.0)
                await proxy.start()
            elif n == 4:
                await wait_for(functools.partial(_at_least, url, half), 60, "progress", step=0.1)
                await kill(live.pop("b"))
                live["b2"] = spawn(env, "b2")
                await started(live["b2"])
        _, marks = await read_all(kafka.bootstrap_servers, topic, partitions)
        assert sum(marks.values()) == total
        await wait_for(
            lambda: _equals(stored(url, kafka.group_id), marks), 90, "stored = end", step=0.5
        )
        for worker in live.values():
            worker.signal(signal.SIGTERM)
        for worker in live.values():
            assert await asyncio.to_thread(worker.wait, 30) == 0
    finally:
        await proxy.cut()

    assert await balances(url) == dict(expected)
    assert await marker_count(url) == total  # one marker per record: its coordinates
    assert await scalar(url, "SELECT count(DISTINCT message_id) FROM inbox") == total
    assert await stored(url, kafka.group_id) == marks


async def started(worker: KafkaWorker) -> None:
    """Up and consuming (a worker that finds no database at start exits, by design)."""
    await wait_for(lambda: worker.logged("pump started"), 30, f"{worker.log_path.name} up")


def _ended_or_dead_lettered(worker: KafkaWorker) -> bool:
    return worker.process.poll() is not None or worker.logged("dead-lettered")


async def _at_least(url: str, rows: int) -> bool:
    return await marker_count(url) >= rows


async def _equals(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


def step(tag: str) -> tuple[bytes | None, bytes, dict[str, str], int | None]:
    return (None, json.dumps({"tag": tag}).encode(), {"type": "Step"}, 0)


@pytest.mark.parametrize(("offsets", "limit"), [("database", 3), ("broker", 2)])
async def test_a_record_that_kills_its_worker_is_dead_lettered_after_max_deliveries(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    postgres_only_url: str,
    spawn: Spawn,
    tmp_path: Path,
    offsets: str,
    limit: int,
) -> None:
    """The third record SIGKILLs whichever worker runs it. Restarted worker after worker
    (as an orchestrator would), it runs exactly WORKER_MAX_DELIVERIES times, then the
    next worker dead-letters it without running it, and goes on with the next record."""
    url, topic = postgres_only_url, await new_topic(1)
    kafka = kafka_settings(topic, offsets=offsets, commit_interval=0.2)
    await produce(kafka.bootstrap_servers, topic, [step("ok-0"), step("ok-1"), step("boom")])
    runs = tmp_path / "runs.txt"
    env = worker_env(
        kafka,
        url,
        WORKER_HANDLERS="tests.kafka.crash_handlers",
        WORKER_DELIVERY_COUNTS="database",
        WORKER_MAX_DELIVERIES=str(limit),
        CRASH_RUNS=str(runs),
    )
    survivor = None
    for attempt in range(limit + 3):  # bounded: without durable counts it never ends
        worker = spawn(env, f"w{attempt}")
        await wait_for(
            functools.partial(_ended_or_dead_lettered, worker),
            30,
            "the worker to die or to dead-letter",
            step=0.1,
        )
        if worker.process.poll() is None:
            survivor = worker
            break
        assert worker.process.returncode == -signal.SIGKILL
    booms = runs.read_text().split().count("boom")
    assert survivor is not None, f"still crashing after {limit + 3} workers ({booms} runs)"
    assert booms == limit
    await produce(kafka.bootstrap_servers, topic, [step("ok-3")])
    await wait_for(lambda: _at_least(url, 3), 30, "ok-0, ok-1 and ok-3")
    survivor.signal(signal.SIGTERM)
    assert await asyncio.to_thread(survivor.wait, 30) == 0

    letters = await topic_records(kafka.bootstrap_servers, f"{topic}.DLT")
    assert [header(r, "dlt-original-offset") for r in letters] == ["2"]
    reason = header(letters[0], "dlt-reason") or ""
    assert f"WORKER_MAX_DELIVERIES={limit}" in reason, reason
    assert runs.read_text().split().count("boom") == limit  # dead-lettered without a run
    rows = await fetch(url, "SELECT message_id, deliveries FROM delivery_counts")
    assert {row[0]: row[1] for row in rows}.get(f"{topic}/0/2") == limit
