"""Databases the test kit owns, never the application's: a fresh, empty schema per run.

SQLite (the default): the worker's migrations and the models' tables are built once
into a template file, and each run gets a copy of it (a file copy: milliseconds).
PostgreSQL: given a ``postgresql+asyncpg://`` URL, the kit connects there only to
create a throwaway database of its own beside it (``CREATE DATABASE``, so the role
needs ``CREATEDB``), migrates it once, empties its tables before each run and drops it
at the end. The database named in the URL is never written to.

The schema is the worker's migrations (``worker migrate``'s), then ``create_all`` of
the models' metadata for any table the migrations do not create: a handler's table
is there without a migration of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Protocol

from sqlalchemy import MetaData, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.db import Base, create_engine, redact
from worker.errors import ConfigurationError
from worker.histories import is_version_table
from worker.migrate import upgrade


class Scratch(Protocol):
    """A database of the kit's own; :meth:`fresh` hands out an empty schema."""

    async def fresh(self, models: Sequence[MetaData] = ()) -> str:
        """The URL of a database with the whole schema (``models`` too) and no rows."""
        ...

    async def close(self) -> None: ...


def metadatas(extra: Sequence[MetaData] = ()) -> tuple[MetaData, ...]:
    """worker.Base's metadata (the worker's tables and every model on it), then ``extra``."""
    found = [Base.metadata]
    found.extend(m for m in extra if m is not Base.metadata)
    return tuple(found)


def _tables(models: Sequence[MetaData]) -> frozenset[str]:
    return frozenset(name for metadata in models for name in metadata.tables)


async def _build(url: str, models: Sequence[MetaData]) -> None:
    """The worker's migrations, then the models' tables the migrations do not create."""
    await asyncio.to_thread(upgrade, url)
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.begin() as connection:
            for metadata in models:
                await connection.run_sync(metadata.create_all)
    finally:
        await engine.dispose()


class SQLiteScratch:
    """A migrated template file in a temporary directory; each run gets a copy."""

    def __init__(self) -> None:
        self._directory = Path(tempfile.mkdtemp(prefix="worker-testing-"))
        self._template = self._directory / "template.db"
        self._built: frozenset[str] | None = None
        self._runs = 0
        self._lock = asyncio.Lock()

    async def fresh(self, models: Sequence[MetaData] = ()) -> str:
        models = metadatas(models)
        wanted = _tables(models)
        async with self._lock:
            if self._built is None or not wanted <= self._built:  # a model imported since
                self._template.unlink(missing_ok=True)
                await _build(f"sqlite+aiosqlite:///{self._template}", models)
                self._built = wanted
            self._runs += 1
            path = self._directory / f"run-{self._runs}.db"
            shutil.copyfile(self._template, path)
        return f"sqlite+aiosqlite:///{path}"

    async def close(self) -> None:
        shutil.rmtree(self._directory, ignore_errors=True)


class PostgresScratch:
    """A throwaway database on the server of ``server_url``, emptied for every run."""

    def __init__(self, server_url: str) -> None:
        self._server = server_url
        name = f"worker_testing_{uuid.uuid4().hex[:12]}"
        self.url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
        self._name = name
        self._built: frozenset[str] | None = None
        self._lock = asyncio.Lock()

    async def _admin(self, sql: str) -> None:
        engine = create_engine(self._server, pool_size=1)
        try:
            async with engine.connect() as connection:
                await connection.execution_options(isolation_level="AUTOCOMMIT")
                await connection.execute(text(sql))
        finally:
            await engine.dispose()

    async def fresh(self, models: Sequence[MetaData] = ()) -> str:
        models = metadatas(models)
        wanted = _tables(models)
        async with self._lock:
            if self._built is None:
                await self._admin(f'CREATE DATABASE "{self._name}"')
                await _build(self.url, models)
                self._built = wanted
            elif not wanted <= self._built:
                await _build(self.url, models)
                self._built = wanted
            engine = create_engine(self.url, pool_size=1)
            try:
                await _empty(engine)
            finally:
                await engine.dispose()
        return self.url

    async def close(self) -> None:
        if self._built is not None:
            await self._admin(f'DROP DATABASE IF EXISTS "{self._name}" WITH (FORCE)')
            self._built = None


async def _empty(engine: AsyncEngine) -> None:
    """Delete every row: a DELETE per table, far quicker than TRUNCATE on tables this
    small (sequences run on; no comparison reads a surrogate key). Tables that refer to
    each other in an order the DELETEs break are truncated together instead."""
    async with engine.connect() as connection:
        rows = await connection.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
        )
        names = sorted(name for name in rows.scalars() if not is_version_table(name))
        await connection.commit()
        try:
            for name in names:
                await connection.execute(text(f'DELETE FROM "{name}"'))
            await connection.commit()
        except IntegrityError:  # a foreign key: these go together
            await connection.rollback()
            listed = ", ".join(f'"{name}"' for name in names)
            await connection.execute(text(f"TRUNCATE {listed} CASCADE"))
            await connection.commit()


def open_scratch(database: str | None = None) -> Scratch:
    """SQLite files when ``database`` is None, else throwaway databases on its server."""
    if database is None:
        return SQLiteScratch()
    if database.startswith("postgresql+asyncpg://"):
        return PostgresScratch(database)
    raise ConfigurationError(
        f"test database {redact(database)!r}: give a postgresql+asyncpg:// URL of a server "
        "the kit may create databases on, or none for SQLite files"
    )


@contextlib.asynccontextmanager
async def scratch_for(database: str | Scratch | None) -> AsyncIterator[Scratch]:
    """``database`` as a scratch: one given is used as it is (its owner closes it)."""
    if database is not None and not isinstance(database, str):
        yield database
        return
    scratch = open_scratch(database)
    try:
        yield scratch
    finally:
        await scratch.close()
