"""Schema migrations (Alembic): the worker's history and the applications', and the gate
that waits for them.

``upgrade`` runs the worker's history first, then the history of each application
WORKER_HANDLERS names (:mod:`worker.histories`), all on one connection. It is safe to
run from several places at once and from any point a killed run stopped at: on
PostgreSQL the migrator holds an advisory lock for the whole run (a second migrator
waits for the first, then finds nothing left to do), each revision commits on its own,
and a DDL statement waits at most ``lock_timeout`` for its table lock (a waiting
``ALTER TABLE`` would otherwise queue every worker's query behind it) before the run is
retried.

``status`` compares each history's revision in the database with the newest one this
code ships, and looks for the tables of the handlers' models: the gate
(``worker migrate --check`` / ``--wait``) a pod passes before it takes work.
"""

from __future__ import annotations

import asyncio
import enum
import random
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from worker import histories
from worker.db import create_engine, redact
from worker.errors import ConfigurationError, MigrationFailed
from worker.histories import LEGACY_VERSION_TABLE, MIGRATIONS, VERSION_TABLE, History
from worker.logs import get_logger
from worker.startup import database_refuses, reason

ADVISORY_LOCK_KEY = 0x1D3_7E57  # any constant; the same one in every release
LOCK_TIMEOUT = 5.0
"""Seconds one DDL statement may wait for its table lock before the attempt is given up."""
_LOCK_NOT_AVAILABLE = "55P03"
_ATTEMPTS = 5
_LOCK_WAIT = 1800.0  # seconds; the Job's activeDeadlineSeconds is the tighter bound
_LOCK_POLL = 0.5

T = TypeVar("T")


def alembic_config(history: History, *, lock_timeout: float = LOCK_TIMEOUT) -> Config:
    """Alembic's configuration for one history: the worker's environment (env.py, the
    revision template) with the history's revision folder and version table."""
    config = Config()
    config.set_main_option("script_location", _escaped(MIGRATIONS))
    config.set_main_option("path_separator", "os")
    config.set_main_option("version_locations", _escaped(history.versions))
    config.attributes["history"] = history
    config.attributes["lock_timeout"] = lock_timeout
    return config


def _escaped(path: Path) -> str:
    return str(path).replace("%", "%%")  # ConfigParser interpolation would take a '%'


def scripts(history: History) -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config(history))


def heads(history: History | None = None) -> tuple[str, ...]:
    """The newest revisions ``history`` ships (the worker's by default)."""
    return tuple(sorted(scripts(history or histories.WORKER).get_heads()))


def _on_one_connection(
    database_url: str, work: Callable[[Connection], T], *, timeout: float | None = None
) -> T:
    """``work`` on one connection of its own (what the connection budget counts for the
    Job and the gate), committed at the end. Blocking: call it outside an event loop."""

    async def run() -> T:
        engine = create_engine(database_url, pool_size=1, max_overflow=0)
        try:
            async with asyncio.timeout(timeout), engine.connect() as connection:
                result = await connection.run_sync(work)
                await connection.commit()
                return result
        finally:
            await engine.dispose()

    return asyncio.run(run())


def upgrade(
    database_url: str,
    revision: str = "heads",
    *,
    applications: Sequence[History] = (),
    lock_timeout: float = LOCK_TIMEOUT,
    attempts: int = _ATTEMPTS,
    on_retry: Callable[[int, BaseException], None] | None = None,
    inbox_layout: str = "table",
    partition_period: timedelta = timedelta(days=1),
) -> None:
    """Bring the worker's history to ``revision`` (its newest by default), then each of
    ``applications`` to its newest. Blocking: call it outside an event loop.

    A statement that gave up waiting for its lock (SQLSTATE 55P03) rolled back its
    own revision only; the run is repeated, with a pause, at most ``attempts`` times.
    ``inbox_layout="partitioned"`` then converts a plain inbox on PostgreSQL, online
    (:func:`worker.partitions.convert`), and makes its first partitions; the conversion
    is never undone by a later run with ``"table"``.
    """
    chain = (histories.WORKER, *applications)

    def run(connection: Connection) -> None:
        _upgrade_on(connection, chain, revision, lock_timeout)

    for attempt in range(1, attempts + 1):
        try:
            _on_one_connection(database_url, run)
            break
        except DBAPIError as exc:
            code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
            if code != _LOCK_NOT_AVAILABLE or attempt == attempts:
                raise
            if on_retry is not None:
                on_retry(attempt, exc)
            time.sleep(min(2.0 * attempt, 10.0))
    if inbox_layout == "partitioned" and revision in ("head", "heads"):
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
        await asyncio.sleep(_LOCK_POLL)
    await connection.commit()


