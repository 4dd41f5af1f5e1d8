"""Running schedules by seed: a fresh database each, one event loop each, every run bounded.

A schedule's database is the seed's choice. SQLite: a copy of the suite's migrated
template file. PostgreSQL: the explorer's own database (tests/explorer/conftest.py: its
function touches no other test's), emptied before each schedule, each pump reaching it
through a :class:`~tests.support.proxy.TcpProxy` of its own that the faults act on.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from tests.explorer.runner import Report, run
from tests.explorer.schedule import Schedule, generate
from tests.explorer.workload import create_tables
from worker.db import create_engine
from worker.histories import is_version_table

REPLAY = "WORKER_EXPLORE_SEED={seed} python -m pytest tests/explorer -k replay"
"""The command that runs one schedule again (add ``-s`` for the pumps' log)."""
SLACK = 90.0
"""Seconds a schedule may run past its deadline (the rest, the tails, the bounded stops)
before the whole run is cut off: a hang in the explorer itself is bounded too."""


def replay_command(seed: int) -> str:
    return REPLAY.format(seed=seed)


def explore(seed: int, request: pytest.FixtureRequest, *, quiet: bool = True) -> Report:
    """Run the schedule of ``seed`` on a fresh database of the kind it chose; ``quiet``:
    without the pumps' log (a replay shows it)."""
    with capture_logs() if quiet else contextlib.nullcontext():
        return _explore(generate(seed), request)


def _explore(schedule: Schedule, request: pytest.FixtureRequest) -> Report:
    if schedule.database == "postgresql":
        url: str = request.getfixturevalue("explorer_postgres")
        return asyncio.run(_bounded(schedule, _on_postgres(schedule, url)))
    template: Path = request.getfixturevalue("sqlite_template")
    with tempfile.TemporaryDirectory(prefix="explorer-") as folder:
        path = Path(folder) / "worker.db"
        shutil.copy(template, path)
        url = f"sqlite+aiosqlite:///{path}"
        return asyncio.run(_bounded(schedule, _on_sqlite(schedule, url)))


async def _bounded(schedule: Schedule, running: Coroutine[Any, Any, Report]) -> Report:
    async with asyncio.timeout(schedule.deadline + SLACK):
        return await running


async def _on_sqlite(schedule: Schedule, url: str) -> Report:
    direct = create_engine(url, pool_size=1)
    try:
        async with direct.begin() as connection:
            await create_tables(connection)
        return await run(schedule, url, direct)
    finally:
        await direct.dispose()


async def _on_postgres(schedule: Schedule, url: str) -> Report:
    direct = create_engine(url, pool_size=2)
    try:
        await empty(direct)
        return await run(schedule, url, direct)
    finally:
        await direct.dispose()


async def empty(engine: AsyncEngine) -> None:
    """Every table of the explorer's PostgreSQL database emptied, the fixtures re-seeded."""
    async with engine.begin() as connection:
        rows = await connection.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        )
        tables = sorted(t for t in rows.scalars() if not is_version_table(t))
        names = ", ".join(f'"{t}"' for t in tables)
        await connection.execute(text(f"TRUNCATE {names} RESTART IDENTITY"))
        await connection.execute(text("INSERT INTO explorer_unique (code) VALUES ('taken')"))


def verdict(report: Report) -> str:
    """The failure message: the schedule, what it broke, how to run it again."""
    schedule = report.schedule
    lines = [
        f"schedule {schedule.seed} broke {len(report.violations)} invariant(s) "
        f"in {report.seconds:.1f}s:",
        *(f"  {v}" for v in report.violations[:25]),
    ]
    if len(report.violations) > 25:
        lines.append(f"  ... and {len(report.violations) - 25} more")
    if report.fired:
        lines.append("statement faults fired: " + "; ".join(report.fired))
    lines += [
        schedule.describe(),
        f"replay (with the pumps' log): {replay_command(schedule.seed)} -s",
    ]
    return "\n".join(lines)
