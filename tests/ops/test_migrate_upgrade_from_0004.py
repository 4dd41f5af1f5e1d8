"""A database migrated by the last release before the histories were split (revision 0004,
one ``alembic_version`` for the worker's tables and the example handlers' together) upgrades
to the new layout with every row it had, on PostgreSQL and SQLite.

The old database is made by the old migrations themselves, kept verbatim in
tests/ops/legacy_migrations/ (env.py and versions/ as revision 0004 shipped them). Every
column of every table gets a value before the upgrade; after it, every row reads back the
same. On PostgreSQL the upgrade runs while another session holds the lock a live writer
holds on each table: it needs none that would stop one, so there is no moment in which the
inbox does not deduplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from tests.ops.deploy_helpers import cli_env, dsn, throwaway_database
from tests.support.processes import json_lines, run_cli
from worker.db import create_engine, is_inbox_violation
from worker.histories import VERSION_TABLE, application_history
from worker.migrate import heads

LEGACY = Path(__file__).with_name("legacy_migrations")
LEGACY_TABLES = {
    "inbox",
    "rejections",
    "outbox",
    "consumer_offsets",
    "delivery_counts",
    "accounts",
    "products",
}
ROWS = 3


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'at-0004.db'}"
        return
    with throwaway_database() as url:
        yield url


def migrate_as_release_0004(url: str) -> None:
    """The old env.py and revisions: the database a user has today. Blocking (the old
    environment runs its own event loop)."""
    config = Config()
    config.set_main_option("script_location", str(LEGACY))
    config.set_main_option("sqlalchemy.url", url)
    command.upgrade(config, "head")


def value(column: sa.Column[Any], n: int) -> object:
    """A value for any column the schema has: each row differs, no column is left NULL."""
    kind = column.type
    if isinstance(kind, sa.DateTime):
        return dt.datetime(2026, 11, 30, 12, n, 7, 123000, tzinfo=dt.UTC)
    if isinstance(kind, sa.Numeric) and not isinstance(kind, sa.Float):
        return Decimal(f"{n}1.25")
    if isinstance(kind, sa.Integer):  # BigInteger too; keys stay unique
        return n + 1
    if isinstance(kind, sa.LargeBinary):
        return f"body {n} \x00\xff".encode("latin-1")
    if isinstance(kind, sa.String):  # Text too
        text = f"{column.name[:6]}-{n}"
        return text[: kind.length] if kind.length else text + " and a longer text"
    raise AssertionError(f"no value for {column.table.name}.{column.name}: {kind!r}")


def reflect(connection: Connection) -> sa.MetaData:
    metadata = sa.MetaData()
    metadata.reflect(connection)
    return metadata


def fill(connection: Connection) -> None:
    for table in reflect(connection).sorted_tables:
        if table.name == "alembic_version":
            continue
        rows = [{c.name: value(c, n) for c in table.columns} for n in range(ROWS)]
        connection.execute(table.insert(), rows)


def contents(connection: Connection) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, in primary key order, with the timestamps made comparable."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    for table in reflect(connection).sorted_tables:
        order = list(table.primary_key.columns) or list(table.columns)
        rows = connection.execute(sa.select(table).order_by(*order)).all()
        found[table.name] = [tuple(_comparable(v) for v in row) for row in rows]
    return found


def _comparable(item: object) -> object:
    if isinstance(item, dt.datetime) and item.tzinfo is None:  # SQLite keeps no zone
        return item.replace(tzinfo=dt.UTC)
    return item


def on_database(url: str, work: Any) -> Any:
    async def run() -> Any:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.begin() as connection:
                return await connection.run_sync(work)
        finally:
            await engine.dispose()

    return asyncio.run(run())


@contextlib.contextmanager
def held_like_live_writers(url: str) -> Iterator[None]:
    """Another session holding ROW EXCLUSIVE on every table, as workers writing them do."""
    loop = asyncio.new_event_loop()

    async def hold() -> asyncpg.Connection:
        connection = await asyncpg.connect(dsn(url))
        tables = ", ".join(sorted(LEGACY_TABLES))
        await connection.execute(f"BEGIN; LOCK TABLE {tables} IN ROW EXCLUSIVE MODE")
        return connection

    connection = loop.run_until_complete(hold())
    try:
        yield
    finally:
        loop.run_until_complete(connection.close())
        loop.close()


def migrate(url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return run_cli(cli_env(url), "migrate", "--lock-timeout", "1", *flags, timeout=120)


@pytest.mark.parametrize("flags", [(), ("--worker-only",)], ids=["with-the-example", "worker-only"])
def test_a_database_at_0004_upgrades_with_every_row(database: str, flags: tuple[str, ...]) -> None:
    migrate_as_release_0004(database)
    on_database(database, fill)
    before = on_database(database, contents)
    assert set(before) == LEGACY_TABLES | {"alembic_version"}
    assert all(len(before[name]) == ROWS for name in LEGACY_TABLES)
    assert before["alembic_version"] == [("0004",)]

    live = database.startswith("postgresql")
    with held_like_live_writers(database) if live else contextlib.nullcontext():
        result = migrate(database, *flags)
    assert result.returncode == 0, result.stderr
    events = [line["event"] for line in json_lines(result.stderr)]
    assert "worker revision adopted" in events
    assert not any("retrying" in event for event in events), events

    after = on_database(database, contents)
    example = application_history("handlers")
    assert example is not None
    added = {VERSION_TABLE: [(rev,) for rev in heads()]}
    if not flags:
        added[example.version_table] = [(rev,) for rev in heads(example)]
    # every row of every table as it was; alembic_version too (a rollback's gate reads it)
    assert after == {**before, **added}

    check = run_cli(cli_env(database), "migrate", "--check", *flags)
    assert check.returncode == 0, check.stderr
    again = migrate(database, *flags)
    assert again.returncode == 0, again.stderr
    assert "worker revision adopted" not in again.stderr
    assert on_database(database, contents) == after

    def duplicate(connection: Connection) -> None:
        inbox = reflect(connection).tables["inbox"]
        first = connection.execute(sa.select(inbox).limit(1)).mappings().one()
        copy = {k: v for k, v in first.items() if k != "id"}
        connection.execute(inbox.insert(), [{**copy, "id": 1000}])

    with pytest.raises(IntegrityError) as refused:
        on_database(database, duplicate)
    assert is_inbox_violation(refused.value)  # the inbox still deduplicates


def test_a_users_revision_in_the_old_history_is_seen_through(tmp_path: Path) -> None:
    """The old README had users add their revisions to the worker's own history: such a
    database records the user's revision (here ``0005``, on top of 0004) and not the
    worker's. The worker's revision is then read from the tables present, the user's own
    table is left alone, and ``alembic_version`` keeps what it held."""
    path = tmp_path / "users.db"
    url = f"sqlite+aiosqlite:///{path}"
    migrate_as_release_0004(url)
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY)")
        connection.execute("INSERT INTO orders VALUES ('order-1')")
        connection.execute("UPDATE alembic_version SET version_num = '0005'")
    result = migrate(url)
    assert result.returncode == 0, result.stderr
    [adopted] = [line for line in json_lines(result.stderr) if line["event"].endswith("adopted")]
    assert adopted["revision"] == "0004" and adopted["source"] == "the tables present"
    with sqlite3.connect(path) as connection:
        assert connection.execute("SELECT id FROM orders").fetchall() == [("order-1",)]
        assert connection.execute("SELECT * FROM alembic_version").fetchall() == [("0005",)]
        assert connection.execute(f"SELECT * FROM {VERSION_TABLE}").fetchall() == [
            (rev,) for rev in heads()
        ]


def test_a_new_database_records_nothing_in_the_old_table(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / f'new-{uuid.uuid4().hex[:6]}.db'}"
    result = migrate(url)
    assert result.returncode == 0, result.stderr
    assert "worker revision adopted" not in result.stderr

    def names(connection: Connection) -> set[str]:
        return set(sa.inspect(connection).get_table_names())

    assert "alembic_version" not in on_database(url, names)
