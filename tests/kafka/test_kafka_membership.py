"""A member the group dropped must not commit its stale offsets when it comes back (issue 15)."""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.kafka.kafka_helpers import (
    KafkaWorker,
    committed,
    credit,
    produce,
    transport_settings,
    worker_env,
)
from tests.support.database import marker_count
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer, KafkaSettings, membership

pytestmark = pytest.mark.kafka

Spawn = Callable[[dict[str, str], str], KafkaWorker]


def credits(start: int, stop: int) -> list[tuple[bytes | None, bytes, dict[str, str], int | None]]:
    return [(None, *credit(f"m{n}", "acct", "1"), 0) for n in range(start, stop)]


async def test_a_stalled_member_does_not_move_the_committed_offset_back(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    bootstrap: str,
    sqlite_template: Path,
    tmp_path: Path,
    spawn: Spawn,
) -> None:
    """Stall a worker (SIGSTOP) past the session timeout while it holds an uncommitted
    prefix; another member takes over, commits further and leaves the group empty. The
    stalled one wakes up, finds it was dropped (generation -1) and rejoins: its revoke
    callback must not commit the old prefix, which an empty group would accept."""
    topic = await new_topic(1)
    kafka = kafka_settings(topic, commit_interval=60)  # `a` holds its prefix uncommitted
    database = tmp_path / "a.db"
    shutil.copy(sqlite_template, database)
    url = f"sqlite+aiosqlite:///{database}"
    group = kafka.group_id
    await produce(bootstrap, topic, credits(0, 5))
    # one worker process: the SQLite inbox is not shared by replicas here
    a = spawn(worker_env(kafka, url, WORKER_ALLOW_SQLITE_WITH_NETWORK_BROKER="true"), "a")
    await wait_for(lambda: a.assigned(), 30, "a's assignment")
    await wait_for(lambda: _equals(marker_count(url), 5), 30, "a's five credits")
    assert await committed(bootstrap, group, topic, 1) == {0: -1}

    a.signal(signal.SIGSTOP)
    try:
        b = KafkaConsumer(transport_settings(), kafka_settings(topic, commit_interval=0.1))
        await b.start(prefetch=1)
        try:
            await produce(bootstrap, topic, credits(5, 10))
            for _ in range(10):  # the group dropped `a`: b reads everything from 0
                async with asyncio.timeout(30):
                    delivery = await b.receive()
                await delivery.ack()
            await wait_for(
                lambda: _equals(committed(bootstrap, group, topic, 1), {0: 10}), 10, "b's commit"
            )
        finally:
            await b.stop_receiving()
            await b.close()  # leaves: the group is empty now
    finally:
        a.signal(signal.SIGCONT)

    seen = []
    for _ in range(40):  # `a` heartbeats, learns it was dropped, rejoins, gets the partition
        seen.append((await committed(bootstrap, group, topic, 1))[0])
        if (
            a.logged("not committing for a lost membership")
            and len(a.events("partitions assigned")) > 1
        ):
            break
        await asyncio.sleep(0.25)
    assert min(seen) == 10, seen
    assert a.logged("not committing for a lost membership")
    a.signal(signal.SIGTERM)
    assert a.wait(30) == 0
    assert (await committed(bootstrap, group, topic, 1))[0] == 10


async def _equals(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


# -- what aiokafka keeps private about the group: one module reads it ------------------


async def test_aiokafka_still_holds_what_the_membership_module_reads(
    new_topic: Callable[[int], Awaitable[str]], kafka_settings: Callable[..., KafkaSettings]
) -> None:
    """aiokafka has no public accessor for the generation, the coordinator or a rejoin: an
    upgrade that moves its private group coordinator fails here, by name, instead of
    quietly making every commit "stale" and the member never ready."""
    topic = await new_topic(1)
    broker = KafkaConsumer(transport_settings(), kafka_settings(topic))
    assert membership.generation(None) == -1 and not membership.coordinator_known(None)
    await broker.start(prefetch=1)
    try:
        coordinator = getattr(broker._consumer, "_coordinator", None)
        assert coordinator is not None, "aiokafka moved AIOKafkaConsumer._coordinator"
        for name in ("generation", "coordinator_id", "request_rejoin"):
            assert hasattr(coordinator, name), f"aiokafka's coordinator lost {name!r}"
        await wait_for(lambda: broker.assignment, 30, "an assignment")
        assert membership.generation(broker._consumer) >= 0  # Tansu starts at 0, Kafka at 1
        assert membership.coordinator_known(broker._consumer)
        await wait_for(lambda: broker.ready, 30, "ready: fetching, the coordinator known")
        before = broker.stats["rebalances"]
        assert membership.request_rejoin(broker._consumer)
        await wait_for(lambda: broker.stats["rebalances"] > before, 30, "the rejoin's rebalance")
    finally:
        await broker.close()


def test_only_the_membership_module_touches_aiokafkas_private_coordinator() -> None:
    package = Path(__file__).resolve().parents[2] / "worker"
    readers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "_coordinator" in path.read_text()
    )
    assert readers == ["brokers/kafka/membership.py"]
