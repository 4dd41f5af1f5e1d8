"""The explorer's faults are what they claim: each SQLSTATE a plan names is raised by the real
database through a real connection (PostgreSQL: the server's own code; SQLite: the driver's
own class and message), and the footprint walk sees a structure that grows."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import DBAPIError

from tests.explorer.faults import Injector, Outages, fail_statement
from tests.explorer.footprint import footprint
from tests.explorer.schedule import INVALID, SQLSTATES, Schedule
from tests.explorer.workload import create_tables
from worker.context import session_factory
from worker.db import create_engine

POSTGRES_CODES = sorted(set(SQLSTATES["postgresql"]) | (set(INVALID["postgresql"]) - {"die"}))
SQLITE_CODES = sorted(set(SQLSTATES["sqlite"]) | {"22003", "23505", "53100", "25006"})
_NOT_CODES = {"RuntimeError", "CancelledError", "Abort"}


def _sqlstate(exc: BaseException) -> str | None:
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    for candidate in (orig, getattr(orig, "__cause__", None)):
        code = getattr(candidate, "sqlstate", None)
        if isinstance(code, str):
            return code
    return None


async def _raised(url: str, code: str, database: str) -> BaseException:
    engine = create_engine(url, pool_size=1)
    schedule = Schedule(0, database, 1, 1, 1, 3, 3, False, ())
    Injector(schedule, Outages()).install(engine)
    try:
        session: Any = session_factory(engine)()
        try:
            await fail_statement(session, code, database)
        except (Exception, asyncio.CancelledError) as exc:
            return exc
        finally:
            await session.invalidate()
    finally:
        await engine.dispose()
    raise AssertionError("nothing raised")


@pytest.mark.postgres
@pytest.mark.parametrize("code", [c for c in POSTGRES_CODES if c not in _NOT_CODES])
def test_postgresql_raises_each_sqlstate_itself(code: str, explorer_postgres: str) -> None:
    exc = asyncio.run(_raised(explorer_postgres, code, "postgresql"))
    if code == "57P01":  # the server's FATAL ends the connection: asyncpg says so, as 08003
        assert _sqlstate(exc) in ("57P01", "08003"), repr(exc)
        assert "terminating connection due to administrator command" in str(exc)
    else:
        assert _sqlstate(exc) == code, repr(exc)


_SQLITE_EXPECTED = {
    "40001": (sqlite3.OperationalError, "database is locked"),
    "08006": (sqlite3.OperationalError, "unable to open database file"),
    "25006": (sqlite3.OperationalError, "attempt to write a readonly database"),
    "53100": (sqlite3.OperationalError, "database or disk is full"),
    "42P01": (sqlite3.OperationalError, "no such table: explorer_missing"),
    "22003": (OverflowError, "too large"),
    "23505": (sqlite3.IntegrityError, "UNIQUE constraint failed: explorer_unique.code"),
}


@pytest.mark.parametrize("code", [c for c in SQLITE_CODES if c not in _NOT_CODES])
def test_sqlite_raises_each_condition_as_its_driver_does(
    code: str, sqlite_template: Path, tmp_path: Path
) -> None:
    path = tmp_path / "worker.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite+aiosqlite:///{path}"

    async def prepare() -> None:
        engine = create_engine(url, pool_size=1)
        async with engine.begin() as connection:
            await create_tables(connection)
        await engine.dispose()

    asyncio.run(prepare())
    exc = asyncio.run(_raised(url, code, "sqlite"))
    kind, message = _SQLITE_EXPECTED[code]
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    assert isinstance(orig, kind) and message in str(orig), repr(exc)


def test_the_footprint_counts_what_grows_and_leaves_out_what_was_given() -> None:
    class Holder:
        def __init__(self, given: dict[str, int]) -> None:
            self.given = given
            self.seen: Counter[str] = Counter()

    given = {str(n): n for n in range(100)}
    holder = Holder(given)
    before = footprint(holder, [given])
    holder.seen.update(f"id-{n}" for n in range(50))
    assert footprint(holder, [given]) == before + 50
    assert footprint(holder) == before + 50 + 100
