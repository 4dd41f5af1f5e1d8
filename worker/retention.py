"""Inbox retention: purge finished markers once no broker can redeliver their message.

The window is :attr:`Settings.retention`, validated at start to be at least
the redelivery window (lock timeout x max deliveries + message TTL + a margin
for dead letters re-submitted late): a marker purged earlier reopens the door
to the very duplicate it was keeping out.

The purge deletes in small batches, each its own short transaction (bounded
rows per statement and statements per run), so it never holds many row locks
for long. Only finished markers are deleted: an unfinished claim is the only
record that a side effect may still be owed. Abandoned claims (their message
was dead-lettered) are finished for retention: a new delivery takes an
abandoned claim over exactly as if it were absent, so deleting one after the
window changes no dedup decision; it only ends the operator's record of it.
One replica purges at a time: on PostgreSQL whoever holds a session advisory
lock; on SQLite the process (SQLite is one host's file) skips a purge already
running in it.

A partitioned inbox (``WORKER_INBOX_LAYOUT=partitioned``, :mod:`worker.partitions`) is
never purged row by row: the same pass, under the same lock, makes its partitions ahead
and drops the ones past the retention whole (:mod:`worker.rollover`). Which one runs is
the database's layout, not the setting's: a database converted while this replica ran
is rolled over from then on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Table, any_, bindparam, delete, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, async_sessionmaker

from worker import attempts, metrics, partitions, rollover, sweeper
from worker.errors import ConfigurationError
from worker.inbox import ABANDONED, FINISHED, InboxMarker
from worker.logs import get_logger

if TYPE_CHECKING:
    from worker.registry import Registry
    from worker.settings import Settings

PURGE_LOCK = 0x776F726B_70757267  # "workpurg": the advisory lock key every replica agrees on

_inbox = cast(Table, InboxMarker.__table__)
_OLDEST_FINISHED = (
    select(_inbox.c.id)
    .where(
        or_(_inbox.c.state == FINISHED, _inbox.c.state == ABANDONED),
        _inbox.c.processed_at < bindparam("cutoff"),
    )
    .order_by(_inbox.c.processed_at)
    .limit(bindparam("batch"))
)
# Oldest first along ix_inbox_processed_at; the LIMIT bounds the rows (and locks) per statement.
# On PostgreSQL ``id IN (subquery)`` may be planned as a hash join over a full scan of the
# inbox; ``id = ANY(ARRAY(subquery))`` runs the subquery once and deletes by primary key.
PURGE_BATCH = {
    "postgresql": delete(_inbox).where(
        _inbox.c.id == any_(func.array(_OLDEST_FINISHED.scalar_subquery()))
    ),
    "sqlite": delete(_inbox).where(_inbox.c.id.in_(_OLDEST_FINISHED.scalar_subquery())),
}

_purging: set[str] = set()  # SQLite databases this process is purging right now


@dataclass(frozen=True, slots=True)
class PurgeResult:
    ran: bool  # False: another purger held the lock
    deleted: int
    batches: int
    cutoff: datetime
    rollover: rollover.Pass | None = None  # the partitioned inbox: partitions, not rows


async def advisory_lock(connection: AsyncConnection, key: int) -> bool:
    """Try to take a PostgreSQL session advisory lock; True if this connection now holds it.

    PostgreSQL only: SQLite has no advisory locks, and pretending would let two
    processes believe they were alone.
    """
    if connection.dialect.name != "postgresql":
        raise ConfigurationError(
            f"advisory locks need PostgreSQL, not {connection.dialect.name}; "
            "on SQLite only one process may purge the inbox"
        )
    taken = bool(await connection.scalar(select(func.pg_try_advisory_lock(key))))
    await connection.commit()  # the lock is the session's and outlives this transaction
    return taken


@asynccontextmanager
async def exclusive(
    engine: AsyncEngine, key: int = PURGE_LOCK
) -> AsyncIterator[AsyncConnection | None]:
    """A connection if this process is the one purger now, else None (someone else is)."""
    if engine.dialect.name == "sqlite":
        database = engine.url.render_as_string(hide_password=True)
        if database in _purging:
            yield None
            return
        _purging.add(database)
        try:
            async with engine.connect() as connection:
                yield connection
        finally:
            _purging.discard(database)
        return
    connection = await engine.connect()
    try:
        if not await advisory_lock(connection, key):
            yield None
            return
        try:
            yield connection
        finally:
            try:
                await connection.rollback()
                await connection.scalar(select(func.pg_advisory_unlock(key)))
                await connection.commit()
            except BaseException:
                # A pooled connection must never keep the lock: closing it for
                # good is what releases a session lock for sure.
                await connection.invalidate()
                raise
    finally:
        await connection.close()


async def database_now(connection: AsyncConnection) -> datetime:
    """The database server's current time (UTC): markers are stamped with its clock."""
    value = await connection.scalar(select(func.current_timestamp()))
    await connection.commit()
    if isinstance(value, str):  # SQLite: 'YYYY-MM-DD HH:MM:SS', UTC
        value = datetime.fromisoformat(value)
    stamp = cast(datetime, value)
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)


