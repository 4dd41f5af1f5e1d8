"""Inbox retention: a validated window, bounded batches, one purger at a time: trimming
never deletes a marker a redelivery could still need."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import select, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.concurrency.concurrency_helpers import add_marker, count
from tests.support.database import INBOX
from tests.support.layout import plain_table_only
from tests.support.processes import json_env, run_cli
from tests.support.pumps import MakeSettings
from tests.support.waiting import wait_for
from worker import retention
from worker.db import create_engine
from worker.errors import ConfigurationError
from worker.registry import Registry
from worker.settings import Settings

DAY = timedelta(days=1)


def short_window(make_settings: MakeSettings, **overrides: Any) -> Settings:
    """A redelivery window of 10 minutes (1 min x 5 deliveries + 5 min TTL), kept 1 hour."""
    values: dict[str, Any] = {
        "broker_lock_timeout": timedelta(minutes=1),
        "max_deliveries": 5,
        "message_ttl": timedelta(minutes=5),
        "dead_letter_margin": timedelta(0),
        "inbox_retention": timedelta(hours=1),
        "purge_interval": 0,
    }
    values.update(overrides)
    settings: Settings = make_settings(**values)
    return settings


async def remaining(engine: AsyncEngine) -> list[str]:
    async with engine.connect() as connection:
        rows = await connection.execute(select(INBOX.c.message_id).order_by(INBOX.c.message_id))
        return list(rows.scalars())


# -- the window ---------------------------------------------------------------------------------


def test_the_window_is_computed_from_the_broker_and_a_shorter_one_is_refused() -> None:
    settings = Settings(
        broker_lock_timeout=timedelta(minutes=5),
        max_deliveries=10,
        message_ttl=timedelta(days=14),
        dead_letter_margin=timedelta(days=7),
    )
    assert settings.redelivery_window == timedelta(days=21, minutes=50)
    assert settings.retention == settings.redelivery_window  # the default: exactly the window
    assert Settings(inbox_retention=timedelta(days=30)).retention == timedelta(days=30)
    with pytest.raises(ValidationError, match="shorter than the redelivery window"):
        Settings(inbox_retention=timedelta(days=20))  # default window is 21 days 2.5 hours


def test_a_short_retention_stops_the_worker_at_start_with_one_line(tmp_path: Path) -> None:
    done = run_cli(
        json_env(
            {
                "WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'w.db'}",
                "WORKER_INBOX_RETENTION": "P7D",
                "WORKER_MESSAGE_TTL": "P14D",
            }
        ),
        "purge-inbox",
    )
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("worker: configuration error: WORKER_INBOX_RETENTION='P7D'")
    assert "redelivery window" in line


def test_a_call_timeout_longer_than_the_lease_is_refused() -> None:
    with pytest.raises(ValidationError, match="shorter than WORKER_CLAIM_LEASE"):
        Settings(claim_lease=10, claim_call_timeout=10)


# -- the purge -----------------------------------------------------------------------------------


async def test_purge_removes_old_finished_markers_in_batches_and_keeps_everything_else(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    plain_table_only(str(engine.url))
    for n in range(10):
        await add_marker(engine, f"old-{n:02}", age=2 * DAY)
    for n in range(3):
        await add_marker(engine, f"recent-{n}", age=timedelta(minutes=30))  # inside the hour
    await add_marker(engine, "claim-live", age=2 * DAY, state="claimed", lease=timedelta(minutes=1))
    await add_marker(engine, "claim-expired", age=2 * DAY, state="claimed", lease=-DAY)
    settings = short_window(make_settings, purge_batch=3)
    result = await retention.purge(engine, settings, pause=0)
    assert (result.ran, result.deleted, result.batches) == (True, 10, 4)  # 3 + 3 + 3 + 1
    assert await remaining(engine) == [
        "claim-expired",
        "claim-live",
        "recent-0",
        "recent-1",
        "recent-2",
    ]


async def test_one_run_is_bounded_and_the_next_run_continues(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    plain_table_only(str(engine.url))
    for n in range(10):
        await add_marker(engine, f"old-{n:02}", age=2 * DAY)
    settings = short_window(make_settings, purge_batch=3, purge_max_batches=2)
    first = await retention.purge(engine, settings, pause=0)
    assert (first.deleted, first.batches) == (6, 2)
    assert await remaining(engine) == ["old-06", "old-07", "old-08", "old-09"]  # oldest went first
    second = await retention.purge(engine, settings, pause=0)
    assert (second.deleted, await remaining(engine)) == (4, [])


async def test_two_concurrent_purgers_do_not_both_run(
    database_url: str, make_settings: MakeSettings
) -> None:
    plain_table_only(database_url)  # tests/concurrency/test_inbox_rollover.py: partitions
    engines = [create_engine(database_url), create_engine(database_url)]
    try:
        for n in range(20):
            await add_marker(engines[0], f"old-{n:02}", age=2 * DAY)
        settings = short_window(make_settings, purge_batch=2)
        results = await asyncio.gather(
            *(retention.purge(engine, settings, pause=0.03) for engine in engines)
        )
        assert sorted(r.ran for r in results) == [False, True]
        assert sum(r.deleted for r in results) == 20
        # The lock was given back: the next purge runs (and finds nothing left).
        again = await retention.purge(engines[1], settings)
        assert (again.ran, again.deleted) == (True, 0)
    finally:
        for engine in engines:
            await engine.dispose()


async def test_advisory_locks_are_postgresql_only(engine: AsyncEngine) -> None:
    async with engine.connect() as connection:
        if engine.dialect.name == "sqlite":
            with pytest.raises(ConfigurationError, match="advisory locks need PostgreSQL"):
                await retention.advisory_lock(connection, 42)
        else:
            assert await retention.advisory_lock(connection, 42) is True
            await connection.execute(text("SELECT pg_advisory_unlock(42)"))


async def test_a_purge_cancelled_mid_run_does_not_keep_the_lock(
    postgres_only_url: str, make_settings: MakeSettings
) -> None:
    plain_table_only(postgres_only_url)
    engine = create_engine(postgres_only_url)
    try:
        for n in range(30):
            await add_marker(engine, f"old-{n:02}", age=2 * DAY)
        settings = short_window(make_settings, database_url=postgres_only_url, purge_batch=1)
        task = asyncio.create_task(retention.purge(engine, settings, pause=0.05))

        async def some_batches_done() -> bool:
            return await count(engine, INBOX) <= 27

        # then cancel it, lock held, mid-run
        await wait_for(some_batches_done, 5, "three batches purged", step=0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        other = create_engine(postgres_only_url)
        try:
            result = await retention.purge(other, settings, pause=0)
        finally:
            await other.dispose()
        assert result.ran and await count(engine, INBOX) == 0
    finally:
        await engine.dispose()


async def test_housekeeping_purges_periodically(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    """What ``worker run`` starts beside the ops server (cli._run), not inside the pump."""
    plain_table_only(str(engine.url))
    from worker.context import session_factory
    from worker.logs import get_logger

    await add_marker(engine, "old", age=2 * DAY)
    await add_marker(engine, "recent", age=timedelta(minutes=1))
    settings = short_window(make_settings, purge_interval=0.05)
    chores = retention.start(engine, session_factory(engine), Registry(), settings, get_logger())
    assert chores is not None
    try:

        async def purged() -> bool:
            return await remaining(engine) == ["recent"]

        await wait_for(purged, 5, "the old marker purged", step=0.02)
    finally:
        chores.cancel()
        await asyncio.gather(chores, return_exceptions=True)
    off = short_window(make_settings)  # WORKER_PURGE_INTERVAL=0: no housekeeping at all
    assert retention.start(engine, session_factory(engine), Registry(), off, get_logger()) is None


def test_worker_purge_inbox(database_url: str) -> None:
    plain_table_only(database_url)

    async def seed() -> None:
        engine = create_engine(database_url)
        try:
            for n in range(5):
                await add_marker(engine, f"old-{n}", age=40 * DAY)
            await add_marker(engine, "young", age=DAY)
        finally:
            await engine.dispose()

    asyncio.run(seed())
    done = run_cli(
        json_env({"WORKER_DATABASE_URL": database_url, "WORKER_PURGE_BATCH": "2"}), "purge-inbox"
    )
    assert done.returncode == 0, done.stderr
    assert "purged 5 finished markers older than" in done.stderr
    assert "in 3 batches" in done.stderr


async def test_the_purge_walks_the_processed_at_index_on_postgresql(postgres_only_url: str) -> None:
    plain_table_only(postgres_only_url)
    """The plan of one batch: an index range scan, oldest first, stopped by the LIMIT."""
    engine = create_engine(postgres_only_url)
    try:
        async with engine.begin() as connection:
            await connection.execute(
                text(
                    "INSERT INTO inbox (message_id, consumer, received_at, processed_at) "
                    "SELECT 'm' || n, 'c', now() - n * interval '1 minute', "
                    "now() - n * interval '1 minute' FROM generate_series(1, 50000) AS n"
                )
            )
            await connection.execute(text("ANALYZE inbox"))
        cutoff = (datetime.now(UTC) - timedelta(days=30)).isoformat()
        dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
        sql = str(retention.PURGE_BATCH["postgresql"].compile(dialect=dialect))
        for name, value in {
            "state_1": "'finished'",
            "state_2": "'abandoned'",
            "cutoff": f"'{cutoff}'",
            "batch": "1000",
        }.items():
            sql = sql.replace(f"%({name})s", value)
        async with engine.connect() as connection:
            plan = "\n".join((await connection.execute(text(f"EXPLAIN {sql}"))).scalars())
    finally:
        await engine.dispose()
    assert "ix_inbox_processed_at" in plan, plan
    assert "Seq Scan on inbox" not in plan, plan
    assert "Limit" in plan, plan


async def test_the_cutoff_comes_from_the_database_clock_not_the_workers(
    engine: AsyncEngine, make_settings: MakeSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose clock runs a day ahead must not purge markers the window still needs:
    ``processed_at`` is stamped by the database, so the cutoff is computed from its clock."""
    await add_marker(engine, "recent", age=timedelta(minutes=30))  # inside the hour

    class AheadClock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> AheadClock:
            return cls.fromtimestamp(datetime.now(UTC).timestamp() + DAY.total_seconds(), tz)

    monkeypatch.setattr(retention, "datetime", AheadClock)
    result = await retention.purge(engine, short_window(make_settings), pause=0)
    assert (result.ran, result.deleted) == (True, 0)
    assert await remaining(engine) == ["recent"]
