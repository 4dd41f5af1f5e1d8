"""Engines, and what a database error means for the pump."""

from __future__ import annotations

import asyncio
import enum
import sqlite3
import traceback
from typing import Any

from sqlalchemy import MetaData, event, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.orm.exc import StaleDataError

from worker.errors import DatabaseUnreachable
from worker.logs import scrub

INBOX_CONSTRAINT = "uq_inbox_message_consumer"
"""The one unique constraint whose violation means "already processed"."""

_SQLITE_CONSTRAINT_UNIQUE = 2067
_SQLITE_INBOX_COLUMNS = "UNIQUE constraint failed: inbox.message_id, inbox.consumer"
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})  # serialization failure, deadlock
# "The database cannot serve you now": pause and probe, never blame the message.
# 08 connection exception, 28 invalid authorization (a rotated password), 53300 too many
# connections, 3D000 no such database, 57P0x the server shutting down or starting.
_UNAVAILABLE_SQLSTATE_CLASSES = ("08", "28")
_UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "3D000", "53300"})
_READ_ONLY = "25006"  # read_only_sql_transaction: a standby after a failover, maintenance
_PRIVILEGE = "42501"  # insufficient_privilege: a GRANT a migration forgot
# ... but not a row-level-security policy refusing this row: the statement's own
_ROW_POLICY = "row-level security"
_RESOURCES = "53"  # insufficient resources: disk full (53100), out of memory (53200), ...
# ... but 53400 (configuration_limit_exceeded: temp_file_limit) is one statement's own
_STATEMENT_LIMIT = "53400"
_QUERY_CANCELED = "57014"  # statement_timeout; contention when it tripped in a lock wait
# 42P01 undefined table, 42703 undefined column, 42883 undefined function: the schema is
# older than the code (a rollout ahead of its migration). Not the message's fault.
_SCHEMA_SQLSTATES = frozenset({"42P01", "42703", "42883"})
_LOCK_NOT_AVAILABLE = "55P03"  # lock_timeout ran out
# The modules an exception must have passed through to be the database's: a handler's
# own ConnectionRefusedError (an HTTP call) is not a lost database connection.
_DATABASE_MODULES = ("sqlalchemy.", "asyncpg", "aiosqlite", "sqlite3")


class Base(DeclarativeBase):
    """Declarative base for the inbox and every business model the worker migrates."""

    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "pk": "pk_%(table_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
        }
    )


POOLER = "pooler"
"""``?pooler=transaction`` on a PostgreSQL URL: a transaction-pooling proxy (PgBouncer's
``pool_mode = transaction``, pgcat, RDS Proxy) stands between the worker and the server."""


def _unnamed() -> str:
    return ""  # asyncpg: an unnamed statement, replaced by the next one, never left behind


def create_engine(url: str, *, pool_size: int = 5, max_overflow: int | None = None) -> AsyncEngine:
    """An async engine; SQLite files get WAL mode and a generous busy timeout.

    ``max_overflow`` (default: ``pool_size``): connections opened beyond the pool
    under load. ``pool_size + max_overflow`` is what one process may hold on the
    server, the figure the connection budget in deploy/README.md multiplies.

    ``?pooler=transaction`` on a PostgreSQL URL: behind a transaction-pooling proxy each
    transaction may run on another server connection, so asyncpg's named, cached
    prepared statements would meet connections that never saw them ("does not exist")
    or saw another client's of the same name ("already exists"). Statements are then
    unnamed and uncached: parsed again for each execution, never left on a server.

    PostgreSQL: every transaction says its isolation, ``BEGIN ISOLATION LEVEL READ
    COMMITTED``, instead of taking the session's default. A database or role whose
    ``default_transaction_isolation`` is stricter, or a handler's ``SET SESSION
    CHARACTERISTICS`` left on its pooled connection (or, behind a transaction pooler, on
    a server connection another client shares), would otherwise give the next attempt a
    snapshot the partitioned inbox's lookup cannot use (worker/partitions.py). A
    connection asked for another level (``execution_options(isolation_level=...)``) is
    set back when it returns to the pool. Autocommitted statements have no BEGIN: each
    runs alone in the session's default, which a single statement does not mind.
    """
    if url.startswith("sqlite"):
        engine = create_async_engine(url, pool_size=pool_size, connect_args={"timeout": 30})
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    else:
        parsed = make_url(url)
        pooler = parsed.query.get(POOLER)
        if pooler not in (None, "transaction", "session"):
            raise ValueError(f"{POOLER}={pooler!r}: must be transaction or session")
        options: dict[str, Any] = {}
        if pooler == "transaction":
            options["connect_args"] = {
                "statement_cache_size": 0,  # asyncpg's own cache of named statements
                "prepared_statement_cache_size": 0,  # SQLAlchemy's
                "prepared_statement_name_func": _unnamed,
            }
        overflow = pool_size if max_overflow is None else max_overflow
        engine = create_async_engine(
            parsed.difference_update_query([POOLER]),
            pool_size=pool_size,
            max_overflow=overflow,
            pool_pre_ping=False,
            isolation_level="READ COMMITTED",
            **options,
        )
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def insert_ignoring_conflicts(session: AsyncSession, model: Any) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING`` in the session's dialect (SQLite, PostgreSQL)."""
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(model).on_conflict_do_nothing()
    return sqlite.insert(model).on_conflict_do_nothing()


