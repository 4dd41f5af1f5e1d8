"""Alembic environment: runs the package's migrations on the configured async engine."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from worker.db import Base, create_engine

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_engine(url, pool_size=1)
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
