"""Real ``worker run`` processes on Kafka (Tansu) and PostgreSQL: crashes, rebalances, restarts.

Each test asserts at-least-once delivery and exactly-once effects: every
unique message id has exactly one inbox row, every balance is exact, and the
group's committed offsets reach the high watermarks.
"""

from __future__ import annotations

import asyncio
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
    Record,
    committed,
    credit,
    lag,
    produce,
    stats,
    topic_records,
    worker_env,
)
from tests.support.database import balances, marker_count, scalar
from tests.support.processes import WorkerProcess, arun_cli
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaSettings

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]

Spawn = Callable[[dict[str, str], str], KafkaWorker]


class Stream:
    """Credits to produce, with the expected balance of every account."""

    def __init__(self, seed: int, accounts: int, partitions: int) -> None:
        self.rng = random.Random(seed)
        self.accounts = accounts
        self.partitions = partitions
        self.expected: defaultdict[str, Decimal] = defaultdict(Decimal)
        self.ids: set[str] = set()
        self.copies = 0

    def batch(self, start: int, count: int, duplicates: float) -> list[Record]:
        """``count`` credits; a share of them produced twice under the same message id.

        The second copy goes to a random partition, so another worker may take it
        while the first is still in flight (a producer retry after a timeout).
        """
        records: list[Record] = []
        for n in range(start, start + count):
            account = f"acct-{n % self.accounts:02d}"
            amount = Decimal(self.rng.randint(1, 99_999)) / 100
            message_id = f"credit-{n:05d}"
            body, headers = credit(message_id, account, amount)
            records.append((account.encode(), body, headers, None))
            if self.rng.random() < duplicates:
                elsewhere = self.rng.randrange(self.partitions)
                records.append((account.encode(), body, headers, elsewhere))
            self.expected[account] += amount
            self.ids.add(message_id)
        self.copies += len(records)
        return records

    def lines(self, start: int, count: int) -> str:
        """The same credits (no duplicates) as ``worker publish`` input."""
        out = []
        for _, body, headers, _ in self.batch(start, count, duplicates=0.0):
            item = {"id": headers["message-id"], "type": headers["type"], "body": json.loads(body)}
            out.append(json.dumps(item))
        return "\n".join(out) + "\n"


async def assert_exactly_once(url: str, stream: Stream) -> None:
    assert await balances(url) == dict(stream.expected)
    assert await marker_count(url) == len(stream.ids)
    assert await scalar(url, "SELECT count(DISTINCT message_id) FROM inbox") == len(stream.ids)


async def drained(kafka: KafkaSettings, topic: str, partitions: int, url: str, n: int) -> bool:
    if await marker_count(url) < n:
        return False
    return await lag(kafka.bootstrap_servers, kafka.group_id, topic, partitions) == 0


async def stop(worker: WorkerProcess, sig: signal.Signals = signal.SIGTERM) -> int:
    """Signal one worker and wait (in a thread: the test's producer keeps going) for its exit."""
    worker.signal(sig)
    return await asyncio.to_thread(worker.wait, 30)


async def test_sigkill_between_database_commit_and_offset_commit(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    postgres_only_url: str,
    spawn: Spawn,
    tmp_path: Path,
) -> None:
    url, partitions = postgres_only_url, 2
    topic = await new_topic(partitions)
    stream = Stream(seed=5, accounts=4, partitions=partitions)
    kafka = kafka_settings(topic)
    bootstrap = kafka.bootstrap_servers
    source = tmp_path / "credits.jsonl"
    source.write_text(stream.lines(0, 40))
    published = await arun_cli(worker_env(kafka, url), "publish", str(source))
    assert published.returncode == 0 and "published 40 messages" in published.stderr

    # The first worker never reaches an offset commit: every record is committed
    # to the database, and then the process dies before Kafka hears of it.
    never = kafka_settings(topic, commit_interval=3600)
    first = spawn(worker_env(never, url), "first")
    await wait_for(lambda: _at_least(url, 40), 60, "the first worker's database commits")
    assert await stop(first, signal.SIGKILL) == -signal.SIGKILL
    assert await committed(bootstrap, never.group_id, topic, partitions) == {0: -1, 1: -1}

    second = spawn(worker_env(kafka, url), "second")
    await wait_for(lambda: drained(kafka, topic, partitions, url, 40), 60, "lag 0", step=0.5)
    assert await stop(second) == 0
    counts = stats(second)
    assert counts.get("duplicate") == 40  # every record came again; the inbox caught them all
    assert "committed" not in counts
    await assert_exactly_once(url, stream)


