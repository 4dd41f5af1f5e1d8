"""Rollover: the partitioned inbox's retention, by whole partitions, never a DELETE.

The housekeeping loop (:mod:`worker.retention`) runs a pass every
``WORKER_PURGE_INTERVAL`` seconds, one replica at a time (the purge's advisory lock);
``worker purge-inbox`` runs one by hand. A pass:

1. **makes partitions ahead**, one per ``WORKER_INBOX_PARTITION_PERIOD`` (boundaries are
   multiples of the period since the Unix epoch, UTC), from the current period until
   ``now`` + one period + two housekeeping intervals: a pass or two may fail and no
   marker lands outside its partition. Not more: every partition, even an empty one
   ahead, is one more index every marker insert looks into.
2. **drops every partition whose upper bound is older than the retention**. A marker's
   ``stored_at`` is when its row was written, no earlier than the delivery that wrote it,
   so everything in such a partition is past the redelivery window (rule 10) and no dedup
   decision can need it. Claims still owed a side effect (``state = 'claimed'``: the only
   record that a call may still be due) are carried into the live partitions in the
   drop's own transaction, ids and times kept; abandoned claims count as finished, as
   they do for the plain table's purge.
3. **retires DEFAULT as a whole** once its newest row is past the retention: a fresh
   DEFAULT is attached in the same transaction, so an insert never finds none.

DEFAULT is the safety net: a row whose ``stored_at`` no partition covers (the
housekeeping was off or failing for longer than the partitions made ahead) is stored
there, checked by every lookup like any other row, never an error. Its rows are never
moved (a lookup planned before a move could miss a row in flight); a period that
already has rows in DEFAULT gets no partition of its own, so DEFAULT keeps that period
until step 3 retires it.

Locks: attaching a partition takes ACCESS EXCLUSIVE on DEFAULT, and dropping one takes
it on the parent, while every marker transaction holds a share lock on every partition
(its lookup reads them all). Each step therefore waits at most :data:`LOCK_TIMEOUT` for
its locks, holding up new markers for no longer than that, and is tried again on the
next pass if it gave up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from worker import partitions
from worker.db import sqlstate
from worker.inbox import TABLE

LOCK_TIMEOUT = 1.0
"""Seconds one step's DDL may wait for its locks (and hold up new markers meanwhile)."""
ATTEMPTS = 3
"""Tries of a step within one pass before it is left to the next pass."""
MAX_AHEAD = 24
"""At most this many partitions made ahead, whatever the period and the interval."""
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_LOCK_NOT_AVAILABLE = "55P03"
_CHECK_VIOLATION = "23514"  # ATTACH: DEFAULT holds rows of the new partition's range
_COLUMNS = ", ".join(column.name for column in TABLE.columns)
_CLAIMED = "lease_until IS NOT NULL AND state = 'claimed'"  # ix_inbox_lease_until
_RETIRED = f"{partitions.DEFAULT}_retired"


@dataclass(slots=True)
class Pass:
    """What one rollover pass did."""

    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    carried: int = 0  # unfinished claims moved out of dropped partitions
    postponed: list[str] = field(default_factory=list)  # steps that gave up on a lock


def boundary(moment: datetime, period: timedelta) -> datetime:
    """The start of the period ``moment`` is in."""
    return moment - (moment - EPOCH) % period


def lead(period: timedelta, interval: float) -> timedelta:
    """How far ahead of now partitions are made: a period plus two housekeeping rounds."""
    return period + 2 * timedelta(seconds=interval)


async def _step(
    connection: AsyncConnection,
    statements: list[str],
    guard: Callable[[], Awaitable[bool]] | None = None,
) -> Any:
    """Run ``statements`` in one transaction under :data:`LOCK_TIMEOUT`: their results;
    False when ``guard`` (asked after the first statement, its locks held) said no; None
    when the locks stayed out of reach :data:`ATTEMPTS` times."""
    timeout = f"SET LOCAL lock_timeout = '{int(LOCK_TIMEOUT * 1000)}ms'"
    for attempt in range(1, ATTEMPTS + 1):
        try:
            await connection.exec_driver_sql(timeout)
            results: list[Any] = []
            for statement in statements:
                results.append(await connection.exec_driver_sql(statement))
                if len(results) == 1 and guard is not None and not await guard():
                    await connection.rollback()
                    return False
            await connection.commit()
            return results
        except DBAPIError as exc:
            await connection.rollback()
            if sqlstate(exc) != _LOCK_NOT_AVAILABLE:
                raise
        await asyncio.sleep(0.05 * attempt)
    return None


_DEFAULT_ROWS_IN = text(
    f"SELECT EXISTS (SELECT 1 FROM {partitions.DEFAULT} WHERE stored_at >= :lower "
    "AND stored_at < :upper)"
)


async def _default_rows_in(connection: AsyncConnection, lower: datetime, upper: datetime) -> bool:
    found = await connection.scalar(_DEFAULT_ROWS_IN, {"lower": lower, "upper": upper})
    await connection.commit()
    return bool(found)


