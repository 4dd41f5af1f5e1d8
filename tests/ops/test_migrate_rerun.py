"""Migrations survive what a Job's pod lives through: SIGKILL in the middle, a second migrator,
a table another session holds. Real ``worker migrate`` processes on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.ops.deploy_helpers import cli_env, dsn, throwaway_database
from tests.support.processes import REPO, arun_cli, run_cli, worker_cli
from tests.support.waiting import wait_for
from worker.histories import VERSION_TABLE
from worker.migrate import heads, upgrade

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def database() -> Iterator[str]:
    with throwaway_database() as url:
        yield url


@pytest.fixture
async def monitor(database: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(dsn(database))
    try:
        yield connection
    finally:
        await connection.close()


def spawn(database: str, *args: str) -> subprocess.Popen[str]:
    """A ``worker`` process in the background; its stderr is read when it ended."""
    return subprocess.Popen(
        worker_cli(*args),
        env=cli_env(database),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def schema(connection: asyncpg.Connection) -> dict[str, Any]:
    versions = await connection.fetch(f"SELECT version_num FROM {VERSION_TABLE}")
    index = await connection.fetchval(
        "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "WHERE c.relname = 'ix_inbox_processed_at'"
    )
    columns = await connection.fetch(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'inbox'"
    )
    return {
        "versions": sorted(row[0] for row in versions),
        "index_valid": index,
        "columns": {row[0] for row in columns},
    }


async def test_a_migration_killed_during_its_index_build_is_rerun_to_success(
    database: str, monitor: asyncpg.Connection
) -> None:
    """Revision 0002 commits its columns before the concurrent index build (it must), so a
    SIGKILL during the build leaves columns added, an INVALID index, and the revision at 0001.
    """
    await asyncio.to_thread(upgrade, database, "0001")
    # An open snapshot makes CREATE INDEX CONCURRENTLY wait (as a long report query would)
    blocker = await asyncpg.connect(dsn(database))
    await blocker.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    await blocker.fetchval("SELECT 1")
    migrator = spawn(database, "migrate")
    try:
        building = await wait_for(
            lambda: monitor.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query ILIKE 'CREATE INDEX CONCURRENTLY%'"
            ),
            30,
            "the migrator to wait inside its concurrent index build",
            step=0.1,
        )
        migrator.kill()  # SIGKILL, this process only
        assert migrator.wait(10) != 0
        # the server notices the dead client (client_connection_check_interval) and
        # ends the build, leaving the index INVALID and the advisory lock free
        await wait_for(
            lambda: _gone(monitor, building), 20, "the killed migrator's backend to end", 0.2
        )
    finally:
        if migrator.poll() is None:
            migrator.kill()
        migrator.communicate(timeout=10)
        await blocker.execute("ROLLBACK")
        await blocker.close()

    halfway = await schema(monitor)
    assert halfway["versions"] == ["0001"]
    assert {"state", "lease_until", "body"} <= halfway["columns"]  # committed before the build
    assert halfway["index_valid"] is False

    check = await arun_cli(cli_env(database), "migrate", "--check")
    assert check.returncode == 1  # the gate stays closed on the half-done schema

    rerun = await arun_cli(cli_env(database), "migrate")
    assert rerun.returncode == 0, rerun.stderr
    done = await schema(monitor)
    assert done["versions"] == list(heads())
    assert done["index_valid"] is True
    assert (await arun_cli(cli_env(database), "migrate", "--check")).returncode == 0


async def _gone(monitor: asyncpg.Connection, pid: int) -> bool:
    return not await monitor.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)


async def test_two_migrators_at_once_take_turns(database: str, monitor: asyncpg.Connection) -> None:
    """Two Jobs of overlapping releases, or a Job and an operator: the advisory lock orders them."""
    results = await asyncio.gather(*(arun_cli(cli_env(database), "migrate") for _ in range(3)))
    for result in results:
        assert result.returncode == 0, result.stderr
    assert (await schema(monitor))["versions"] == list(heads())


async def test_a_ddl_waiting_for_its_lock_gives_up_instead_of_queueing_every_worker(
    database: str, monitor: asyncpg.Connection
) -> None:
    """ALTER TABLE waits for an ACCESS EXCLUSIVE lock; while it waits, every other query on the
    table queues behind it. lock_timeout keeps that queue short; the run is retried.
    """
    await asyncio.to_thread(upgrade, database, "0001")
    holder = await asyncpg.connect(dsn(database))
    await holder.execute("BEGIN")
    await holder.execute("LOCK TABLE inbox IN ACCESS SHARE MODE")  # a long-running reader
    migrator = spawn(database, "migrate", "--lock-timeout", "0.5")
    try:
        await wait_for(
            lambda: monitor.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND state = 'active' AND query ILIKE 'ALTER TABLE inbox%'"
            ),
            30,
            "the migrator's ALTER TABLE",
            step=0.05,
        )
        slowest = 0.0
        for _ in range(10):  # a worker's queries meanwhile
            started = time.monotonic()
            await monitor.fetchval("SELECT count(*) FROM inbox")
            slowest = max(slowest, time.monotonic() - started)
            await asyncio.sleep(0.2)
        assert slowest < 1.5, f"a query on the inbox waited {slowest:.1f}s behind the migration"
        await holder.execute("ROLLBACK")
        code = await asyncio.to_thread(migrator.wait, 60)
        _, stderr = migrator.communicate(timeout=10)
        assert code == 0, stderr
        assert "retrying" in stderr
    finally:
        if migrator.poll() is None:
            migrator.kill()
        migrator.communicate(timeout=10)
        await holder.close()
    assert (await schema(monitor))["versions"] == list(heads())


def test_sqlite_migrations_are_rerunnable_too(tmp_path: Path) -> None:
    """SQLite commits DDL statement by statement: a run that stopped after some tables."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'worker.db'}"
    upgrade(url, "0001")
    with sqlite3.connect(tmp_path / "worker.db") as connection:
        connection.execute("ALTER TABLE inbox ADD COLUMN state VARCHAR(16) DEFAULT 'finished'")
    result = run_cli(cli_env(url), "migrate")
    assert result.returncode == 0, result.stderr
