"""Copies of one message, delivered at the same moment to replicas on either side of a
partition boundary, end with exactly one marker and one business effect: the argument in
worker/partitions.py, under real concurrency.

Three replica processes (two pumps per message, one in batch mode) are given the same
message ids at the same moment (partition_racer.py). Partitions are one second long and a
handler keeps its transaction open for up to 0.8 s, so a copy often reaches its marker
while another replica's copy is still uncommitted in the previous second's partition:
the test counts those crossings and insists on enough of them. Some handlers fail after
their marker went in, so a waiting copy also sees the first one roll back. Meanwhile the
replicas' housekeeping loops attach a partition about every second, and a fourth process
attaches and drops empty partitions years ahead, so the lookups are re-planned under
ATTACH and DROP all along. Without the trigger the same race commits copies twice.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.support.database import execute, fetch, own_database
from tests.support.processes import REPO, json_env
from worker import partitions, retention, rollover
from worker.db import create_engine
from worker.migrate import upgrade

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

MESSAGES = 200
REPLICAS = 3
SECOND = timedelta(seconds=1)  # the partition period
AHEAD = 90  # seconds of partitions made before the race
CROSSINGS = 10  # at least this many copies must have waited across a boundary
RUN_TIMEOUT = 240.0


@pytest.fixture
def race_url() -> Iterator[str]:
    with own_database("worker_race") as url:
        upgrade(url, inbox_layout="partitioned", partition_period=SECOND)
        asyncio.run(prepare(url))
        yield url


async def prepare(url: str) -> None:
    """The effects table, and a partition for every second of the race, made beforehand:
    with one-second partitions a pass that waits a second for its lock is a second late,
    and markers would go to DEFAULT (correct, but no boundary between them)."""
    await execute(
        url,
        "CREATE TABLE race_effects (message_id text NOT NULL, replica int NOT NULL, "
        "written_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    engine = create_engine(url, pool_size=2)
    try:
        async with engine.connect() as connection:
            now = await retention.database_now(connection)
            until = now + timedelta(seconds=AHEAD)
            while True:
                made = rollover.Pass()
                await rollover.make_ahead(connection, SECOND, until, now, made)
                if not made.created:
                    break
    finally:
        await engine.dispose()


def environment(url: str, replica: int) -> dict[str, str]:
    variables = {
        "WORKER_DATABASE_URL": url,
        "WORKER_INBOX_LAYOUT": "partitioned",
        "WORKER_INBOX_PARTITION_PERIOD": "PT1S",
        # a redelivery window of 18 s, markers kept 50 s: longer than the race
        "WORKER_BROKER_LOCK_TIMEOUT": "PT1S",
        "WORKER_MAX_DELIVERIES": "8",
        "WORKER_MESSAGE_TTL": "PT10S",
        "WORKER_DEAD_LETTER_MARGIN": "PT0S",
        "WORKER_INBOX_RETENTION": "PT50S",
        "WORKER_PURGE_INTERVAL": "0.5",
        "WORKER_CONCURRENCY": "8",
        "WORKER_RETRY_BACKOFF": "0.005",
        "WORKER_RETRY_BACKOFF_MAX": "0.05",
        "WORKER_LOG_LEVEL": "WARNING",
    }
    # one replica in groups of at most 6, the others one delivery at a time
    variables.update(WORKER_BATCH_SIZE="6" if replica == REPLICAS - 1 else "1")
    return json_env(variables)


def race(
    url: str, tmp_path: Path
) -> tuple[list[dict[str, Any]], list[dict[str, int]], dict[str, int]]:
    """Run the replicas and the churn to the end: (stage records, broker tallies, churn)."""
    start_at = time.time() + 3.0  # every replica up and consuming by then
    module = [sys.executable, "-m", "tests.concurrency.partition_racer"]
    outs = [tmp_path / f"replica-{n}.jsonl" for n in range(REPLICAS)]
    churned = tmp_path / "churn.json"
    logs = [tmp_path / f"process-{n}.log" for n in range(REPLICAS + 1)]
    commands = [
        [*module, "replica", str(n), str(MESSAGES), str(start_at), str(outs[n])]
        for n in range(REPLICAS)
    ]
    commands.append([*module, "churn", "20", str(churned)])
    processes = []
    # logs to files: a full pipe would stop a replica with its transaction open, and the
    # others would wait for its marker (blocking is the feature) until the timeout
    for n, command in enumerate(commands):
        with logs[n].open("w") as log:
            processes.append(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=environment(url, min(n, REPLICAS - 1) if n < REPLICAS else 0),
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        for n, process in enumerate(processes):
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert process.returncode == 0, logs[n].read_text()[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()  # only our own, by its PID
                process.wait(timeout=10)
    records: list[dict[str, Any]] = []
    tallies: list[dict[str, int]] = []
    for out in outs:
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        tallies.append(lines[-1]["stats"])
        records.extend(lines[:-1])
    return records, tallies, json.loads(churned.read_text())


async def outcome_in_database(
    url: str,
) -> tuple[dict[str, tuple[int, float]], dict[str, tuple[int, float]]]:
    """Per message id: (markers, first stored_at) and (effects, first written_at), epoch s."""
    markers = await fetch(
        url,
        "SELECT message_id, count(*), extract(epoch FROM min(stored_at))::float8 "
        "FROM inbox GROUP BY 1",
    )
    effects = await fetch(
        url,
        "SELECT message_id, count(*), extract(epoch FROM min(written_at))::float8 "
        "FROM race_effects GROUP BY 1",
    )
    return {m: (n, at) for m, n, at in markers}, {m: (n, at) for m, n, at in effects}


def crossings(
    records: list[dict[str, Any]],
    markers: dict[str, tuple[int, float]],
    effects: dict[str, tuple[int, float]],
) -> int:
    """Duplicates that started while the winner's transaction was open (after its marker,
    before its effect's write, just ahead of its commit), in another second's partition."""
    found = 0
    for record in records:
        if record["outcome"] != "duplicate" or record["message_id"] not in effects:
            continue
        stored = markers[record["message_id"]][1]
        written = effects[record["message_id"]][1]
        if stored < record["start"] < written and math.floor(record["start"]) != math.floor(stored):
            found += 1
    return found


async def test_copies_on_either_side_of_a_boundary_end_with_one_marker_and_one_effect(
    race_url: str, tmp_path: Path
) -> None:
    records, tallies, churned = await asyncio.to_thread(race, race_url, tmp_path)
    markers, effects = await outcome_in_database(race_url)
    ids = {f"m-{n}" for n in range(MESSAGES)}
    assert set(markers) == ids and set(effects) == ids
    assert {m: n for m, (n, _) in markers.items() if n != 1} == {}  # one marker each
    assert {m: n for m, (n, _) in effects.items() if n != 1} == {}  # one effect each
    assert all(t.get("dead_lettered", 0) == 0 for t in tallies), tallies
    assert sum(t["acked"] for t in tallies) == REPLICAS * MESSAGES  # every copy settled
    outcomes = {r["outcome"] for r in records}
    assert {"committed", "duplicate", "failed"} <= outcomes, outcomes
    crossed = crossings(records, markers, effects)
    assert crossed >= CROSSINGS, f"only {crossed} copies waited across a boundary"
    # the markers are spread over the one-second partitions, none in DEFAULT
    spread = dict(
        await fetch(race_url, "SELECT tableoid::regclass::text, count(*) FROM inbox GROUP BY 1")
    )
    assert len(spread) >= 5 and partitions.DEFAULT not in spread, spread
    assert churned["created"] >= 3 and churned["dropped"] >= 3, churned


async def test_without_the_trigger_such_copies_commit_twice(race_url: str, tmp_path: Path) -> None:
    """The same race with the cross-partition check switched off: only each partition's own
    unique key is left, and copies on either side of a boundary both commit."""
    await execute(
        race_url,
        f"ALTER TABLE inbox DISABLE TRIGGER {partitions.TRIGGER}",
        partitions.ADMIT_PLAIN,
    )
    await asyncio.to_thread(race, race_url, tmp_path)
    markers, effects = await outcome_in_database(race_url)
    twice = {m for m, (n, _) in effects.items() if n > 1}
    assert twice, "no copy committed twice: the race did not cross a boundary"
    assert any(n > 1 for n, _ in markers.values())  # and the inbox says so