async def make_ahead(
    connection: AsyncConnection, period: timedelta, until: datetime, now: datetime, done: Pass
) -> None:
    """Partitions for every period from now's (or the newest partition's end) to ``until``."""
    known = await partitions.partitions(connection)
    ranged = [p for p in known if not p.default]
    has_default = any(p.default for p in known)
    if any(p.upper is None for p in ranged):
        return  # a partition up to MAXVALUE, made by hand: nothing can follow it
    cursor = boundary(now, period)
    ends = [p.upper for p in ranged if p.upper is not None]
    if ends:
        cursor = max(cursor, *ends)
    made = 0
    while cursor < until and made < MAX_AHEAD:
        upper = boundary(cursor, period) + period
        if has_default and await _default_rows_in(connection, cursor, upper):
            cursor = upper  # DEFAULT keeps this period (see the module's docstring)
            continue
        name = partitions.partition_name(cursor)
        try:
            made_it = await _step(connection, partitions.create_partition(cursor, upper))
        except DBAPIError as exc:
            if sqlstate(exc) != _CHECK_VIOLATION:
                raise
            cursor = upper  # rows reached DEFAULT in that period since the look: it keeps it
            continue
        if made_it is None:
            done.postponed.append(f"create {name}")
            return
        done.created.append(name)
        made += 1
        cursor = upper


def retire(name: str) -> list[str]:
    """Statements (one transaction) that detach ``name``, carry its unfinished claims into
    the live partitions (the third statement) and drop it.

    ACCESS EXCLUSIVE on the parent first: no marker transaction is in flight meanwhile, so
    a claim is in the old partition or in its new one for every lookup, never in neither;
    and taking it first, not by upgrading a weaker lock, cannot deadlock with a marker
    transaction waiting for DEFAULT behind it.
    """
    return [
        f"LOCK TABLE {partitions.PARENT} IN ACCESS EXCLUSIVE MODE",
        f"ALTER TABLE {partitions.PARENT} DETACH PARTITION {name}",
        _carry(name),
        f"DROP TABLE {name}",
    ]


def _carry(name: str) -> str:
    return (
        f"INSERT INTO {partitions.PARENT} ({_COLUMNS}) "
        f"SELECT {_COLUMNS} FROM {name} WHERE {_CLAIMED}"
    )


async def drop_expired(
    connection: AsyncConnection, retention: timedelta, now: datetime, done: Pass
) -> None:
    """Drop the partitions whose every row is older than ``retention``."""
    known = await partitions.partitions(connection)
    for part in known:
        if part.default or part.upper is None or part.upper + retention > now:
            continue
        results = await _step(connection, retire(part.name))
        if results is None:
            done.postponed.append(f"drop {part.name}")
            continue
        done.dropped.append(part.name)
        done.carried += results[2].rowcount


_NEWEST_IN_DEFAULT = text(f"SELECT max(stored_at) FROM {partitions.DEFAULT}")


async def retire_default(
    connection: AsyncConnection, retention: timedelta, now: datetime, done: Pass
) -> None:
    """Swap DEFAULT for an empty one once its newest row is past ``retention``."""
    if not any(p.default for p in await partitions.partitions(connection)):
        return
    newest = await connection.scalar(_NEWEST_IN_DEFAULT)
    await connection.commit()
    if newest is None or newest + retention > now:
        return

    async def still_due() -> bool:  # asked again under the lock: a row may have landed since
        latest = await connection.scalar(_NEWEST_IN_DEFAULT)
        return latest is not None and latest + retention <= now

    default = partitions.DEFAULT
    statements = [
        f"LOCK TABLE {partitions.PARENT} IN ACCESS EXCLUSIVE MODE",
        f"ALTER TABLE {partitions.PARENT} DETACH PARTITION {default}",
        f"ALTER TABLE {default} RENAME TO {_RETIRED}",
        f"ALTER TABLE {_RETIRED} RENAME CONSTRAINT pk_{default} TO pk_{_RETIRED}",
        f"ALTER TABLE {_RETIRED} RENAME CONSTRAINT uq_{default}_message_consumer "
        f"TO uq_{_RETIRED}_message_consumer",
        f"ALTER INDEX ix_{default}_stored_at RENAME TO ix_{_RETIRED}_stored_at",
        *partitions.create_default(),
        _carry(_RETIRED),
        f"DROP TABLE {_RETIRED}",
    ]
    results = await _step(connection, statements, still_due)
    if results is None:
        done.postponed.append(f"retire {default}")
    elif results is not False:
        done.dropped.append(default)
        done.carried += results[-2].rowcount


async def run(
    connection: AsyncConnection,
    *,
    period: timedelta,
    retention: timedelta,
    interval: float,
    now: datetime,
) -> Pass:
    """One pass: partitions made ahead, expired ones dropped, DEFAULT retired when due."""
    done = Pass()
    await make_ahead(connection, period, now + lead(period, interval), now, done)
    await drop_expired(connection, retention, now, done)
    await retire_default(connection, retention, now, done)
    return done
