"""A member the group dropped must not commit its stale offsets when it comes back (issue 15)."""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.kafka.kafka_helpers import KafkaWorker, committed, credit, produce, worker_env
from tests.support.database import marker_count
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer, KafkaSettings
from worker.settings import Settings

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
        b = KafkaConsumer(Settings(), kafka_settings(topic, commit_interval=0.1))
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
