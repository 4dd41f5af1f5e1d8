"""The partitioned inbox (PostgreSQL): markers in time partitions, dedup still exact.

``WORKER_INBOX_LAYOUT=partitioned`` turns the inbox into a table partitioned by
``stored_at`` (the wall-clock time its row was written), so retention drops whole
partitions (:mod:`worker.rollover`) instead of deleting rows. SQLite keeps the plain
table.

PostgreSQL only allows a unique constraint on a partitioned table when it includes the
partition key: ``UNIQUE (message_id, consumer, stored_at)`` would let two copies of one
message, written a second apart, both commit. So each partition keeps its own
``UNIQUE (message_id, consumer)`` (legal: a partition's own index needs no partition
key), and what spans partitions is a ``BEFORE INSERT`` row trigger on the parent, which
PostgreSQL clones onto every partition, present and future. Before a row is stored the
trigger calls ``worker_inbox_admit(message_id, consumer)``: it takes a transaction-scoped
advisory lock on the key, then looks the key up in every partition. Found: the insert
fails with SQLSTATE 23505 naming ``uq_inbox_message_consumer``, exactly what the plain
table's constraint raises, so :func:`worker.db.is_inbox_violation` tells a duplicate the
same way on both layouts, and a unique violation of any other constraint is still the
error it always was. Statements that skip duplicates instead
(``INSERT ... SELECT ... WHERE worker_inbox_admit(...) ON CONFLICT DO NOTHING``: batch
markers, side-effect claims) call the same function as a filter; on the plain table it is
``SELECT true`` and the unique constraint does the work, so the worker runs the same
SQL on both layouts.

Why no race slips through
-------------------------

Claim: under READ COMMITTED, at most one committed row of a key ``k = (message_id,
consumer)`` exists in the inbox, whatever partitions its copies were written to.

1. Every row reaches the inbox through an INSERT (or COPY) into the parent or one of its
   partitions, and the row trigger runs ``worker_inbox_admit(k)`` in the writer's
   transaction before the row exists.
2. ``worker_inbox_admit`` first takes ``pg_advisory_xact_lock(h(k))``: exclusive, held
   until the writer's transaction ends. PostgreSQL makes a commit visible to new
   snapshots before it releases the committing transaction's locks. So when writer B is
   granted the lock after writer A held it, A has either committed (its row visible to
   every snapshot taken from then on) or rolled back (its row never existed).
3. The lookup is a separate query inside a VOLATILE function, so it takes a fresh
   snapshot, after the lock was granted; and it is planned then too, so its partitions
   include every partition that existed when A wrote (A could only write into an
   attached partition, and dropping one needs the lock on the whole table, see 5).
4. Hence, whichever of two concurrent copies gets the lock second finds the first's row
   if the first committed, and fails (or is filtered out); if the first rolled back it
   finds nothing and proceeds, and does the work. Two committed rows of ``k`` would need
   two writers that each missed the other, which the lock's order rules out. A hash
   collision of ``h`` only queues unrelated keys behind each other: the lookup compares
   the real key.
5. Rows leave the inbox only by their own writer's rollback (or :func:`worker.inbox.unmark`
   inside its transaction), or when :mod:`worker.rollover` drops a partition (or retires
   DEFAULT) whose newest possible row is older than the retention (rule 10: no copy of its
   messages can arrive any more). The drop holds ACCESS EXCLUSIVE on the parent, and the
   claims still owed a side effect are moved into the live partitions in that same
   transaction. Rows are never moved between partitions otherwise: a lookup planned just
   before such a move could miss the row in flight.

Blocking is still the feature (rule 7): B waits on the advisory lock for A's whole
transaction, as it waited on A's index entry before; A commits, B gets 23505 and acks; A
rolls back, B's insert goes on. ``lock_timeout`` bounds that wait exactly as it bounded
the index wait (SQLSTATE 55P03). Under REPEATABLE READ or SERIALIZABLE step 3's snapshot
would be the transaction's own, taken before the wait, so the function refuses to run
there. The worker's own transactions say READ COMMITTED when they begin
(:func:`worker.db.create_engine`), so neither a database's or role's
``default_transaction_isolation`` nor a handler's ``SET SESSION CHARACTERISTICS`` left on
a pooled connection reaches them; only a transaction that asks for more itself is refused.

Time is only the retention's business: partitions are made ahead and dropped by
``stored_at``, but no dedup decision depends on which partition a copy landed in, on a
clock, or on when a partition was made or dropped.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.db import INBOX_CONSTRAINT, sqlstate

Layout = Literal["table", "partitioned"]

PARENT = "inbox"
LEGACY = "inbox_legacy"
"""The plain table after a conversion: the oldest partition, dropped once it is past the
retention."""
DEFAULT = "inbox_default"
"""Catches a row no partition covers (the housekeeping fell behind): never a failed insert."""
SEQUENCE = "inbox_marker_id_seq"
ADMIT = "worker_inbox_admit"
TRIGGER = "worker_inbox_exact"
LEGACY_CHECK = "ck_inbox_legacy_stored_at"
"""Proves every row of the plain table belongs before the first partition, so attaching
it scans nothing while the table is locked (validated beforehand, without blocking)."""

# The plain table's admission: its unique constraint decides, so every row is admitted.
# Inlined by the planner: a filter that costs nothing.
ADMIT_PLAIN = f"""
CREATE OR REPLACE FUNCTION {ADMIT}(key_message_id varchar, key_consumer varchar)
RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $admit$ SELECT true $admit$
"""

ADMIT_PARTITIONED = f"""
CREATE OR REPLACE FUNCTION {ADMIT}(key_message_id varchar, key_consumer varchar)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $admit$
BEGIN
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    RAISE EXCEPTION 'the partitioned inbox needs READ COMMITTED, not %',
      current_setting('transaction_isolation')
      USING ERRCODE = 'feature_not_supported',
            HINT = 'its lookup must see commits made while it waited for the key';
  END IF;
  PERFORM pg_advisory_xact_lock(hashtextextended(key_message_id, hashtext(key_consumer)));
  RETURN NOT EXISTS (
    SELECT 1 FROM {PARENT} WHERE message_id = key_message_id AND consumer = key_consumer
  );
