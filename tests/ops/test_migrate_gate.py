"""The migration gate, for real: ``worker migrate --check`` / ``--wait`` processes on PostgreSQL.

The Deployment's init container runs ``worker migrate --wait``, so a pod of a new
release does not take a single delivery before its schema is in place (a missing
table would otherwise fail every message it is handed). Each test gets its own
database, dropped afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from tests.ops.deploy_helpers import (
    as_pid_1,
    cli_env,
    database_url,
    dsn,
    namespace_init,
    throwaway_database,
)
from tests.support.migrations import migrate_with_the_example
from tests.support.processes import REPO, json_lines, run_cli, worker_cli
from worker.histories import VERSION_TABLE
from worker.migrate import heads, upgrade

pytestmark = [pytest.mark.postgres]


@pytest.fixture
def database() -> Iterator[str]:
    with throwaway_database() as url:
        yield url


def events(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line.get("event", "") for line in json_lines(result.stderr)]


def test_check_fails_on_an_empty_or_old_schema_and_passes_at_head(database: str) -> None:
    env = cli_env(database)
    empty = run_cli(env, "migrate", "--check")
    assert empty.returncode == 1, empty.stderr
    assert "schema not at head" in events(empty)

    upgrade(database, "0001")
    old = run_cli(env, "migrate", "--check")
    assert old.returncode == 1
    assert "database at 0001" in old.stderr

    assert run_cli(env, "migrate").returncode == 0
    at_head = run_cli(env, "migrate", "--check")
    assert at_head.returncode == 0, at_head.stderr
    assert f"code at {','.join(heads())}" in at_head.stderr


def test_check_accepts_a_schema_a_newer_release_migrated(database: str) -> None:
    """A rollback to the previous image must not lock it out: migrations only expand."""
    migrate_with_the_example(database)

    async def pretend_newer() -> None:
        connection = await asyncpg.connect(dsn(database))
        try:
            await connection.execute(f"UPDATE {VERSION_TABLE} SET version_num = '9999_future'")
        finally:
            await connection.close()

    asyncio.run(pretend_newer())
    result = run_cli(cli_env(database), "migrate", "--check")
    assert result.returncode == 0, result.stderr
    assert "schema ahead" in result.stderr


def test_wait_returns_once_another_process_migrated(database: str, tmp_path: Path) -> None:
    log = tmp_path / "wait.log"
    with log.open("w") as output:
        waiter = subprocess.Popen(
            worker_cli("migrate", "--wait", "--timeout", "60"),
            env=cli_env(database),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=output,
            text=True,
        )
    try:
        deadline = time.monotonic() + 60  # a loaded machine imports slowly
        while "waiting for the schema" not in log.read_text():
            assert waiter.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the gate never started waiting"
            time.sleep(0.1)
        time.sleep(3)  # at least one more poll (every 2 s, jittered by 25 %) of the empty schema
        assert waiter.poll() is None, "the gate opened on an empty schema"
        started = time.monotonic()
        assert run_cli(cli_env(database), "migrate").returncode == 0
        assert waiter.wait(20) == 0
        assert time.monotonic() - started < 15  # the gate polls every 2 s
    finally:
        if waiter.poll() is None:
            waiter.kill()
        waiter.wait(10)
    waits = [
        line
        for line in json_lines(log.read_text())
        if line.get("event") == "waiting for the schema"
    ]
    # one line per change of state, not one per poll: the empty schema once, however many
    # polls saw it; a poll during the migration may also see a revision it passed through
    # (each commits on its own), once
    statuses = [line["status"] for line in waits]
    assert statuses[0].startswith("schema behind: worker: database at none"), statuses
    assert len(statuses) == len(set(statuses)), statuses


def test_wait_waits_through_a_database_that_does_not_exist_yet() -> None:
    """An outage (here: 3D000, no such database) keeps the gate closed, it does not crash."""
    with throwaway_database() as scratch:
        missing = scratch.rsplit("/", 1)[1] + "_later"
    url = database_url(missing)
    waiter = subprocess.Popen(
        worker_cli("migrate", "--wait", "--timeout", "60"),
        env=cli_env(url),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(3)
        assert waiter.poll() is None, waiter.communicate(timeout=5)[1]

        async def admin(sql: str) -> None:
            connection = await asyncpg.connect(dsn(database_url("postgres")))
            try:
                await connection.execute(sql)
            finally:
                await connection.close()

        asyncio.run(admin(f'CREATE DATABASE "{missing}"'))
        try:
            migrate_with_the_example(url)
            assert waiter.wait(20) == 0
        finally:
            if waiter.poll() is None:
                waiter.kill()
            waiter.communicate(timeout=10)
            asyncio.run(admin(f'DROP DATABASE IF EXISTS "{missing}" WITH (FORCE)'))
    finally:
        if waiter.poll() is None:
            waiter.kill()


def test_wait_gives_up_after_its_timeout(database: str) -> None:
    started = time.monotonic()
    result = run_cli(cli_env(database), "migrate", "--wait", "--timeout", "2")
    assert result.returncode == 1
    assert "schema not at head in time" in events(result)
    assert time.monotonic() - started < 20


def waiting(log: Path, database: str, *, locked: bool) -> bool:
    """The migrator waits: for the schema (its log says so), or for the inbox's lock."""
    if not locked:
        return "waiting for the schema" in log.read_text()

    async def blocked() -> bool:
        connection = await asyncpg.connect(dsn(database))
        try:
            return bool(
                await connection.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query ILIKE 'ALTER TABLE inbox%'"
                )
            )
        finally:
            await connection.close()

    return asyncio.run(blocked())


@pytest.mark.parametrize("flags", [("--wait", "--timeout", "120"), ()])
def test_sigterm_stops_migrate_as_pid_1_at_once(
    database: str, flags: tuple[str, ...], tmp_path: Path
) -> None:
    """In a container without an init the process is PID 1: a default SIGTERM is dropped.

    ``()``: a plain ``worker migrate`` stuck behind another session's lock on the inbox.
    """
    holder: asyncpg.Connection | None = None
    if not flags:
        upgrade(database, "0001")

        async def hold() -> asyncpg.Connection:
            connection = await asyncpg.connect(dsn(database))
            await connection.execute("BEGIN; LOCK TABLE inbox IN ACCESS SHARE MODE")
            return connection

        loop = asyncio.new_event_loop()
        holder = loop.run_until_complete(hold())
    log = tmp_path / "migrate.log"
    output = log.open("w")
    launcher = subprocess.Popen(
        as_pid_1(worker_cli("migrate", *flags)),
        env=cli_env(database),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=output,
        text=True,
    )
    try:
        pid = namespace_init(launcher)
        # inside the wait (or behind the lock): its signal handler is in place by then
        deadline = time.monotonic() + 60  # a loaded machine imports slowly
        while not waiting(log, database, locked=not flags):
            assert launcher.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the migrator never started waiting"
            time.sleep(0.1)
        assert launcher.poll() is None
        sent = time.monotonic()
        os.kill(pid, signal.SIGTERM)  # the worker process itself, by its PID
        code = launcher.wait(10)
        assert time.monotonic() - sent < 5
        assert code == 128 + signal.SIGTERM
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(10)
        output.close()
        if holder is not None:
            loop.run_until_complete(holder.close())
            loop.close()