def _upgrade_on(
    connection: Connection, chain: Sequence[History], revision: str, lock_timeout: float
) -> None:
    if connection.dialect.name == "postgresql":
        _prepare_postgresql(connection, lock_timeout)
    adopt_legacy_revision(connection)
    for history in chain:
        config = alembic_config(history, lock_timeout=lock_timeout)
        # Alembic manages the transactions (one per revision) only on a connection that is
        # not inside one when the environment is configured.
        connection.commit()
        config.attributes["connection"] = connection
        try:
            command.upgrade(config, revision if history.is_workers else "heads")
        except CommandError as exc:
            raise MigrationFailed(f"{history.name}: {exc}") from exc
    connection.commit()


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


def _prepare_postgresql(connection: Connection, lock_timeout: float) -> None:
    # The advisory lock is a session lock: it ends with the connection, also when a
    # revision fails or the process is killed.
    _take_advisory_lock(connection)
    connection.execute(text(f"SET lock_timeout = {int(lock_timeout * 1000)}"))
    version = connection.execute(text("SHOW server_version_num")).scalar_one()
    if int(version) >= 140000:
        # A migrator killed while its statement runs (a long CREATE INDEX
        # CONCURRENTLY) would otherwise leave the server finishing it unobserved,
        # advisory lock held; with a check the server ends it within seconds.
        connection.execute(text("SET client_connection_check_interval = 2000"))
    connection.commit()  # the session settings and the lock outlive this transaction


# Releases before the split kept one history of revisions 0001-0004 in alembic_version;
# these tables say how far a database got when that table does not tell (a user's own
# revision was added on top of the worker's and recorded instead).
_LEGACY_EVIDENCE = (("0004", {"consumer_offsets", "delivery_counts"}), ("0003", {"outbox"}))
# The revisions the single history had when it was split; ``alembic_version`` can hold no
# other worker revision (a later id found there is a user's own, e.g. their 0005).
_LEGACY_REVISIONS = ("0004", "0003", "0002", "0001")


def adopt_legacy_revision(connection: Connection) -> str | None:
    """Record the worker's revision of a database migrated before the split, once.

    Such a database has the worker's tables and the example handlers' ``accounts`` and
    ``products`` under one revision in ``alembic_version``. Its worker revision is copied
    into ``worker_alembic_version`` (a new table); nothing else is touched: no existing
    table is altered, locked or dropped (the inbox keeps deduplicating throughout), and
    ``alembic_version`` stays as it was, so the previous release's gate and migration
    still find it at their head after a rollback. The example tables are then the
    application's: its history creates only what is missing. Returns the revision
    recorded, or None when there was nothing to adopt.
    """
    worker_versions = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    if worker_versions.get_current_heads():
        return None
    present = set(inspect(connection).get_table_names())
    if "inbox" not in present:
        return None  # a new database: the worker's history creates everything
    script = scripts(histories.WORKER)
    recorded: tuple[str, ...] = ()
    if LEGACY_VERSION_TABLE in present:
        recorded = MigrationContext.configure(connection).get_current_heads()
    known = [rev for rev in _LEGACY_REVISIONS if rev in recorded]  # newest first
    if known:
        revision, source = known[0], LEGACY_VERSION_TABLE
    else:
        # 0001 and 0002 create only what is missing: repeating them is harmless
        found = (rev for rev, tables in _LEGACY_EVIDENCE if tables <= present)
        revision, source = next(found, "0001"), "the tables present"
    worker_versions.stamp(script, revision)
    connection.commit()
    get_logger().info(
        "worker revision adopted", revision=revision, source=source, table=VERSION_TABLE
    )
    return revision


class State(enum.Enum):
    AT_HEAD = "at head"
    BEHIND = "behind"  # older than this code, or never migrated
    AHEAD = "ahead"  # a revision this code does not know: a newer release migrated it


@dataclass(frozen=True)
class Standing:
    """Where one history stands: the database's revisions against the code's newest."""

    history: str
    state: State
    current: tuple[str, ...]
    heads: tuple[str, ...]

    def describe(self) -> str:
        current = ",".join(self.current) or "none"
        return f"{self.history}: database at {current}, code at {','.join(self.heads)}"


@dataclass(frozen=True)
class Status:
    """Every history's standing, and the tables of the handlers' models that are missing."""

    standings: tuple[Standing, ...]
    missing: tuple[str, ...] = ()

    @property
    def state(self) -> State:
        states = {standing.state for standing in self.standings}
        if self.missing or State.BEHIND in states:
            return State.BEHIND
        return State.AHEAD if State.AHEAD in states else State.AT_HEAD

    @property
    def usable(self) -> bool:
        """At head, or ahead: expand-only migrations keep the previous release working."""
        return self.state is not State.BEHIND

    def describe(self) -> str:
        parts = [standing.describe() for standing in self.standings]
        if self.missing:
            parts.append(f"tables missing: {', '.join(self.missing)}")
        return f"schema {self.state.value}: " + "; ".join(parts)


