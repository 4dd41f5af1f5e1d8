"""Schema migrations (Alembic), shipped inside the package, and the gate that waits for them.

``upgrade`` is safe to run from several places at once and from any point a
killed run stopped at: on PostgreSQL the migrator holds an advisory lock (a
second migrator waits for the first, then finds nothing left to do), each
revision commits on its own, and a DDL statement waits at most
``lock_timeout`` for its table lock (a waiting ``ALTER TABLE`` would otherwise
queue every worker's query behind it) before the run is retried.

``status`` compares the database's revision with the newest one this code
ships: the gate (``worker migrate --check`` / ``--wait``) a pod passes before
it takes work.
"""

from __future__ import annotations

import asyncio
import enum
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

MIGRATIONS = Path(__file__).with_name("migrations")
ADVISORY_LOCK_KEY = 0x1D3_7E57  # any constant; the same one in every release
LOCK_TIMEOUT = 5.0
"""Seconds one DDL statement may wait for its table lock before the attempt is given up."""
_LOCK_NOT_AVAILABLE = "55P03"
_ATTEMPTS = 5
_LOCK_WAIT = 1800.0  # seconds another migrator may hold the migration lock


def alembic_config(database_url: str, *, lock_timeout: float = LOCK_TIMEOUT) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would choke on a '%' in a URL-encoded password
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["lock_timeout"] = lock_timeout
    return config


def upgrade(
    database_url: str,
    revision: str = "head",
    *,
    lock_timeout: float = LOCK_TIMEOUT,
    attempts: int = _ATTEMPTS,
    on_retry: Callable[[int, BaseException], None] | None = None,
    inbox_layout: str = "table",
    partition_period: timedelta = timedelta(days=1),
) -> None:
    """Bring the database to ``revision``. Blocking: call it outside an event loop.

    A statement that gave up waiting for its lock (SQLSTATE 55P03) rolled back its
    own revision only; the run is repeated, with a pause, at most ``attempts`` times.
    ``inbox_layout="partitioned"`` then converts a plain inbox on PostgreSQL, online
    (:func:`worker.partitions.convert`), and makes its first partitions; the conversion
    is never undone by a later run with ``"table"``.
    """
    config = alembic_config(database_url, lock_timeout=lock_timeout)
    for attempt in range(1, attempts + 1):
        try:
            command.upgrade(config, revision)
            break
        except DBAPIError as exc:
            code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
            if code != _LOCK_NOT_AVAILABLE or attempt == attempts:
                raise
            if on_retry is not None:
                on_retry(attempt, exc)
            time.sleep(min(2.0 * attempt, 10.0))
    if inbox_layout == "partitioned" and revision == "head":
        asyncio.run(_partition(database_url, partition_period, lock_timeout, attempts, on_retry))


async def _partition(
    database_url: str,
    period: timedelta,
    lock_timeout: float,
    attempts: int,
    on_retry: Callable[[int, BaseException], None] | None,
) -> None:
    """The conversion to the partitioned inbox when asked for, under the migrator's lock,
    then its first partitions (the housekeeping loop makes the rest)."""
    from worker import partitions, retention, rollover
    from worker.db import create_engine

    tries = 0

    async def again(exc: BaseException) -> bool:
        nonlocal tries
        tries += 1
        if tries >= attempts:
            return False
        if on_retry is not None:
            on_retry(tries, exc)
        await asyncio.sleep(min(2.0 * tries, 10.0))
        return True

    engine = create_engine(database_url, pool_size=2, max_overflow=0)
    try:
        async with engine.connect() as connection:
            if connection.dialect.name != "postgresql":
                return  # SQLite keeps the plain table (the settings refuse it earlier)
            await _hold_migration_lock(connection)
            await connection.exec_driver_sql(f"SET lock_timeout = {int(lock_timeout * 1000)}")
            await connection.commit()
            if not await partitions.convert(connection, period, again):
                await partitions.refresh(connection)
        async with retention.exclusive(engine) as holder:
            if holder is not None:  # else a housekeeping pass is making them right now
                now = await retention.database_now(holder)
                ahead = now + rollover.lead(period, 0.0)
                await rollover.make_ahead(holder, period, ahead, now, rollover.Pass())
    finally:
        await engine.dispose()


