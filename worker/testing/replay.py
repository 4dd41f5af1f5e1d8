"""A handler's committed writes, recorded as the database received them, and replayed later
over another state: how the checker runs a race that the database would not let happen.

Two transactions race when one reads, another commits, and the first then writes. On
PostgreSQL (READ COMMITTED) the first one's statements then run against the other's
committed rows: an ``UPDATE ... SET n = ? WHERE id = ?`` overwrites them, an
``UPDATE ... WHERE version = ?`` finds no row, an INSERT meets the other's unique key.
Replaying the recorded statements, with the values the handler computed from what it
read, over a state in which the other message has committed is that same interleaving,
on any database, SQLite included (whose one writer lock lets no other writer commit
inside a handler's transaction).

A replay stops at the first statement that does not do what it did when recorded: a
different number of rows, an error, a generated value (a key a RETURNING gave) that
came out differently and is used by a later statement. The handler would have seen
that and behaved differently (a version conflict, then a retry), so nothing is judged
from that replay.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.testing.statements import shorten, verb_of, written_table

_REPLAYED = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE", "MERGE", "UPSERT", "WITH"})
_SAVEPOINTS = frozenset({"SAVEPOINT", "RELEASE"})


@dataclass(slots=True)
class Statement:
    """One statement as the database received it, and what it did."""

    sql: str
    parameters: Any
    many: bool
    rowcount: int | None = None  # None: it failed (or never finished)
    returned: tuple[tuple[Any, ...], ...] | None = ()  # RETURNING's rows; None: not seen
    lastrowid: int | None = None


@dataclass(slots=True)
class Transaction:
    """The writes of one committed transaction of a handler's stage, and its locks."""

    statements: list[Statement] = field(default_factory=list)
    read: set[str] = field(default_factory=set)  # tables it read
    locked: set[str] = field(default_factory=set)  # tables it read with FOR UPDATE/SHARE
    advisory: set[str] = field(default_factory=set)  # advisory locks it took (SQL + values)
    failed: bool = False  # a statement in it failed: not replayable

    def written(self) -> set[str]:
        return {t for s in self.statements if (t := written_table(s.sql)) is not None}


def replayable(sql: str) -> bool:
    """A statement a replay repeats: a write, or a savepoint around writes."""
    verb = verb_of(sql)
    return verb in _REPLAYED or verb in _SAVEPOINTS


def returned_rows(cursor: Any, sql: str) -> tuple[tuple[Any, ...], ...] | None:
    """What a RETURNING gave, read without consuming it (the adapted cursors of SQLAlchemy's
    async dialects buffer the rows); None when it cannot be seen."""
    if "RETURNING" not in sql.upper():
        return ()
    rows = getattr(cursor, "_rows", None)
    if rows is None:
        return None
    try:
        return tuple(tuple(row) for row in rows)
    except TypeError:
        return None


def serialized(replayed: Sequence[Transaction], other: Sequence[Transaction]) -> str | None:
    """Why the interleaving cannot happen, if it cannot: the replayed transactions locked
    what the other writes or locks too (a read ``FOR UPDATE`` of the same table, the same
    advisory lock), so the other would have waited for them. By table, not by row: a lock
    on another row of the table is taken for the same one, which can only hide a race."""
    touched = set().union(*(t.written() | t.locked for t in other)) if other else set()
    for transaction in replayed:
        both = transaction.locked & touched
        if both:
            return f"it read {', '.join(sorted(both))} with a lock"
        taken = transaction.advisory & set().union(*(t.advisory for t in other))
        if taken:
            return "both took the same advisory lock"
    return None


async def replay(connection: AsyncConnection, transactions: Iterable[Transaction]) -> str | None:
    """Run the recorded writes again on ``connection`` (inside its transaction). None when
    each did what it did when recorded; else why the handler would have noticed."""
    changed: dict[tuple[type, Any], Any] = {}
    for transaction in transactions:
        if transaction.failed:
            return "a statement of it failed when recorded"
        for statement in transaction.statements:
            why = await _one(connection, statement, changed)
            if why is not None:
                return why
    return None


async def _one(
    connection: AsyncConnection, statement: Statement, changed: dict[tuple[type, Any], Any]
) -> str | None:
    sql = shorten(statement.sql, 100)
    if changed and _uses(statement.parameters, changed):
        return f"{sql} uses a value the database generated anew"
    try:
        result = await connection.exec_driver_sql(statement.sql, statement.parameters)
    except DBAPIError as exc:
        return f"{sql} failed: {type(exc.orig).__name__}"
    if verb_of(statement.sql) in _SAVEPOINTS:
        return None
    rowcount = result.rowcount
    if (
        statement.rowcount is not None
        and statement.rowcount >= 0
        and rowcount != statement.rowcount
    ):
        return f"{sql} affected {rowcount} rows, not {statement.rowcount}"
    if statement.returned is None:
        return f"{sql} returned rows the recording could not see"
    if statement.returned:
        rows = tuple(tuple(row) for row in result.fetchall()) if result.returns_rows else ()
        if len(rows) != len(statement.returned):
            return f"{sql} returned {len(rows)} rows, not {len(statement.returned)}"
        for old_row, new_row in zip(statement.returned, rows, strict=True):
            for old, new in zip(old_row, new_row, strict=False):
                if old != new:
                    changed[(type(old), old)] = new
    elif statement.lastrowid is not None:
        lastrowid = getattr(result, "lastrowid", None)
        if lastrowid is not None and lastrowid != statement.lastrowid:
            changed[(int, statement.lastrowid)] = lastrowid
    return None


def _uses(parameters: Any, changed: dict[tuple[type, Any], Any]) -> bool:
    for value in _flat(parameters):
        try:
            if (type(value), value) in changed:
                return True
        except TypeError:  # unhashable
            continue
    return False


def _flat(parameters: Any) -> Iterable[Any]:
    if isinstance(parameters, dict):
        for value in parameters.values():
            yield from _flat(value)
    elif isinstance(parameters, list | tuple):
        for value in parameters:
            yield from _flat(value)
    else:
        yield parameters