def redact(url: str) -> str:
    """The URL with its password masked: the only form a URL may take in a log.

    Split by hand, not by a URL parser: a raw ``@`` (or ``/``, ``#``) inside a password
    makes a parser split at the first one and take the password's tail for the host.
    Everything before the last ``@`` is the user information, and all of it after its
    first ``:`` is masked; secrets in the query (``?password=``) as in any log line.
    """
    scheme, sep, rest = url.partition("://")
    userinfo, at, place = rest.rpartition("@")
    if sep and at:
        user, colon, _password = userinfo.partition(":")
        url = f"{scheme}://{user}{':***' if colon else ''}@{place}"
    return scrub(url)


async def ping(engine: AsyncEngine) -> None:
    async with engine.connect() as connection:
        await connection.execute(text("SELECT 1"))


class Failure(enum.Enum):
    """What an exception raised during an attempt means for the pump."""

    DUPLICATE = "duplicate"  # the inbox constraint rejected the marker
    CONFLICT = "conflict"  # a version token did not match
    TRANSIENT = "transient"  # serialization failure, deadlock, a busy SQLite file
    CONNECTION = "connection"  # the connection broke or could not be made
    SCHEMA = "schema"  # a table or column the code needs is missing: not migrated yet
    LOCKED = "locked"  # lock_timeout on the marker: the same message is in progress elsewhere
    DATA = "data"  # a value the database refuses deterministically (SQLSTATE class 22)
    READ_ONLY = "read-only"  # the database takes no writes now (a standby, a read-only file)
    PRIVILEGE = "privilege"  # a privilege the worker's role lacks (a forgotten GRANT)
    RESOURCES = "resources"  # the server is out of disk or memory
    ERROR = "error"  # anything else, including other integrity errors

    @property
    def environment(self) -> bool:
        """The database cannot serve anyone now: never the message's failure."""
        return self in _ENVIRONMENT


_ENVIRONMENT = frozenset({Failure.READ_ONLY, Failure.PRIVILEGE, Failure.RESOURCES})


def classify(exc: BaseException) -> Failure:
    if isinstance(exc, DatabaseUnreachable):
        return Failure.CONNECTION
    if isinstance(exc, IntegrityError):
        return Failure.DUPLICATE if is_inbox_violation(exc) else Failure.ERROR
    if isinstance(exc, StaleDataError):
        return Failure.CONFLICT
    if isinstance(exc, PoolTimeout):  # every pooled connection busy: contention, not the message
        return Failure.TRANSIENT
    if isinstance(exc, DBAPIError):
        return _classify_driver(exc)
    if not from_database(exc):
        return Failure.ERROR
    if isinstance(exc, OSError):  # asyncpg raises refusals and resets unwrapped
        return Failure.CONNECTION
    if isinstance(exc, OverflowError):  # sqlite3 refuses to bind an int beyond 64 bits
        return Failure.DATA
    code = getattr(exc, "sqlstate", None)  # asyncpg's own errors, raised while connecting
    if isinstance(code, str) and _unavailable(code):
        return Failure.CONNECTION
    return Failure.ERROR