END
$admit$
"""

EXACT_TRIGGER_FUNCTION = f"""
CREATE OR REPLACE FUNCTION {TRIGGER}() RETURNS trigger LANGUAGE plpgsql AS $exact$
BEGIN
  IF NOT {ADMIT}(NEW.message_id, NEW.consumer) THEN
    RAISE EXCEPTION USING
      ERRCODE = 'unique_violation',
      CONSTRAINT = '{INBOX_CONSTRAINT}',
      TABLE = '{PARENT}',
      MESSAGE = 'duplicate key value violates unique constraint "{INBOX_CONSTRAINT}"',
      DETAIL = format('Key (message_id, consumer)=(%s, %s) already exists.',
                      NEW.message_id, NEW.consumer);
  END IF;
  RETURN NEW;
END
$exact$
"""

_PARTITION_NAME = "inbox_p{lower:%Y%m%dt%H%M%S}"
_LOCK_NOT_AVAILABLE = "55P03"
_BOUNDS = re.compile(r"FROM \((.+?)\) TO \((.+?)\)")


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of the inbox: a range of ``stored_at`` (None: unbounded), or DEFAULT."""

    name: str
    lower: datetime | None
    upper: datetime | None
    default: bool = False


_PARTITION_PATTERN = re.compile(r"inbox_p\d{8}t\d{6}")


def is_inbox_partition(name: str) -> bool:
    """A table of the partitioned inbox (a range partition, DEFAULT, the converted table):
    the worker's, as the inbox is."""
    return name in (LEGACY, DEFAULT) or _PARTITION_PATTERN.fullmatch(name) is not None


def partition_name(lower: datetime) -> str:
    """A range partition is named after its lower bound (UTC): bounds never overlap."""
    return _PARTITION_NAME.format(lower=lower.astimezone(UTC))