async def purge(
    engine: AsyncEngine,
    settings: Settings,
    *,
    now: datetime | None = None,
    pause: float = 0.01,
    log: Any = None,
) -> PurgeResult:
    """Delete finished markers older than the retention window, in bounded batches.

    Each batch commits on its own (a bulk delete outside one long transaction is
    right here), with ``pause`` seconds between batches for live traffic. The cutoff
    is computed from the database's clock unless ``now`` is given, so a worker whose
    own clock runs ahead cannot purge markers early.
    """
    deleted = batches = counts = 0
    passed: rollover.Pass | None = None
    async with exclusive(engine) as connection:
        if connection is None:
            return PurgeResult(False, 0, 0, (now or datetime.now(UTC)) - settings.retention)
        if now is None:  # the database's clock, the one that wrote processed_at
            now = await database_now(connection)
        cutoff = now - settings.retention
        if await partitions.layout(connection) == "partitioned":
            passed = await rollover.run(
                connection,
                period=settings.partition_period,
                retention=settings.retention,
                interval=settings.purge_interval,
                now=now,
            )
        else:
            deleted, batches = await _delete_batches(connection, settings, cutoff, pause)
        # delivery counts (WORKER_DELIVERY_COUNTS=database) age out with the markers
        counts = await attempts.purge(
            connection, cutoff, settings.purge_batch, settings.purge_max_batches
        )
    if log is not None and counts:
        log.info("delivery counts purged", deleted=counts, cutoff=cutoff.isoformat())
    if log is not None and deleted:
        log.info("inbox purged", deleted=deleted, batches=batches, cutoff=cutoff.isoformat())
    if log is not None and passed is not None:
        _log_rollover(log, passed, cutoff)
    return PurgeResult(True, deleted, batches, cutoff, passed)


async def _delete_batches(
    connection: AsyncConnection, settings: Settings, cutoff: datetime, pause: float
) -> tuple[int, int]:
    """The plain table: finished markers older than ``cutoff``, a bounded batch at a time."""
    deleted = batches = 0
    statement = PURGE_BATCH[connection.dialect.name]
    for _ in range(settings.purge_max_batches):
        result = await connection.execute(
            statement, {"cutoff": cutoff, "batch": settings.purge_batch}
        )
        await connection.commit()
        batches += 1
        deleted += result.rowcount
        if result.rowcount < settings.purge_batch:
            break
        await asyncio.sleep(pause)
    return deleted, batches


def _log_rollover(log: Any, passed: rollover.Pass, cutoff: datetime) -> None:
    if passed.created or passed.dropped:
        log.info(
            "inbox partitions rolled over",
            created=passed.created,
            dropped=passed.dropped,
            claims_carried=passed.carried,
            cutoff=cutoff.isoformat(),
        )
    if passed.postponed:
        log.warning(
            "inbox partition steps postponed: their locks stayed taken",
            steps=passed.postponed,
            lock_timeout_s=rollover.LOCK_TIMEOUT,
        )


async def housekeeping(
    engine: AsyncEngine,
    sessions: async_sessionmaker[Any],
    handlers: Registry,
    settings: Settings,
    log: Any,
) -> None:
    """The pump's periodic purge and claim sweep, every ``WORKER_PURGE_INTERVAL`` seconds."""
    while True:
        await asyncio.sleep(settings.purge_interval)
        try:
            result = await purge(engine, settings, log=log)
            metrics.inbox_purged(result.deleted)
            if result.rollover is not None:
                metrics.inbox_partitions("created", len(result.rollover.created))
                metrics.inbox_partitions("dropped", len(result.rollover.dropped))
                metrics.inbox_partitions("postponed", len(result.rollover.postponed))
            metrics.purge_run("ok" if result.ran else "skipped")
        except Exception as exc:  # the next round tries again; the pump must not die of it
            metrics.purge_run("failed")
            log.warning("inbox purge failed", error=exc)
        try:
            stale = await sweeper.stale_claims(sessions, limit=100)
            if stale:
                metrics.claims_swept("stale", len(stale))
                log.warning(
                    "stale claims",
                    count=len(stale),
                    oldest_overdue_s=round(stale[0].overdue, 1),
                    outcome="stale-claims",
                )
                if settings.sweep_redrive:
                    swept = await sweeper.redrive(sessions, handlers, settings, log, limit=100)
                    for action, count in swept.items():
                        metrics.claims_swept(action, count)
            metrics.sweep_run("ok")
        except Exception as exc:
            metrics.sweep_run("failed")
            log.warning("claim sweep failed", error=exc)


def start(
    engine: AsyncEngine,
    sessions: async_sessionmaker[Any],
    handlers: Registry,
    settings: Settings,
    log: Any,
) -> asyncio.Task[None] | None:
    """Start :func:`housekeeping` unless ``WORKER_PURGE_INTERVAL`` is 0."""
    if settings.purge_interval <= 0:
        return None
    return asyncio.create_task(housekeeping(engine, sessions, handlers, settings, log))


async def purge_command(settings: Settings) -> int:
    """``worker purge-inbox``: one bounded purge run, then a one-line summary."""
    import sys

    from worker.db import create_engine

    engine = create_engine(settings.database_url, pool_size=1)
    try:
        result = await purge(engine, settings, log=get_logger(command="purge-inbox"))
    finally:
        await engine.dispose()
    if not result.ran:
        print("another replica is purging the inbox; nothing done", file=sys.stderr)
    elif result.rollover is not None:
        passed = result.rollover
        print(
            f"partitions: {len(passed.created)} created, {len(passed.dropped)} dropped "
            f"(older than {result.cutoff.isoformat()}), {passed.carried} claims carried, "
            f"{len(passed.postponed)} steps postponed",
            file=sys.stderr,
        )
    else:
        print(
            f"purged {result.deleted} finished markers older than {result.cutoff.isoformat()} "
            f"in {result.batches} batches",
            file=sys.stderr,
        )
    return 0
