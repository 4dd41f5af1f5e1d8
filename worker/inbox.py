"""The inbox: one marker per (message id, consumer), unique by a named constraint."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    UniqueConstraint,
    bindparam,
    func,
    literal,
    select,
    text,
)
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, Session, mapped_column
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from worker.db import INBOX_CONSTRAINT, Base
from worker.partitions import ADMIT

CLAIMED, FINISHED, ABANDONED = "claimed", "finished", "abandoned"
"""A marker's ``state``: a regular marker is finished the moment it commits; a side
effect's claim is claimed until its call is recorded (worker.leases)."""

MESSAGE_ID_LENGTH = 255
"""Longer dedup keys cannot be stored: the pump dead-letters such a message at once."""


class InboxMarker(Base):
    """Proof that ``consumer`` processed ``message_id``.

    A surrogate, increasing bigint key keeps inserts at the right edge of the
    primary-key index; the dedup key lives in the named unique constraint.
    """

    __tablename__ = "inbox"
    __table_args__ = (
        UniqueConstraint("message_id", "consumer", name=INBOX_CONSTRAINT),
        # The purge walks finished markers by age; the sweeper finds expired claims.
        # Only claims have a lease, so the partial index costs regular markers nothing.
        Index("ix_inbox_processed_at", "processed_at"),
        Index(
            "ix_inbox_lease_until",
            "lease_until",
            postgresql_where=text("lease_until IS NOT NULL"),
            sqlite_where=text("lease_until IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), Identity(), primary_key=True
    )
    message_id: Mapped[str] = mapped_column(String(MESSAGE_ID_LENGTH))
    consumer: Mapped[str] = mapped_column(String(255))
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    processed_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    # Two-phase claims (worker.claims). Server defaults only: a regular marker's
    # INSERT names two columns and is "finished" the moment it commits.
    state: Mapped[str] = mapped_column(String(16), server_default="finished")
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    claimed_by: Mapped[str | None] = mapped_column(String(128))
    attempts: Mapped[int] = mapped_column(Integer, server_default="1")
    outcome: Mapped[str | None] = mapped_column(String(255))
    message_type: Mapped[str | None] = mapped_column(String(255))
    body: Mapped[bytes | None] = mapped_column(LargeBinary)


TABLE = cast(Table, InboxMarker.__table__)
_table = TABLE


class Statement:
    """A statement the pump runs on every delivery, compiled once per dialect.

    It runs as the driver's own SQL (``Connection.exec_driver_sql``) inside the
    session's transaction: no ORM execute, no cache-key walk, no compiled-cache lookup,
    and still SQLAlchemy's error translation and its ``handle_error`` event
    (worker/db.py), so a duplicate is the same ``IntegrityError`` as ever. Call the
    methods through ``AsyncSession.run_sync``: one greenlet hop, as ``execute`` takes.
    """

    __slots__ = ("_by_dialect", "statement")

    def __init__(self, statement: ClauseElement) -> None:
        self.statement = statement
        self._by_dialect: dict[str, tuple[str, tuple[str, ...] | None, dict[str, Any]]] = {}

    def run(self, session: Session, params: dict[str, Any]) -> CursorResult[Any]:
        connection = session.connection()
        dialect = connection.dialect
        compiled = self._by_dialect.get(dialect.name)
        if compiled is None:
            done = self.statement.compile(dialect=dialect)
            assert isinstance(done, SQLCompiler)
            names = tuple(done.positiontup or ()) if done.positional else None
            compiled = self._by_dialect[dialect.name] = (done.string, names, dict(done.params))
        sql, names, defaults = compiled
        if defaults:
            params = {**defaults, **params}
        if names is None:  # a named paramstyle (neither asyncpg nor aiosqlite has one)
            return connection.exec_driver_sql(sql, params)
        return connection.exec_driver_sql(sql, tuple(map(params.__getitem__, names)))

    def one(self, session: Session, params: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(self.run(session, params).one())

    def exists(self, session: Session, params: dict[str, Any]) -> bool:
        return self.run(session, params).first() is not None


# Plain SQL, not insert(): a Core insert compiles with RETURNING inbox.id on PostgreSQL.
MARK = Statement(text("INSERT INTO inbox (message_id, consumer) VALUES (:m, :c)"))
_EXISTS = Statement(
    select(literal(1))
    .where(_table.c.message_id == bindparam("m"), _table.c.consumer == bindparam("c"))
    .where(_table.c.state == "finished")  # a claimed or abandoned side effect is not done
    .limit(1)
)


# PostgreSQL, redeliveries only: the fast-path check also bounds how long the marker
# insert may wait for another transaction holding the same key (a slow attempt of the
# same message elsewhere), and the insert puts the previous lock_timeout back, so the
# handler's own statements wait as long as they always did. Same round trips as the
# plain fast path + marker; a first delivery never pays for any of it.
_PROBE = Statement(
    text(
        "WITH previous AS MATERIALIZED (SELECT current_setting('lock_timeout') AS value) "
        "SELECT previous.value, set_config('lock_timeout', :t, true), "
        "EXISTS (SELECT 1 FROM inbox WHERE message_id = :m AND consumer = :c) FROM previous"
    )
)
_MARK_THEN_RESTORE = Statement(
    text(
        "WITH marked AS (INSERT INTO inbox (message_id, consumer) VALUES (:m, :c) RETURNING 1) "
        "SELECT set_config('lock_timeout', :previous, true) FROM marked"
    )
)


# PostgreSQL, keyed handlers: a transaction-level advisory lock on the key, taken before the
# marker, queues writers of one key across processes in the database (blocking is the
# feature) instead of letting them collide on a version token. The first delivery's lock
# and marker share one round trip.
_KEY_LOCK = "pg_advisory_xact_lock(hashtextextended('worker-key:' || :k, 0))"
_LOCK_KEY = Statement(text(f"SELECT {_KEY_LOCK}"))
_LOCK_KEY_THEN_MARK = Statement(
    text(
        f"WITH locked AS MATERIALIZED (SELECT {_KEY_LOCK}) "
        "INSERT INTO inbox (message_id, consumer) SELECT :m, :c FROM locked"
    )
)


async def lock_key(session: AsyncSession, key: str) -> None:
    """PostgreSQL: hold ``key`` until this transaction ends (other holders wait)."""
    await session.run_sync(_LOCK_KEY.run, {"k": key})


async def mark_keyed(session: AsyncSession, message_id: str, consumer: str, key: str) -> None:
    """PostgreSQL: :func:`lock_key`, then :func:`mark`, in one round trip."""
    await session.run_sync(_LOCK_KEY_THEN_MARK.run, {"k": key, "m": message_id, "c": consumer})


async def mark_redelivery(
    session: AsyncSession,
    message_id: str,
    consumer: str,
    lock_timeout_ms: int,
    *,
    fast_path: bool,
    key: str | None = None,
) -> bool:
    """PostgreSQL: True when already processed (fast path); else insert the marker.

    The insert (and the key's lock, for a keyed handler) waits at most
    ``lock_timeout_ms`` for a concurrent holder, then fails with SQLSTATE 55P03
    (``Failure.LOCKED``): in progress elsewhere.
    """
    params = {"t": f"{lock_timeout_ms}ms", "m": message_id, "c": consumer}
    row = await session.run_sync(_PROBE.one, params)
    if fast_path and row[2]:
        return True
    if key is not None:
        await lock_key(session, key)
    restore = {"m": message_id, "c": consumer, "previous": row[0]}
    await session.run_sync(_MARK_THEN_RESTORE.run, restore)
    return False


async def mark(session: AsyncSession, message_id: str, consumer: str) -> None:
    """Insert the marker in the session's transaction; a duplicate raises IntegrityError.

    The pump calls this *before* the handler: on PostgreSQL a concurrent
    replica inserting the same key then waits for this transaction, and gets
    the unique violation without running the handler at all.
    """
    await session.run_sync(MARK.run, {"m": message_id, "c": consumer})


async def seen(session: AsyncSession, message_id: str, consumer: str) -> bool:
    """The fast path for redeliveries. Never the guarantee: the constraint is."""
    return await session.run_sync(_EXISTS.exists, {"m": message_id, "c": consumer})


# A group (worker.transaction): one statement marks many messages and reports which are
# new. The ids arrive sorted, so two groups sharing ids take their keys in one order and
# cannot deadlock on each other's markers. On the plain table the admission function is
# `SELECT true` and ON CONFLICT DO NOTHING decides: it still waits for a concurrent
# uncommitted insert of the same key (blocking is the feature), then reports it not new.
# On the partitioned inbox the function takes each key's lock and looks in every
# partition (worker/partitions.py): a key already there is filtered out, never raised.
_MARK_MANY_POSTGRES = text(
    "INSERT INTO inbox (message_id, consumer) "
    "SELECT m, CAST(:c AS varchar) FROM unnest(CAST(:ids AS varchar[])) AS m "
    f"WHERE {ADMIT}(m, CAST(:c AS varchar)) ON CONFLICT DO NOTHING RETURNING message_id"
)
# SQLite: "WHERE true" tells the parser the ON CONFLICT is the upsert, not a join's ON.
_MARK_MANY_SQLITE = text(
    "INSERT INTO inbox (message_id, consumer) SELECT value, :c FROM json_each(:ids) WHERE true "
    "ON CONFLICT (message_id, consumer) DO NOTHING RETURNING message_id"
)
_UNMARK = text("DELETE FROM inbox WHERE message_id = :m AND consumer = :c")


async def mark_many(session: AsyncSession, message_ids: list[str], consumer: str) -> set[str]:
    """Insert markers for distinct ``message_ids``; returns the ids that were new.

    Sorted, so two groups sharing ids take their keys in one order and never deadlock.
    """
    ordered = sorted(message_ids)
    if session.get_bind().dialect.name != "postgresql":
        rows = await session.execute(_MARK_MANY_SQLITE, {"c": consumer, "ids": json.dumps(ordered)})
        return set(rows.scalars())
    rows = await session.execute(_MARK_MANY_POSTGRES, {"c": consumer, "ids": ordered})
    return set(rows.scalars())


async def unmark(session: AsyncSession, message_id: str, consumer: str) -> None:
    """Take back a marker this transaction inserted (a group member whose handler failed)."""
    await session.execute(_UNMARK, {"m": message_id, "c": consumer})