async def _hold_migration_lock(connection: AsyncConnection) -> None:
    """The migrators' advisory lock, for this connection's session (released when it
    closes), polled as the Alembic environment polls it: a blocking wait would hold a
    snapshot that another migrator's concurrent index build waits for."""
    deadline = time.monotonic() + _LOCK_WAIT
    take = text("SELECT pg_try_advisory_lock(:key)")
    while not (await connection.execute(take, {"key": ADVISORY_LOCK_KEY})).scalar_one():
        await connection.commit()
        if time.monotonic() > deadline:
            raise TimeoutError(f"another migrator held the migration lock for {_LOCK_WAIT:.0f}s")
        await asyncio.sleep(0.5)
    await connection.commit()


class State(enum.Enum):
    AT_HEAD = "at head"
    BEHIND = "behind"  # older than this code, or never migrated
    AHEAD = "ahead"  # a revision this code does not know: a newer release migrated it


@dataclass(frozen=True)
class Status:
    state: State
    current: tuple[str, ...]
    heads: tuple[str, ...]

    @property
    def usable(self) -> bool:
        """At head, or ahead: expand-only migrations keep the previous release working."""
        return self.state is not State.BEHIND

    def describe(self) -> str:
        current = ",".join(self.current) or "none"
        return f"schema {self.state.value}: database at {current}, code at {','.join(self.heads)}"


def heads() -> tuple[str, ...]:
    return tuple(sorted(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()))


def status(database_url: str, *, timeout: float = 10.0) -> Status:
    """Where the database's schema stands. Raises when the database does not answer."""
    script = ScriptDirectory.from_config(alembic_config(database_url))
    code_heads = tuple(sorted(script.get_heads()))

    def current(connection: Connection) -> tuple[str, ...]:
        return tuple(sorted(MigrationContext.configure(connection).get_current_heads()))

    async def read() -> tuple[str, ...]:
        from worker.db import create_engine

        engine = create_engine(database_url, pool_size=1, max_overflow=0)
        try:
            async with asyncio.timeout(timeout), engine.connect() as connection:
                return await connection.run_sync(current)
        finally:
            await engine.dispose()

    revisions = asyncio.run(read())
    if revisions == code_heads:
        return Status(State.AT_HEAD, revisions, code_heads)
    known = {rev.revision for rev in script.walk_revisions()}
    if revisions and not set(revisions) <= known:
        return Status(State.AHEAD, revisions, code_heads)
    return Status(State.BEHIND, revisions, code_heads)


def _exit_on_signal(signum: int, _frame: object) -> None:
    # A migration stopped here rolls back its current revision; the next run repeats it.
    # As PID 1 without a handler, SIGTERM would be ignored until the kubelet's SIGKILL.
    raise SystemExit(128 + signum)


def migrate_command(
    database_url: str,
    *,
    check: bool = False,
    wait: bool = False,
    timeout: float = 600.0,
    lock_timeout: float = LOCK_TIMEOUT,
    poll_interval: float = 2.0,
    inbox_layout: str = "table",
    partition_period: timedelta = timedelta(days=1),
) -> int:
    """``worker migrate [--check | --wait]``: 0 once the schema is usable by this code."""
    from worker.db import redact
    from worker.logs import get_logger

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    log = get_logger(database=redact(database_url))
    if not check and not wait:

        def retrying(attempt: int, exc: BaseException) -> None:
            log.warning(
                "migration waited too long for a lock, retrying", attempt=attempt, error=exc
            )

        upgrade(
            database_url,
            lock_timeout=lock_timeout,
            on_retry=retrying,
            inbox_layout=inbox_layout,
            partition_period=partition_period,
        )
        log.info("migrated", revision=",".join(heads()), inbox=inbox_layout)
        return 0
    deadline = time.monotonic() + (0.0 if check else timeout)
    reported: str | None = None
    while True:
        try:
            found = status(database_url)
            line = found.describe()
        except Exception as exc:  # unreachable, refused, no such database: not yet
            if check:
                log.error("schema unknown: database unavailable", error=exc)
                return 1
            found, line = None, f"database unavailable: {type(exc).__name__}"
        if found is not None and found.usable:
            log.info("schema usable", status=line)
            return 0
        if check:
            log.error("schema not at head", status=line)
            return 1
        if line != reported:  # one line per change, not one per poll
            log.info("waiting for the schema", status=line, timeout_s=timeout)
            reported = line
        if time.monotonic() >= deadline:
            log.error("schema not at head in time", status=line, timeout_s=timeout)
            return 1
        # jittered, so the gates of many pods do not probe a returning database in step
        time.sleep(poll_interval * random.uniform(0.75, 1.25))