async def _at_least(url: str, rows: int) -> bool:
    return await marker_count(url) >= rows


@pytest.mark.parametrize("ordering", ["partition", "key"])
async def test_workers_joining_and_leaving_mid_stream(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    postgres_only_url: str,
    spawn: Spawn,
    ordering: str,
) -> None:
    url, partitions = postgres_only_url, 6
    topic = await new_topic(partitions)
    kafka = kafka_settings(topic, ordering=ordering)  # records are keyed by account
    stream = Stream(seed=11, accounts=12, partitions=partitions)
    env = worker_env(kafka, url)
    first = spawn(env, "a")
    await wait_for(lambda: len(first.assigned()) == partitions, 30, "the first assignment")

    done = asyncio.Event()

    async def producing() -> None:  # about 100 credits a second until the churn is over
        n = 0
        while not done.is_set() and n < 3000:
            await produce(kafka.bootstrap_servers, topic, stream.batch(n, 10, duplicates=0.15))
            n += 10
            await asyncio.sleep(0.1)

    producer = asyncio.create_task(producing())
    try:
        second = spawn(env, "b")
        await wait_for(second.assigned, 30, "b's assignment")
        third = spawn(env, "c")
        await wait_for(third.assigned, 30, "c's assignment")
        assert await stop(second) == 0
        await asyncio.sleep(1.0)
        assert await stop(third) == 0
        await wait_for(lambda: len(first.assigned()) == partitions, 30, "a owns all again")
        await asyncio.sleep(0.5)
        assert not producer.done(), "the stream ended before the churn did"
    finally:
        done.set()
        await producer

    await wait_for(
        lambda: drained(kafka, topic, partitions, url, len(stream.ids)), 60, "lag 0", step=0.5
    )
    assert await stop(first) == 0
    await assert_exactly_once(url, stream)
    counts = [stats(w) for w in (first, second, third)]
    assert all(c.get("committed", 0) > 0 for c in counts), counts  # each one did some work
    # exactly-once effects: one database commit per unique id, whoever made it
    assert sum(c.get("committed", 0) for c in counts) == len(stream.ids)
    # at-least-once delivery: every copy produced was handled at least once
    handled = sum(c.get("committed", 0) + c.get("duplicate", 0) for c in counts)
    assert handled >= stream.copies


@pytest.mark.slow
@pytest.mark.timeout(400)  # three processes, two rebalances and a kill, on a 2-core machine
async def test_acceptance_three_workers_5000_credits_a_kill_and_a_stop(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    postgres_only_url: str,
    spawn: Spawn,
) -> None:
    url, partitions, credits = postgres_only_url, 8, 5000
    topic = await new_topic(partitions)
    kafka = kafka_settings(topic)
    stream = Stream(seed=2026, accounts=20, partitions=partitions)
    env = worker_env(kafka, url)
    workers = [spawn(env, name) for name in ("a", "b", "c")]
    await wait_for(
        lambda: sum(len(w.assigned()) for w in workers) == partitions, 60, "three members"
    )
    for start in range(0, credits, 500):
        await produce(kafka.bootstrap_servers, topic, stream.batch(start, 500, duplicates=0.2))
    duplicates = stream.copies - credits
    assert 900 <= duplicates <= 1100

    a, b, c = workers
    await wait_for(lambda: _at_least(url, credits // 3), 120, "a third processed", step=0.2)
    assert await stop(b, signal.SIGKILL) == -signal.SIGKILL
    restarted = spawn(env, "b-restarted")
    await wait_for(lambda: _at_least(url, 2 * credits // 3), 120, "two thirds", step=0.2)
    assert await stop(c) == 0
    await wait_for(lambda: drained(kafka, topic, partitions, url, credits), 180, "lag 0", step=0.5)
    assert await stop(a) == 0 and await stop(restarted) == 0

    await assert_exactly_once(url, stream)
    assert await lag(kafka.bootstrap_servers, kafka.group_id, topic, partitions) == 0
    assert await topic_records(kafka.bootstrap_servers, f"{topic}.DLT") == []
    survivors: list[dict[str, Any]] = [stats(w) for w in (a, c, restarted)]
    assert sum(s.get("dead-letter", 0) for s in survivors) == 0