def _bound(value: str) -> datetime | None:
    value = value.strip()
    if value in ("MINVALUE", "MAXVALUE"):
        return None
    return datetime.fromisoformat(value.strip("'"))


def parse_bound(name: str, expression: str) -> Partition:
    """A partition from ``pg_get_expr(relpartbound)`` (read with TimeZone UTC, DateStyle ISO)."""
    if expression.strip() == "DEFAULT":
        return Partition(name, None, None, default=True)
    found = _BOUNDS.search(expression)
    if found is None:
        raise ValueError(f"partition {name}: not a range bound: {expression!r}")
    return Partition(name, _bound(found.group(1)), _bound(found.group(2)))


_LAYOUT = text("SELECT relkind::text FROM pg_class WHERE oid = to_regclass(:name)")
_PARTITIONS = text(
    "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
    "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:parent) "
    "ORDER BY c.relname"
)


async def layout(connection: AsyncConnection) -> Layout | None:
    """The inbox's layout as the database has it; None on SQLite or before any migration."""
    if connection.dialect.name != "postgresql":
        return "table"
    kind = (await connection.execute(_LAYOUT, {"name": PARENT})).scalar()
    if kind is None:
        return None
    return "partitioned" if kind == "p" else "table"


async def partitions(connection: AsyncConnection) -> list[Partition]:
    """The inbox's partitions, read in a transaction of their own (committed on return)."""
    await connection.execute(text("SET LOCAL TimeZone = 'UTC'"))
    await connection.execute(text("SET LOCAL DateStyle = 'ISO'"))
    rows = (await connection.execute(_PARTITIONS, {"parent": PARENT})).all()
    await connection.commit()
    return [parse_bound(name, bound) for name, bound in rows]


# -- DDL: every statement below runs under a lock_timeout its caller set --------------------


def create_partition(lower: datetime, upper: datetime) -> list[str]:
    """Statements (one transaction) that make and attach the partition [lower, upper).

    Made as a table of its own and then attached: ``CREATE TABLE ... PARTITION OF`` would
    hold ACCESS EXCLUSIVE on the parent; ``ATTACH`` takes SHARE UPDATE EXCLUSIVE on it (and
    ACCESS EXCLUSIVE on DEFAULT, which it scans: empty, unless the housekeeping fell
    behind). The trigger and the parent's indexes come with the attach.
    """
    name = partition_name(lower)
    return [
        f"CREATE TABLE {name} (LIKE {PARENT} INCLUDING DEFAULTS)",
        *_own_keys(name),
        f"ALTER TABLE {PARENT} ATTACH PARTITION {name} "
        f"FOR VALUES FROM ('{lower.isoformat()}') TO ('{upper.isoformat()}')",
    ]


def _own_keys(name: str) -> list[str]:
    """A partition's own primary key and its own unique key on (message_id, consumer)."""
    return [
        f"ALTER TABLE {name} ADD CONSTRAINT pk_{name} PRIMARY KEY (id), "
        f"ADD CONSTRAINT uq_{name}_message_consumer UNIQUE (message_id, consumer)"
    ]


def create_default(name: str = DEFAULT) -> list[str]:
    """A DEFAULT partition, indexed on ``stored_at`` so its newest row is one probe away."""
    return [
        f"CREATE TABLE {name} (LIKE {PARENT} INCLUDING DEFAULTS)",
        *_own_keys(name),
        f"CREATE INDEX ix_{name}_stored_at ON {name} (stored_at)",
        f"ALTER TABLE {PARENT} ATTACH PARTITION {name} DEFAULT",
    ]


# -- from the plain table: no loss, no moment without dedup --------------------------------

_VALID_INDEXES = text(
    "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE i.indrelid = to_regclass(:table) AND i.indisvalid"
)
_HAS_CONSTRAINT = text(
    "SELECT 1 FROM pg_constraint WHERE conrelid = to_regclass(:table) AND conname = :name"
)
_PLAIN_INDEXES = ("ix_inbox_processed_at", "ix_inbox_lease_until")