def _classify_driver(exc: DBAPIError) -> Failure:
    if exc.connection_invalidated:
        return Failure.CONNECTION
    code = sqlstate(exc)
    if code is not None:
        return _classify_sqlstate(code, exc)
    if _is_os_error(exc.orig):
        return Failure.CONNECTION
    if isinstance(exc.orig, sqlite3.OperationalError):
        return _classify_sqlite(exc.orig)
    return Failure.ERROR


def _classify_sqlstate(code: str, exc: DBAPIError) -> Failure:
    if code == _QUERY_CANCELED:
        return Failure.TRANSIENT if _in_lock_wait(exc) else Failure.ERROR
    if code in _RETRYABLE_SQLSTATES:
        return Failure.TRANSIENT
    if _unavailable(code):
        return Failure.CONNECTION
    if code in _SCHEMA_SQLSTATES:
        return Failure.SCHEMA
    if code == _LOCK_NOT_AVAILABLE:
        return Failure.LOCKED
    if code.startswith("22"):
        return Failure.DATA
    if code == _READ_ONLY:
        return Failure.READ_ONLY
    if code == _PRIVILEGE:
        return Failure.ERROR if _ROW_POLICY in str(exc.orig) else Failure.PRIVILEGE
    if code.startswith(_RESOURCES) and code != _STATEMENT_LIMIT:
        return Failure.RESOURCES
    return Failure.ERROR


def _in_lock_wait(exc: DBAPIError) -> bool:
    """A statement timeout that tripped while waiting for a row or table lock another
    session holds (PostgreSQL says so in the error's context): contention, not a slow query."""
    cause = getattr(exc.orig, "__cause__", None) or exc.orig
    context = str(getattr(cause, "context", "") or "")
    return context.startswith("while ") and ("locking" in context or "tuple" in context)


def from_database(exc: BaseException) -> bool:
    """True when the exception was raised inside the database layer (driver or SQLAlchemy)."""
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        if frame.f_globals.get("__name__", "").startswith(_DATABASE_MODULES):
            return True
    return False


def _unavailable(code: str | None) -> bool:
    return code is not None and (
        code in _UNAVAILABLE_SQLSTATES or code.startswith(_UNAVAILABLE_SQLSTATE_CLASSES)
    )


def is_inbox_violation(exc: IntegrityError) -> bool:
    """True only for a unique violation of exactly the inbox constraint."""
    orig = exc.orig
    if isinstance(orig, sqlite3.IntegrityError):
        return (
            getattr(orig, "sqlite_errorcode", None) == _SQLITE_CONSTRAINT_UNIQUE
            and str(orig) == _SQLITE_INBOX_COLUMNS
        )
    # asyncpg: the adapter's exception wraps UniqueViolationError as __cause__
    cause = getattr(orig, "__cause__", None)
    return getattr(cause, "sqlstate", None) == "23505" and (
        getattr(cause, "constraint_name", None) == INBOX_CONSTRAINT
    )


def sqlstate(exc: DBAPIError) -> str | None:
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    return code if isinstance(code, str) else None


def _is_os_error(orig: BaseException | None) -> bool:
    return isinstance(orig, OSError) or isinstance(getattr(orig, "__cause__", None), OSError)


def _classify_sqlite(orig: sqlite3.OperationalError) -> Failure:
    message = str(orig)
    if "readonly database" in message:
        return Failure.READ_ONLY
    if "database or disk is full" in message:
        return Failure.RESOURCES
    if "locked" in message or "busy" in message:
        return Failure.TRANSIENT
    if message.startswith(("no such table", "no such column")):
        return Failure.SCHEMA
    if "unable to open" in message or "disk I/O" in message:
        return Failure.CONNECTION
    return Failure.ERROR


_DISCARD_TIMEOUT = 5.0


async def discard(session: AsyncSession) -> None:
    """Close a session (rolling back what did not commit), whatever state it is in; a
    connection that does not answer its rollback in 5 s (a black hole) is dropped."""
    try:
        async with asyncio.timeout(_DISCARD_TIMEOUT):
            await AsyncSession.close(session)
    except Exception:  # a broken connection can fail its own rollback; the pool drops it
        await AsyncSession.invalidate(session)