def _standing(history: History, script: ScriptDirectory, current: tuple[str, ...]) -> Standing:
    code = tuple(sorted(script.get_heads()))
    if current == code:
        return Standing(history.name, State.AT_HEAD, current, code)
    known = {rev.revision for rev in script.walk_revisions()}
    if current and not set(current) <= known:
        return Standing(history.name, State.AHEAD, current, code)
    return Standing(history.name, State.BEHIND, current, code)


def status(
    database_url: str,
    applications: Sequence[History] = (),
    *,
    tables: Iterable[str] = (),
    timeout: float = 10.0,
) -> Status:
    """Where the database's schema stands: the worker's history, then ``applications``,
    and which of ``tables`` (the models' tables) it lacks. Raises when it does not answer."""
    chain = (histories.WORKER, *applications)
    wanted = set(tables)

    def read(connection: Connection) -> tuple[list[tuple[str, ...]], set[str]]:
        current = [
            tuple(
                sorted(
                    MigrationContext.configure(
                        connection, opts={"version_table": history.version_table}
                    ).get_current_heads()
                )
            )
            for history in chain
        ]
        present = set(inspect(connection).get_table_names()) if wanted else set()
        return current, present

    current, present = _on_one_connection(database_url, read, timeout=timeout)
    standings = tuple(
        _standing(history, scripts(history), revisions)
        for history, revisions in zip(chain, current, strict=True)
    )
    return Status(standings, tuple(sorted(wanted - present)))


def revision(
    history: History,
    message: str,
    *,
    database_url: str | None = None,
    rev_id: str | None = None,
) -> Path:
    """Write a new, empty revision into ``history``'s folder, creating the folder if need be;
    with ``database_url``, autogenerated: what the history's models need that the database
    (at head) lacks. Returns the new file."""
    if histories.installed(history.versions):
        raise ConfigurationError(
            f"worker revision: {history.versions} is in an installed package: run it from "
            f"your project's source tree, where {history.name!r} is imported from your files"
        )
    history.versions.mkdir(parents=True, exist_ok=True)
    config = alembic_config(history)

    def write(connection: Connection | None) -> Path:
        if connection is not None:
            config.attributes["connection"] = connection
            config.attributes["autogenerate"] = True
        try:
            made = command.revision(
                config, message=message, autogenerate=connection is not None, rev_id=rev_id
            )
        except CommandError as exc:
            raise MigrationFailed(f"{history.name}: {exc}") from exc
        script = made[0] if isinstance(made, list) else made
        assert isinstance(script, Script), "alembic wrote no revision"
        return Path(script.path)

    if database_url is None:
        return write(None)
    return _on_one_connection(database_url, write)


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
    applications: Sequence[History] = (),
    tables: Iterable[str] = (),
    inbox_layout: str = "table",
    partition_period: timedelta = timedelta(days=1),
) -> int:
    """``worker migrate [--check | --wait]``: 0 once the schema is usable by this code.

    ``applications``: the histories to run after the worker's; ``tables``: the tables the
    handlers' models need (``--check`` and ``--wait`` fail while one is missing).
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    log = get_logger(database=redact(database_url))
    tables = tuple(tables)
    if not check and not wait:

        def retrying(attempt: int, exc: BaseException) -> None:
            log.warning(
                "migration waited too long for a lock, retrying", attempt=attempt, error=exc
            )

        upgrade(
            database_url,
            applications=applications,
            lock_timeout=lock_timeout,
            on_retry=retrying,
            inbox_layout=inbox_layout,
            partition_period=partition_period,
        )
        found = status(database_url, applications, tables=tables)
        log.info("migrated", status=found.describe(), inbox=inbox_layout)
        if found.missing:
            # Exit 0 all the same: an application with an Alembic environment of its own
            # creates its tables after this, and the gate waits for them.
            log.warning(
                "tables of the handlers' models missing: no revision creates them",
                tables=list(found.missing),
                hint="worker revision -m 'what it adds' --autogenerate (README: your own handlers)",
            )
        return 0
    deadline = time.monotonic() + (0.0 if check else timeout)
    reported: str | None = None
    while True:
        gate: Status | None
        try:
            gate = status(database_url, applications, tables=tables)
            line = gate.describe()
        except Exception as exc:  # unreachable: not yet
            if check and database_refuses(exc):  # a refused login, no database: one line
                raise  # (the gate's --wait waits on: the database may be created meanwhile)
            if check:
                cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig else exc
                log.error("schema unknown: database unavailable", error=reason(cause))
                return 1
            gate, line = None, f"database unavailable: {type(exc).__name__}"
        if gate is not None and gate.usable:
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