def preparation() -> list[str]:
    """Statements, each its own transaction, that prepare the plain table for the cutover.

    A column with a constant default is a catalog change (no rewrite); the CHECK is added
    NOT VALID (no scan) and validated under SHARE UPDATE EXCLUSIVE, which lets inserts go
    on. Every row of the plain table, old or inserted meanwhile, has ``stored_at =
    '-infinity'``: true for good, so a conversion that stops here leaves nothing to expire.
    """
    return [
        f"ALTER TABLE {PARENT} ADD COLUMN IF NOT EXISTS stored_at timestamptz NOT NULL "
        "DEFAULT '-infinity'",
        f"ALTER TABLE {PARENT} ADD CONSTRAINT {LEGACY_CHECK} CHECK (stored_at = '-infinity') "
        "NOT VALID",
        f"ALTER TABLE {PARENT} VALIDATE CONSTRAINT {LEGACY_CHECK}",
    ]


def cutover(period: timedelta, margin: timedelta) -> str:
    """One statement (one transaction) that swaps the plain table for the partitioned one.

    Under ACCESS EXCLUSIVE on the plain table (so no insert is in flight): rename it
    ``inbox_legacy``; make the partitioned parent from its columns; attach the old table
    as the partition of everything before ``cut`` (its validated CHECK proves that, no
    scan); add DEFAULT, the admission function and the trigger. One commit: a statement
    before it sees the plain table with its unique constraint, one after it the parent
    with its trigger, and every old marker is in it. ``cut`` is the first period boundary
    at least ``margin`` ahead, so the old table is never dropped before its newest marker
    is past the retention, and :mod:`worker.rollover` has ``margin`` to make the first
    partition before rows would go to DEFAULT.
    """
    seconds = int(period.total_seconds())
    ahead = int(margin.total_seconds())
    return f"""
DO $cutover$
DECLARE
  cut timestamptz;
  old_sequence text;
  last_id bigint;
  called boolean;
BEGIN
  LOCK TABLE {PARENT} IN ACCESS EXCLUSIVE MODE;
  IF (SELECT relkind FROM pg_class WHERE oid = '{PARENT}'::regclass) = 'p' THEN
    RETURN;  -- another migrator converted it while this one waited for the lock
  END IF;
  cut := to_timestamp(
    floor((extract(epoch FROM clock_timestamp()) + {ahead}) / {seconds}) * {seconds} + {seconds});
  old_sequence := pg_get_serial_sequence('{PARENT}', 'id');
  ALTER TABLE {PARENT} RENAME TO {LEGACY};
  ALTER INDEX ix_inbox_processed_at RENAME TO ix_inbox_legacy_processed_at;
  ALTER INDEX ix_inbox_lease_until RENAME TO ix_inbox_legacy_lease_until;
  CREATE TABLE {PARENT} (LIKE {LEGACY} INCLUDING DEFAULTS) PARTITION BY RANGE (stored_at);
  CREATE SEQUENCE {SEQUENCE} OWNED BY {PARENT}.id;
  IF old_sequence IS NOT NULL THEN
    EXECUTE format('SELECT last_value, is_called FROM %s', old_sequence) INTO last_id, called;
    PERFORM setval('{SEQUENCE}', last_id, called);
  ELSE
    PERFORM setval('{SEQUENCE}', coalesce((SELECT max(id) FROM {LEGACY}), 0) + 1, false);
  END IF;
  ALTER TABLE {PARENT}
    ALTER COLUMN id SET DEFAULT nextval('{SEQUENCE}'),
    ALTER COLUMN stored_at SET DEFAULT clock_timestamp();
  CREATE INDEX ix_inbox_processed_at ON {PARENT} (processed_at);
  CREATE INDEX ix_inbox_lease_until ON {PARENT} (lease_until) WHERE lease_until IS NOT NULL;
  EXECUTE format(
    'ALTER TABLE {PARENT} ATTACH PARTITION {LEGACY} FOR VALUES FROM (MINVALUE) TO (%L)', cut);
  -- rows written from now until cut go to the old table, with their real time
  ALTER TABLE {LEGACY} DROP CONSTRAINT {LEGACY_CHECK};
  {"; ".join(create_default())};
  {ADMIT_PARTITIONED.strip()};
  {EXACT_TRIGGER_FUNCTION.strip()};
  CREATE TRIGGER {TRIGGER} BEFORE INSERT ON {PARENT}
    FOR EACH ROW EXECUTE FUNCTION {TRIGGER}();
END
$cutover$
"""


