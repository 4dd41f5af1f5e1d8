"""Retention of the partitioned inbox (worker/rollover.py): partitions made ahead, whole ones
dropped once past the retention and never before, claims carried out of them, DEFAULT as the
safety net, and a step whose locks are taken postponed instead of holding up the markers."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from tests.support.database import own_database
from tests.support.processes import json_env, run_cli
from tests.support.waiting import wait_for
from worker import inbox, partitions, retention, rollover
from worker.context import session_factory
from worker.db import create_engine, is_inbox_violation
from worker.logs import get_logger
from worker.migrate import upgrade
from worker.registry import Registry
from worker.settings import Settings

pytestmark = pytest.mark.postgres

PERIOD = timedelta(hours=1)
RETENTION = timedelta(hours=2)


@pytest.fixture
def partitioned_url() -> Iterator[str]:
    with own_database("worker_rollover") as url:
        upgrade(url, inbox_layout="partitioned", partition_period=PERIOD)
        yield url


@pytest.fixture
async def engine(partitioned_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(partitioned_url, pool_size=4)
    yield engine
    await engine.dispose()


def settings_for(url: str, **overrides: Any) -> Settings:
    """A redelivery window of 10 minutes, markers kept 2 hours, one partition an hour."""
    values: dict[str, Any] = {
        "database_url": url,
        "inbox_layout": "partitioned",
        "inbox_partition_period": PERIOD,
        "broker_lock_timeout": timedelta(minutes=1),
        "max_deliveries": 5,
        "message_ttl": timedelta(minutes=5),
        "dead_letter_margin": timedelta(0),
        "inbox_retention": RETENTION,
        "purge_interval": 0,
        **overrides,
    }
    return Settings(**values)


async def now_of(engine: AsyncEngine) -> datetime:
    async with engine.connect() as connection:
        return await retention.database_now(connection)


async def known(engine: AsyncEngine) -> dict[str, partitions.Partition]:
    async with engine.connect() as connection:
        return {p.name: p for p in await partitions.partitions(connection)}


async def make(engine: AsyncEngine, lower: datetime, upper: datetime) -> str:
    """A partition for [lower, upper): what a pass made ahead long ago would have made."""
    async with engine.begin() as connection:
        for statement in partitions.create_partition(lower, upper):
            await connection.exec_driver_sql(statement)
    return partitions.partition_name(lower)


async def rows(engine: AsyncEngine) -> dict[str, tuple[Any, ...]]:
    async with engine.connect() as connection:
        found = await connection.execute(
            text(
                "SELECT message_id, tableoid::regclass::text, id, state, received_at, "
                "processed_at, lease_until FROM inbox"
            )
        )
        return {row[0]: tuple(row[1:]) for row in found}


async def insert(engine: AsyncEngine, stored_at: datetime, *values: str) -> None:
    """Markers (finished) and claims (``claim-*``: claimed, ``given-up-*``: abandoned)."""
    async with engine.begin() as connection:
        for message_id in values:
            state = (
                "claimed"
                if message_id.startswith("claim")
                else "abandoned"
                if message_id.startswith("given-up")
                else "finished"
            )
            await connection.execute(
                text(
                    "INSERT INTO inbox (message_id, consumer, stored_at, state, processed_at, "
                    "lease_until, claimed_by) VALUES (:m, 'c', :at, CAST(:state AS varchar), "
                    "CASE WHEN CAST(:state AS varchar) = 'claimed' THEN NULL ELSE now() END, "
                    "CASE WHEN CAST(:state AS varchar) = 'claimed' "
                    "THEN now() - interval '1 day' END, 'x')"
                ),
                {"m": message_id, "at": stored_at, "state": state},
            )


async def test_a_pass_makes_the_partitions_ahead_once(
    engine: AsyncEngine, partitioned_url: str
) -> None:
    settings = settings_for(partitioned_url, purge_interval=3600)  # lead: a period + 2 hours
    now = await now_of(engine)
    first = await retention.purge(engine, settings)
    assert first.rollover is not None and first.deleted == 0
    assert first.rollover.created and not first.rollover.postponed
    ranges = sorted(
        (p.lower, p.upper) for p in (await known(engine)).values() if p.lower is not None
    )
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous, no overlap
    assert ranges[-1][1] is not None and ranges[-1][1] >= now + 3 * PERIOD
    again = await retention.purge(engine, settings)
    assert again.rollover is not None and again.rollover.created == []


async def test_a_partition_is_dropped_whole_once_past_the_retention_and_its_claims_carried(
    engine: AsyncEngine, partitioned_url: str
) -> None:
    settings = settings_for(partitioned_url)
    hour = rollover.boundary(await now_of(engine), PERIOD)
    # two partitions ahead (the old table covers everything before its cut); the pass is
    # told it is later: the first ended 2 hours before, the second 5 hours after
    expired = await make(engine, hour + 10 * PERIOD, hour + 11 * PERIOD)
    kept = await make(engine, hour + 17 * PERIOD, hour + 18 * PERIOD)
    await insert(
        engine, hour + 10 * PERIOD + timedelta(minutes=5), "old-1", "claim-1", "given-up-1"
    )
    await insert(engine, hour + 18 * PERIOD - timedelta(minutes=1), "recent-1")
    before = await rows(engine)
    assert before["old-1"][0] == expired and before["recent-1"][0] == kept
    then = hour + 11 * PERIOD + RETENTION

    early = await retention.purge(engine, settings, now=then - timedelta(seconds=1))
    assert early.rollover is not None and expired not in early.rollover.dropped
    result = await retention.purge(engine, settings, now=then)

    assert result.rollover is not None and result.deleted == 0  # never a DELETE
    assert expired in result.rollover.dropped and kept not in result.rollover.dropped
    assert result.rollover.carried >= 1  # (into DEFAULT here, retired and carried on too:
    # the pass is told a time 13 hours past the clock the claim's new row is stamped with)
    after = await rows(engine)
    assert set(after) == {"claim-1", "recent-1"}  # finished and abandoned went with it
    claim_before, claim_after = before["claim-1"], after["claim-1"]
    assert claim_after[0] != expired  # in whichever partition covers the clock now
    assert claim_after[1:] == claim_before[1:]  # same id, state, times and lease
    assert expired not in await known(engine) and kept in await known(engine)
    session: AsyncSession = session_factory(engine)()  # the carried claim still dedups
    try:
        with pytest.raises(IntegrityError) as caught:
            await inbox.mark(session, "claim-1", "c")
    finally:
        await AsyncSession.close(session)
    assert is_inbox_violation(caught.value)


async def test_the_old_table_is_kept_until_its_newest_marker_is_past_the_retention(
    engine: AsyncEngine, partitioned_url: str
) -> None:
    settings = settings_for(partitioned_url)
    legacy = (await known(engine))[partitions.LEGACY]
    assert legacy.lower is None and legacy.upper is not None
    early = await retention.purge(
        engine, settings, now=legacy.upper + RETENTION - timedelta(seconds=1)
    )
    assert early.rollover is not None and partitions.LEGACY not in early.rollover.dropped
    due = await retention.purge(engine, settings, now=legacy.upper + RETENTION)
    assert due.rollover is not None and partitions.LEGACY in due.rollover.dropped


async def test_a_row_no_partition_covers_goes_to_default_and_default_retires_whole(
    engine: AsyncEngine, partitioned_url: str
) -> None:
    settings = settings_for(partitioned_url, purge_interval=3600)  # lead: 3 hours
    later = rollover.boundary(await now_of(engine), PERIOD) + timedelta(days=30, minutes=10)
    await insert(engine, later, "stray-1", "claim-stray")  # no partition there: never an error
    assert {v[0] for v in (await rows(engine)).values()} == {partitions.DEFAULT}
    # a pass whose lead reaches that period leaves it to DEFAULT and makes the next ones
    result = await retention.purge(engine, settings, now=later - timedelta(minutes=30))
    assert result.rollover is not None
    assert (
        partitions.partition_name(rollover.boundary(later, PERIOD)) not in result.rollover.created
    )
    assert partitions.partition_name(rollover.boundary(later, PERIOD) + PERIOD) in (
        result.rollover.created
    )
    await insert(engine, later + timedelta(minutes=1), "stray-2")  # still DEFAULT's period
    assert (await rows(engine))["stray-2"][0] == partitions.DEFAULT
    # not before its newest row is past the retention
    newest = later + timedelta(minutes=1)
    early = await retention.purge(engine, settings, now=newest + RETENTION - timedelta(seconds=1))
    assert early.rollover is not None and partitions.DEFAULT not in early.rollover.dropped
    due = await retention.purge(engine, settings, now=newest + RETENTION)
    assert due.rollover is not None and partitions.DEFAULT in due.rollover.dropped
    after = await rows(engine)
    assert set(after) == {"claim-stray"}  # carried out; the finished markers went
    assert partitions.DEFAULT in await known(engine)  # a fresh one, attached in that transaction


async def test_a_step_whose_locks_stay_taken_is_postponed_without_holding_up_markers(
    engine: AsyncEngine, partitioned_url: str
) -> None:
    settings = settings_for(partitioned_url, purge_interval=3600)  # something to make ahead
    async with engine.connect() as reader:
        await reader.execute(text("SELECT count(*) FROM inbox"))  # a share lock on DEFAULT
        started = time.monotonic()
        blocked = await retention.purge(engine, settings)
        took = time.monotonic() - started
        # markers go on meanwhile: the attach gave up instead of queueing them behind it
        session: AsyncSession = session_factory(engine)()
        try:
            await asyncio.wait_for(inbox.mark(session, "during", "c"), timeout=2)
            await AsyncSession.commit(session)
        finally:
            await AsyncSession.close(session)
        await reader.rollback()
    assert blocked.rollover is not None
    assert blocked.rollover.postponed and not blocked.rollover.created
    assert took < rollover.ATTEMPTS * (rollover.LOCK_TIMEOUT + 0.5) + 2
    later = await retention.purge(engine, settings)
    assert later.rollover is not None and later.rollover.created and not later.rollover.postponed


def test_partitioned_settings_that_cannot_work_stop_the_start_with_one_line(
    tmp_path: Path,
) -> None:
    cases = {
        "WORKER_INBOX_LAYOUT='partitioned'": {
            "WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'w.db'}",
            "WORKER_INBOX_LAYOUT": "partitioned",
        },
        "WORKER_INBOX_PARTITION_PERIOD='PT1H'": {
            "WORKER_DATABASE_URL": "postgresql+asyncpg://nobody@127.0.0.1:1/none",
            "WORKER_INBOX_LAYOUT": "partitioned",
            "WORKER_INBOX_PARTITION_PERIOD": "PT1H",  # 21 days of them
        },
        "WORKER_INBOX_RETENTION='P7D'": {  # the horizon check, whatever the layout
            "WORKER_DATABASE_URL": "postgresql+asyncpg://nobody@127.0.0.1:1/none",
            "WORKER_INBOX_LAYOUT": "partitioned",
            "WORKER_INBOX_RETENTION": "P7D",
        },
    }
    for named, variables in cases.items():
        done = run_cli(json_env(variables), "purge-inbox")
        assert done.returncode == 2, (named, done.stderr)
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"worker: configuration error: {named}"), line


def test_the_default_period_keeps_about_five_partitions() -> None:
    settings = Settings()
    assert settings.partition_period == timedelta(days=5)  # a quarter of 21 days, whole days
    assert Settings(inbox_retention=timedelta(days=30)).partition_period == timedelta(days=7)
    assert datetime(2026, 1, 1, 13, tzinfo=UTC) - rollover.boundary(
        datetime(2026, 1, 1, 13, 30, tzinfo=UTC), PERIOD
    ) == timedelta(0)


async def test_one_replica_rolls_over_at_a_time_and_the_loop_and_the_command_do_it_too(
    engine: AsyncEngine, partitioned_url: str
) -> None:
    settings = settings_for(partitioned_url, purge_interval=3600)
    other = create_engine(partitioned_url, pool_size=2)
    try:
        both = await asyncio.gather(
            retention.purge(engine, settings), retention.purge(other, settings)
        )
    finally:
        await other.dispose()
    assert sorted(r.ran for r in both) == [False, True]  # the purge's advisory lock, as before
    # the housekeeping loop (what `worker run` starts) makes them again once they are gone
    async with engine.connect() as connection:
        for name in [n for n in await known(engine) if n.startswith("inbox_p")]:
            for statement in rollover.retire(name):
                await connection.exec_driver_sql(statement)
            await connection.commit()
    assert not [n for n in await known(engine) if n.startswith("inbox_p")]
    looping = settings_for(partitioned_url, purge_interval=0.05)
    chores = retention.start(engine, session_factory(engine), Registry(), looping, get_logger())
    assert chores is not None
    try:
        await wait_for(lambda: _made(engine), 10, "partitions made by the housekeeping loop")
    finally:
        chores.cancel()
        await asyncio.gather(chores, return_exceptions=True)
    # and `worker purge-inbox` runs one pass by hand
    done = await asyncio.to_thread(
        run_cli,
        json_env(
            {
                "WORKER_DATABASE_URL": partitioned_url,
                "WORKER_INBOX_PARTITION_PERIOD": "PT1H",
                "WORKER_INBOX_RETENTION": "PT2H",
                "WORKER_BROKER_LOCK_TIMEOUT": "PT1M",
                "WORKER_MESSAGE_TTL": "PT5M",
                "WORKER_DEAD_LETTER_MARGIN": "PT0S",
            }
        ),
        "purge-inbox",
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"^partitions: \d+ created, 0 dropped \(older than ", done.stderr, re.M)


async def _made(engine: AsyncEngine) -> bool:
    return any(name.startswith("inbox_p") for name in await known(engine))
