"""WORKER_KAFKA_ORDERING=key: one partition, several keys in parallel, each key in order.

Issue 14 item 2: same-key records observed in order, different keys overlapping in
time, commits contiguous, and the window per partition bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tests.kafka.kafka_helpers import MakeTopic, committed, consuming, produce
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer, KafkaSettings
from worker.delivery import Delivery

pytestmark = pytest.mark.kafka

Commits = list[dict[int, int]]


@contextlib.asynccontextmanager
async def started(
    kafka: KafkaSettings, commits: Commits | None = None
) -> AsyncIterator[KafkaConsumer]:
    async with consuming(kafka, prefetch=16) as broker:
        if commits is not None:  # record every offset commit the adapter sends
            real = broker._consumer.commit

            async def commit(offsets: dict[Any, int]) -> None:
                commits.append({tp.partition: o for tp, o in offsets.items()})
                await real(offsets)

            broker._consumer.commit = commit
        yield broker


def keyed(keys: str, partition: int = 0) -> list[tuple[bytes, bytes, dict[str, str], int]]:
    """One record per character of ``keys``, keyed by it, ids k<n> in produce order."""
    return [(k.encode(), b"{}", {"message-id": f"{k}{n}"}, partition) for n, k in enumerate(keys)]


async def run(
    broker: KafkaConsumer, workers: int, handle: Callable[[Delivery], Awaitable[None]], total: int
) -> list[Delivery]:
    """``workers`` concurrent loops (the pump's shape) until ``total`` settlements."""
    settled: list[Delivery] = []

    async def loop() -> None:
        while True:
            delivery = await broker.receive()
            await handle(delivery)
            if delivery.settled != "nacked":
                settled.append(delivery)

    tasks = [asyncio.create_task(loop()) for _ in range(workers)]
    try:
        await wait_for(lambda: len(settled) >= total, 30, f"{total} settlements")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return settled


async def test_keys_run_in_parallel_and_each_key_in_order(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(1)
    keys = "abcd" * 6
    await produce(bootstrap, topic, keyed(keys))
    commits: Commits = []
    spans: dict[str, tuple[float, float]] = {}
    running: set[bytes | None] = set()
    overlap = 0

    async def handle(delivery: Delivery) -> None:
        nonlocal overlap
        key = (delivery.message_id or "")[0].encode()
        assert key not in running, f"two records of key {key!r} at once"
        running.add(key)
        overlap = max(overlap, len(running))
        started_at = time.monotonic()
        await asyncio.sleep(0.05)
        running.discard(key)
        spans[delivery.message_id or ""] = (started_at, time.monotonic())
        await delivery.ack()

    kafka = kafka_settings(topic, ordering="key", commit_interval=0.05)
    async with started(kafka, commits) as broker:
        began = time.monotonic()
        await run(broker, 8, handle, len(keys))
        took = time.monotonic() - began
        await wait_for(lambda: commits and commits[-1] == {0: len(keys)}, 5, "the last commit")
    for key in "abcd":
        ids = sorted((m for m in spans if m[0] == key), key=lambda m: int(m[1:]))
        starts = [spans[m][0] for m in ids]
        assert starts == sorted(starts), f"key {key} out of order"
        assert all(spans[a][1] <= spans[b][0] for a, b in itertools.pairwise(ids))
    assert overlap == 4  # the four keys ran at once
    assert took < len(keys) * 0.05 / 2, took  # serial would take 1.2 s
    offsets = [c[0] for c in commits]
    assert offsets == sorted(offsets)
    assert await committed(bootstrap, kafka.group_id, topic, 1) == {0: len(keys)}


async def test_the_commit_waits_for_the_slowest_key_and_a_nack_holds_only_its_key(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(1)
    await produce(bootstrap, topic, keyed("abbbbbbabb"))  # a0 slow, a7 behind it
    commits: Commits = []
    order: list[tuple[str, int]] = []
    release = asyncio.Event()
    nacked = False

    async def handle(delivery: Delivery) -> None:
        nonlocal nacked
        message_id = delivery.message_id or ""
        order.append((message_id, delivery.delivery_count))
        if message_id == "a0":
            await release.wait()
        if message_id == "b3" and not nacked:
            nacked = True
            await delivery.nack(0.2)
            return
        await delivery.ack()

    kafka = kafka_settings(topic, ordering="key", commit_interval=0.05)
    async with started(kafka, commits) as broker:
        runner = asyncio.create_task(run(broker, 4, handle, 10))
        try:
            # every b settles, b3 after its backoff and before b4; a7 waits for a0
            def bs() -> list[str]:
                return [m for m, _ in order if m.startswith("b")]

            await wait_for(lambda: len(bs()) == 9, 10, "the b's")
            await asyncio.sleep(0.3)
            assert bs() == ["b1", "b2", "b3", "b3", "b4", "b5", "b6", "b8", "b9"], order
            assert ("a7", 1) not in order
            assert all(c[0] == 0 for c in commits), commits  # nothing past a0's offset
            release.set()
            await runner
        finally:
            release.set()
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await wait_for(lambda: commits and commits[-1] == {0: 10}, 5, "the commit of 10")
    b_ids = [m for m, _ in order if m.startswith("b")]
    assert b_ids == ["b1", "b2", "b3", "b3", "b4", "b5", "b6", "b8", "b9"]
    assert ("b3", 2) in order
    assert [m for m, _ in order if m.startswith("a")] == ["a0", "a7"]


async def test_the_window_behind_a_slow_key_is_bounded(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(1)
    await produce(bootstrap, topic, keyed("s" + "abcdefgh" * 10))  # s0 never settles here
    seen: list[str] = []
    hold: list[Delivery] = []

    async def handle(delivery: Delivery) -> None:
        seen.append(delivery.message_id or "")
        if delivery.message_id == "s0":
            hold.append(delivery)
            return
        await delivery.ack()

    kafka = kafka_settings(topic, ordering="key", max_buffered=20)
    async with started(kafka) as broker:
        runner = asyncio.create_task(run(broker, 4, handle, 81))
        try:
            await wait_for(lambda: len(seen) >= 15, 10, "records behind the slow one")
            await asyncio.sleep(1.0)  # fetch rounds enough to overfill an unbounded window
            (partition,) = broker._partitions.values()
            # only the first 20 of the window ran, whatever one fetch brought
            assert len(seen) == 20, seen
            assert partition.settled is None  # nothing committable past s0
            await hold[0].ack()
            await runner
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
    assert len(seen) == 81