def install_admission(connection: Connection) -> None:
    """Migration 0005: the admission function the worker's skip-duplicates statements call.

    The plain table's version on a plain inbox; a partitioned one keeps (gets back) its own.
    """
    if connection.dialect.name != "postgresql":
        return
    kind = connection.execute(_LAYOUT, {"name": PARENT}).scalar()
    if kind == "p":
        connection.execute(text(ADMIT_PARTITIONED))
        connection.execute(text(EXACT_TRIGGER_FUNCTION))
    else:
        connection.execute(text(ADMIT_PLAIN))


def remove_admission(connection: Connection) -> None:
    """Migration 0005's downgrade, on the plain table only (a partitioned inbox needs it)."""
    if connection.dialect.name != "postgresql":
        return
    if connection.execute(_LAYOUT, {"name": PARENT}).scalar() == "p":
        raise RuntimeError(
            "the inbox is partitioned: its trigger needs worker_inbox_admit; "
            "copy it back into a plain table before downgrading below 0005"
        )
    connection.execute(text(f"DROP FUNCTION IF EXISTS {ADMIT}(varchar, varchar)"))


async def prepared(connection: AsyncConnection) -> tuple[bool, bool]:
    """(the CHECK exists, the plain table's indexes are valid): what the cutover needs."""
    names = set((await connection.execute(_VALID_INDEXES, {"table": PARENT})).scalars())
    check = (
        await connection.execute(_HAS_CONSTRAINT, {"table": PARENT, "name": LEGACY_CHECK})
    ).scalar()
    await connection.commit()
    return check is not None, all(index in names for index in _PLAIN_INDEXES)


async def convert(
    connection: AsyncConnection,
    period: timedelta,
    retry: Callable[[BaseException], Awaitable[bool]],
) -> bool:
    """Turn the plain inbox into the partitioned one, online; True when this call did it.

    Each step is its own transaction, re-runnable from wherever a killed run stopped; a
    step that gave up waiting for its lock (SQLSTATE 55P03) is repeated while ``retry``
    (which sleeps) says so. The connection's own ``lock_timeout`` bounds each wait.
    """
    if await layout(connection) != "table":
        await connection.rollback()
        return False
    check, indexes = await prepared(connection)
    if not indexes:
        raise RuntimeError(
            "the inbox lacks a valid ix_inbox_processed_at or ix_inbox_lease_until (a killed "
            "build leaves one INVALID): REINDEX INDEX CONCURRENTLY it, then migrate again; "
            "the partitioned parent has both, and attaching the table would build them "
            "while it is locked"
        )
    add_column, add_check, validate = preparation()
    steps = [add_column, validate] if check else [add_column, add_check, validate]
    steps.append(cutover(period, min(period, timedelta(minutes=1))))
    for step in steps:
        while True:
            try:
                await connection.exec_driver_sql(step)
                await connection.commit()
                break
            except DBAPIError as exc:
                await connection.rollback()
                if sqlstate(exc) != _LOCK_NOT_AVAILABLE or not await retry(exc):
                    raise
    return True


async def refresh(connection: AsyncConnection) -> None:
    """The partitioned inbox's functions as this release writes them (a no-op if unchanged)."""
    await connection.exec_driver_sql(ADMIT_PARTITIONED)
    await connection.exec_driver_sql(EXACT_TRIGGER_FUNCTION)
    await connection.commit()
