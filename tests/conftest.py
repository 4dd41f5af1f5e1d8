"""Shared fixtures: a real PostgreSQL database per test run, a migrated SQLite file per test,
and the brokers every folder may use (a throwaway RabbitMQ vhost, a Tansu Kafka test broker).

A missing service skips a test locally and fails it under CI (``CI`` set), so
a CI run can never pass by skipping what it was meant to prove. Plain helpers
(processes, waiting, queries, broker control) live in ``tests/support/``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.exclusive import holding
from tests.support.layout import INBOX_LAYOUT, PERIOD, layout_of
from tests.support.migrations import migrate_with_the_example
from tests.support.pumps import MakeSettings, RunPumps, pumps_on
from tests.support.rabbitmq import (
    MakeRabbitSettings,
    delete_topologies,
    guest_url,
    throwaway_vhost,
)
from tests.support.services import require_service
from tests.support.tansu import Tansu, running_tansu
from worker.brokers.rabbitmq import RabbitMQSettings
from worker.db import create_engine
from worker.histories import is_version_table
from worker.settings import Settings

POSTGRES_ADMIN_URL = os.environ.get(
    "WORKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A ``serial`` test runs alone: no other test runs meanwhile, in this run (``-n``) or any
    other on this machine; see tests/support/exclusive.py. Outermost, so the wait for the lock
    is outside pytest-timeout's limit and covers the test's setup and teardown."""
    with holding(exclusive=item.get_closest_marker("serial") is not None):
        yield


async def _admin(sql: str) -> None:
    engine = create_engine(POSTGRES_ADMIN_URL, pool_size=1)
    try:
        async with engine.connect() as connection:
            await connection.execution_options(isolation_level="AUTOCOMMIT")
            await connection.execute(text(sql))
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test run, dropped afterwards; its
    inbox is partitioned under ``WORKER_TEST_INBOX=partitioned`` (tests/support/layout.py)."""
    require_service("127.0.0.1", 5432, "PostgreSQL")
    name = f"worker_test_{uuid.uuid4().hex[:10]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    url = POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        migrate_with_the_example(url, inbox_layout=INBOX_LAYOUT, partition_period=PERIOD)
        _MIGRATED_TABLES[url] = asyncio.run(_tables(url))
        yield url
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One migrated SQLite file; each test gets a copy."""
    path = tmp_path_factory.mktemp("sqlite") / "template.db"
    migrate_with_the_example(f"sqlite+aiosqlite:///{path}")
    return path


async def _tables(url: str) -> set[str]:
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.connect() as connection:
            rows = await connection.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            )
            return set(rows.scalars())
    finally:
        await engine.dispose()


_MIGRATED_TABLES: dict[str, set[str]] = {}


async def _truncate(url: str) -> None:
    """Empty the migrated tables and drop whatever a previous test created."""
    migrated = _MIGRATED_TABLES[url]
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.begin() as connection:
            rows = await connection.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            )
            present = set(rows.scalars())
            for extra in sorted(present - migrated):
                await connection.execute(text(f'DROP TABLE "{extra}" CASCADE'))
            # a partition a test's rollover dropped is gone: only what is still there
            kept = sorted(t for t in migrated & present if not is_version_table(t))
            names = ", ".join(f'"{t}"' for t in kept)
            if names:
                await connection.execute(text(f"TRUNCATE {names} RESTART IDENTITY"))
    finally:
        await engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each database-dependent test runs on both databases, on empty tables."""
    if request.param == "sqlite":
        path = tmp_path / "worker.db"
        shutil.copy(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite+aiosqlite:///{path}"
    url: str = request.getfixturevalue("postgres_url")
    asyncio.run(_truncate(url))
    return url


@pytest.fixture
def postgres_only_url(postgres_url: str) -> str:
    asyncio.run(_truncate(postgres_url))
    return postgres_url


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url, pool_size=20)
    yield engine
    await engine.dispose()


@pytest.fixture
def make_settings(request: pytest.FixtureRequest) -> MakeSettings:
    """Settings for in-process pumps; the database is the test's ``database_url`` unless given."""

    def make(**overrides: Any) -> Settings:
        url = (
            request.getfixturevalue("database_url")
            if "database_url" in request.fixturenames
            else "sqlite+aiosqlite:///unused.db"
        )
        values: dict[str, Any] = {
            "database_url": url,
            "inbox_layout": layout_of(url),
            "concurrency": 4,
            "retry_backoff": 0.001,
            "retry_backoff_max": 0.01,
            "grace_period": 5.0,
        }
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture
def run_pumps() -> RunPumps:
    """``async with run_pumps(brokers, engines, registry, settings) as pumps:`` starts pumps
    (one per broker connection) and stops them gracefully on exit (tests/support/pumps.py)."""
    return pumps_on


# -- brokers -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rabbitmq_vhost() -> Iterator[str]:
    """A fresh RabbitMQ vhost for this test session, deleted (with everything in it) afterwards."""
    with throwaway_vhost() as name:
        yield name


@pytest.fixture(scope="session")
def amqp_url(rabbitmq_vhost: str) -> str:
    return guest_url(rabbitmq_vhost)


@pytest.fixture
def rabbit_settings(amqp_url: str) -> Iterator[MakeRabbitSettings]:
    """RabbitMQ settings in the session's vhost; queue and exchange names unique to the test,
    deleted after it (whatever it declared under the settings it made)."""
    queue = f"q{uuid.uuid4().hex[:8]}"
    made: list[RabbitMQSettings] = []

    def make(**overrides: Any) -> RabbitMQSettings:
        values: dict[str, Any] = {
            "url": amqp_url,
            "queue": queue,
            "exchange": f"{queue}.in",
            "retry_delays": [0.2, 0.5],
            "reconnect_interval": 0.3,
            "settle_timeout": 5.0,
            **overrides,
        }
        made.append(RabbitMQSettings(**values))
        return made[-1]

    yield make
    delete_topologies(amqp_url, made)


@pytest.fixture(scope="session")
def tansu() -> Iterator[Tansu]:
    """An in-memory Tansu (Kafka) on a free loopback port, stopped (by PID) after the session."""
    with running_tansu() as broker:
        yield broker
