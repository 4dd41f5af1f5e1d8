"""A record that kills the process takes only itself to the dead-letter topic (Kafka, Tansu).

One ``worker run`` consumer-group member, restarted each time it dies, over a few hundred
valid credits and a record whose handler ends the process at once. Kafka counts nothing:
the member reserves the offsets it may start (``consumer_offsets.started_through``), the
next owner hands those out as suspects, and the worker counts their starts durably; a
suspect that comes back after a counted start runs alone. So the killer is dead-lettered
after exactly WORKER_MAX_DELIVERIES deaths, and no valid record is.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path

import pytest

from tests.kafka.kafka_helpers import (
    KafkaWorker,
    Record,
    credit,
    header,
    lag,
    produce,
    topic_records,
)
from tests.kafka.kafka_helpers import worker_env as kafka_env
from tests.support.database import balances, scalar
from worker.brokers.kafka import KafkaSettings
from worker.brokers.kafka.records import DLT_MESSAGE_ID

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(500)]

Spawn = Callable[[dict[str, str], str], KafkaWorker]
VALID = 200
MAX_DELIVERIES = 5
PARTITIONS = 3


@pytest.mark.parametrize(
    ("batch_size", "killers"),
    [(1, ["kill-1"]), (16, ["kill-1", "kill-2"])],
    ids=["per-message", "batch-two-killers"],
)
async def test_a_killer_record_is_dead_lettered_alone_after_max_deliveries_deaths(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    postgres_only_url: str,
    spawn: Spawn,
    tmp_path: Path,
    batch_size: int,
    killers: list[str],
) -> None:
    url, topic = postgres_only_url, await new_topic(PARTITIONS)
    kafka = kafka_settings(topic)
    deaths_file = tmp_path / "deaths"
    env = kafka_env(
        kafka, url, WORKER_HANDLERS="tests.support.killer_handlers",
        WORKER_CONCURRENCY="16", WORKER_MAX_DELIVERIES=str(MAX_DELIVERIES),
        WORKER_BATCH_SIZE=str(batch_size), WORKER_GRACE_PERIOD="5",
        WORKER_TEST_KILLERS=",".join(killers), WORKER_TEST_DEATHS=str(deaths_file),
    )  # fmt: skip
    records: list[Record] = []
    for n in range(VALID):
        body, headers = credit(f"ok-{n:03d}", f"acct-{n % 10}", "1.00", type="Credit")
        records.append((f"acct-{n % 10}".encode(), body, headers, n % PARTITIONS))
    for index, killer in enumerate(killers):
        body, headers = credit(killer, "x", "1", type="Credit")
        records.insert((index + 1) * VALID // (len(killers) + 1), (b"x", body, headers, index))
    await produce(kafka.bootstrap_servers, topic, records)
    worker = spawn(env, "w-0")
    restarts = 0
    deadline = time.monotonic() + 420
    while True:
        applied = await scalar(url, "SELECT count(*) FROM inbox WHERE message_id LIKE 'ok-%'")
        letters = await topic_records(kafka.bootstrap_servers, f"{topic}.DLT")
        if (
            applied == VALID
            and len(letters) >= len(killers)
            and await lag(kafka.bootstrap_servers, kafka.group_id, topic, PARTITIONS) == 0
        ):
            break
        if time.monotonic() > deadline:
            pytest.fail(f"{applied}/{VALID} applied, {len(letters)} dead after {restarts} deaths")
        if worker.process.poll() is not None:
            restarts += 1
            worker = spawn(env, f"w-{restarts}")
        await asyncio.sleep(0.3)
    worker.signal(signal.SIGTERM)
    await asyncio.to_thread(worker.wait, 30)
    deaths = Counter(line.split()[0] for line in deaths_file.read_text().splitlines())
    dead = sorted(str(header(letter, DLT_MESSAGE_ID)) for letter in letters)
    report = {"deaths": dict(deaths), "restarts": restarts, "dead letters": dead}
    print(f"\nkafka killer ({batch_size=}, {killers=}): {report}")
    # no valid record dead-lettered, every killer dead-lettered; a killer may be there twice
    # when a death (the other killer's) fell between its dead letter and its offset's commit
    # (docs/kafka.md, "dead-letter")
    assert sorted(set(dead)) == sorted(killers), report
    assert len(dead) <= 2 * len(killers), report
    assert await balances(url) == {f"acct-{n}": Decimal(VALID // 10) for n in range(10)}
    if batch_size == 1 or len(killers) == 1:  # each killer: exactly WORKER_MAX_DELIVERIES
        assert deaths == dict.fromkeys(killers, MAX_DELIVERIES), report
    else:  # a batch is one unit of work: a killer in the batch another killer took down
        # spent that count as its bystander, and goes one death earlier
        assert all(MAX_DELIVERIES - 1 <= deaths[k] <= MAX_DELIVERIES for k in killers), report
    assert restarts <= sum(deaths.values()), report
