"""Batch mode on Kafka (WORKER_BATCH_SIZE): batches hold contiguous records of one
partition, and a failure in the middle of a batch keeps every commit below it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import pytest
from pydantic import BaseModel

from tests.kafka.kafka_helpers import committed, produce
from tests.support.database import fetch, marker_count
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer, KafkaSettings
from worker.db import create_engine
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]


class Step(BaseModel):
    tag: str


def step(tag: str) -> tuple[bytes | None, bytes, dict[str, str], int | None]:
    return (None, f'{{"tag": "{tag}"}}'.encode(), {"type": "Step"}, 0)


@pytest.mark.parametrize("offsets", ["broker", "database"])
async def test_commits_stay_contiguous_when_a_batch_fails_in_the_middle(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    postgres_only_url: str,
    offsets: str,
) -> None:
    url, topic = postgres_only_url, await new_topic(1)
    kafka = kafka_settings(topic, offsets=offsets, commit_interval=0.05, redelivery_delay=0.3)
    tags = ["s0", "s1", "bad", "s3", "s4", "s5"]
    await produce(kafka.bootstrap_servers, topic, [step(tag) for tag in tags])
    settings = Settings(database_url=url, batch_size=4, concurrency=2, retry_backoff=0.001)
    runs: list[tuple[str, float]] = []
    batches: list[tuple[int, Hashable]] = []
    registry = Registry()

    @registry.handler("Step", Step, consumer="step")
    async def run(ctx: Context, message: Step) -> None:
        runs.append((message.tag, time.monotonic()))
        if message.tag == "bad" and ctx.delivery_count == 1:
            raise RuntimeError("the middle of the batch fails once")

    engine = create_engine(url)
    broker = KafkaConsumer(settings, kafka)
    pump = Pump(broker, engine, registry, settings)
    commits: list[tuple[float, int]] = []
    stored: list[tuple[float, int]] = []
    original_receive = broker.receive

    async def receive() -> Any:
        delivery = await original_receive()
        batches.append((delivery._handle.record.offset, delivery.group))
        return delivery

    broker.receive = receive  # type: ignore[method-assign]
    task = asyncio.create_task(pump.run())

    async def watch() -> None:
        await pump.started.wait()
        real = broker._consumer.commit

        async def commit(offsets: dict[Any, int]) -> None:
            commits.extend((time.monotonic(), o) for o in offsets.values())
            await real(offsets)

        broker._consumer.commit = commit
        while True:
            rows = await fetch(url, "SELECT next_offset FROM consumer_offsets")
            if rows and rows[0][0] is not None:
                stored.append((time.monotonic(), int(rows[0][0])))
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        await wait_for(
            lambda: _is(committed(kafka.bootstrap_servers, kafka.group_id, topic, 1), {0: 6}),
            30,
            "the broker commit past the last record",
        )
        if offsets == "database":
            await wait_for(lambda: stored and stored[-1][1] == 6, 10, "the stored offset at 6")
    finally:
        watcher.cancel()
        pump.stop()
        await task
        await engine.dispose()

    assert {group for _, group in batches} == {(topic, 0)}
    assert [offset for offset, _ in batches[:4]] == [0, 1, 2, 3]  # one batch of four
    bad_done = [at for tag, at in runs if tag == "bad"][-1]  # its successful run
    assert [tag for tag, _ in runs].count("bad") == 2
    ahead = [(at, o) for at, o in commits + stored if o > 2 and at < bad_done]
    assert not ahead, f"committed past the failed record before it was done: {ahead}"
    assert max(o for _, o in commits) == 6
    assert await marker_count(url) == 6  # each record applied once
    if offsets == "database":
        assert any(o == 2 for _, o in stored)  # the batch stored its prefix, not its end


async def _is(value: Awaitable[object], expected: object) -> bool:
    return await value == expected
