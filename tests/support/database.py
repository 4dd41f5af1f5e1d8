"""One-shot queries by URL, for tests that look at the database from outside a pump; and
databases of a test's own on the PostgreSQL server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any, cast

from sqlalchemy import Table, text
from sqlalchemy.ext.asyncio import AsyncEngine

from handlers.credit import Account
from worker.db import create_engine
from worker.inbox import InboxMarker

# SQLAlchemy types a mapped class's ``__table__`` as a FromClause; these are Tables
INBOX = cast(Table, InboxMarker.__table__)
ACCOUNTS = cast(Table, Account.__table__)


async def fetch(database_url: str, sql: str) -> list[Any]:
    engine = create_engine(database_url, pool_size=1)
    try:
        async with engine.connect() as connection:
            return list(await connection.execute(text(sql)))
    finally:
        await engine.dispose()


async def scalar(database_url: str, sql: str) -> Any:
    """The first column of the first row, or None."""
    rows = await fetch(database_url, sql)
    return rows[0][0] if rows else None


async def execute(database_url: str, *statements: str) -> None:
    """Run the statements in one transaction."""
    engine = create_engine(database_url, pool_size=1)
    try:
        async with engine.begin() as connection:
            for sql in statements:
                await connection.execute(text(sql))
    finally:
        await engine.dispose()


async def balances(database_url: str, table: str = "accounts") -> dict[str, Decimal]:
    rows = await fetch(database_url, f"SELECT id, balance FROM {table}")
    return {row[0]: Decimal(row[1]) for row in rows}


async def marker_count(database: AsyncEngine | str, where: str = "") -> int:
    """Inbox markers (rows of ``inbox``), only those matching the SQL ``where`` if given;
    ``database`` is the test's engine or a URL (a one-shot engine then)."""
    sql = "SELECT count(*) FROM inbox" + (f" WHERE {where}" if where else "")
    if isinstance(database, str):
        return int(await scalar(database, sql))
    async with database.connect() as connection:
        return int(await connection.scalar(text(sql)) or 0)


POSTGRES_ADMIN_URL = os.environ.get(
    "WORKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
)


async def admin(sql: str) -> None:
    """One statement on the server's admin database, outside a transaction."""
    engine = create_engine(POSTGRES_ADMIN_URL, pool_size=1)
    try:
        async with engine.connect() as connection:
            await connection.execution_options(isolation_level="AUTOCOMMIT")
            await connection.execute(text(sql))
    finally:
        await engine.dispose()


@contextlib.contextmanager
def own_database(prefix: str = "worker_own") -> Iterator[str]:
    """An empty PostgreSQL database of the caller's own, dropped (FORCE) on the way out.
    Call it outside an event loop (a sync fixture)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        yield POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
