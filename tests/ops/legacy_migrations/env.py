"""Alembic environment: runs the package's migrations on the configured async engine.

On PostgreSQL the run holds a session advisory lock, so two migrators (a Job and
an operator, two Jobs of overlapping releases) take turns instead of racing on
the same ``CREATE TABLE``. Each revision commits on its own
(``transaction_per_migration``): a run killed in revision N keeps N-1 and
repeats N, which every revision is written to allow.
"""

from __future__ import annotations

import asyncio
import time

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from worker.db import Base, create_engine
from worker.migrate import ADVISORY_LOCK_KEY, LOCK_TIMEOUT

config = context.config
target_metadata = Base.metadata
_LOCK_WAIT = 1800.0  # seconds; the Job's activeDeadlineSeconds is the tighter bound
_LOCK_POLL = 0.5


def _take_advisory_lock(connection: Connection) -> None:
    """Wait for the other migrator by polling, each try its own short transaction.

    Blocking in ``pg_advisory_lock`` would hold a snapshot while waiting, and the
    other migrator's CREATE INDEX CONCURRENTLY waits for every older snapshot:
    a deadlock.
    """
    deadline = time.monotonic() + _LOCK_WAIT
    take = text("SELECT pg_try_advisory_lock(:key)")
    while not connection.execute(take, {"key": ADVISORY_LOCK_KEY}).scalar_one():
        connection.commit()
        if time.monotonic() > deadline:
            raise TimeoutError(f"another migrator held the migration lock for {_LOCK_WAIT:.0f}s")
        time.sleep(_LOCK_POLL)
    connection.commit()


def _prepare_postgresql(connection: Connection) -> None:
    _take_advisory_lock(connection)
    timeout_ms = int(float(config.attributes.get("lock_timeout", LOCK_TIMEOUT)) * 1000)
    connection.execute(text(f"SET lock_timeout = {timeout_ms}"))
    version = connection.execute(text("SHOW server_version_num")).scalar_one()
    if int(version) >= 140000:
        # A migrator killed while its statement runs (a long CREATE INDEX
        # CONCURRENTLY) would otherwise leave the server finishing it unobserved,
        # advisory lock held; with a check the server ends it within seconds.
        connection.execute(text("SET client_connection_check_interval = 2000"))
    connection.commit()  # the session settings and the lock outlive this transaction


def _run(connection: Connection) -> None:
    # The advisory lock is a session lock: it ends with the connection, also when a
    # revision fails or the process is killed.
    if connection.dialect.name == "postgresql":
        _prepare_postgresql(connection)
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_engine(url, pool_size=1, max_overflow=0)  # one connection, budgeted
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


url = config.get_main_option("sqlalchemy.url")
assert url, "worker.migrate sets sqlalchemy.url"
if context.is_offline_mode():
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async(url))
