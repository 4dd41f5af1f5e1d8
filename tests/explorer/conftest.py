"""The explorer's PostgreSQL database: its own, so its fault function touches no other test.

Migrated as the suite's is (tests/support/migrations.py, ``WORKER_TEST_INBOX``'s layout),
plus the explorer's tables and ``explorer_raise``; dropped at the end of the session.
SQLite schedules use the suite's ``sqlite_template`` (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from tests.explorer.faults import FUNCTION_SQL
from tests.explorer.workload import create_tables
from tests.support.layout import INBOX_LAYOUT, PERIOD
from tests.support.migrations import migrate_with_the_example
from tests.support.services import require_service
from worker.db import create_engine

ADMIN_URL = os.environ.get(
    "WORKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
)


async def _run(url: str, *statements: str, autocommit: bool = False) -> None:
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.connect() as connection:
            if autocommit:
                await connection.execution_options(isolation_level="AUTOCOMMIT")
            for statement in statements:
                await connection.execute(text(statement))
            await connection.commit()
    finally:
        await engine.dispose()


async def _prepare(url: str) -> None:
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.begin() as connection:
            await create_tables(connection)
            await connection.execute(text(FUNCTION_SQL))
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
def explorer_postgres() -> Iterator[str]:
    require_service("127.0.0.1", 5432, "PostgreSQL")
    name = f"worker_explorer_{uuid.uuid4().hex[:10]}"
    asyncio.run(_run(ADMIN_URL, f'CREATE DATABASE "{name}"', autocommit=True))
    url = ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        migrate_with_the_example(url, inbox_layout=INBOX_LAYOUT, partition_period=PERIOD)
        asyncio.run(_prepare(url))
        yield url
    finally:
        asyncio.run(
            _run(ADMIN_URL, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', autocommit=True)
        )
