"""What a statement does, read from its SQL (and, where SQLAlchemy compiled it, from the
statement object): its verb, the tables it reads and writes, whether it locks what it
reads, and whether an UPDATE's WHERE compares more than the primary key."""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import Column, Delete, Select, Update
from sqlalchemy.engine import make_url
from sqlalchemy.sql import visitors

_WRITE = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE", "MERGE", "UPSERT"})
_TRANSACTION = frozenset({"COMMIT", "ROLLBACK", "END", "BEGIN", "START", "ABORT"})
_ROLLBACK_TO = re.compile(r"^\s*ROLLBACK\s+(?:WORK\s+|TRANSACTION\s+)?TO\b", re.IGNORECASE)
_NAME = r'(?:"?\w+"?\.)?"?(\w+)"?'
_READ_TABLES = re.compile(rf"\b(?:FROM|JOIN)\s+{_NAME}", re.IGNORECASE)
_WRITE_TARGET = re.compile(
    rf"\b(?:INSERT\s+(?:OR\s+\w+\s+)?INTO|REPLACE\s+INTO|UPDATE|DELETE\s+FROM|MERGE\s+INTO)\s+{_NAME}",
    re.IGNORECASE,
)
_WHERE = re.compile(r"\bWHERE\b(.*?)(?:\bRETURNING\b|$)", re.IGNORECASE | re.DOTALL)
_SET_CLAUSE = re.compile(r"\bSET\s+(.*?)(?:\bWHERE\b|\bRETURNING\b|$)", re.IGNORECASE | re.DOTALL)
_POSTGRESQL = make_url("postgresql+asyncpg://").get_dialect()()
_LOCKING = re.compile(r"\bFOR\s+(?:NO\s+KEY\s+)?(?:UPDATE|SHARE)\b", re.IGNORECASE)
_ADVISORY = re.compile(r"\bpg_(?:try_)?advisory_(?:xact_)?lock(?:_shared)?\b", re.IGNORECASE)
# a bound value, with asyncpg's cast if any: ?, $1, $1::NUMERIC(18, 2), %(name)s, :name
_PLACEHOLDER = re.compile(r"^\s*(?:\?|\$\d+(?:::[\w ]+(?:\([\d, ]*\))?)?|%\(\w+\)s|:\w+)\s*$")


def shorten(sql: str, limit: int = 120) -> str:
    """A statement on one line, cut to ``limit`` characters."""
    line = " ".join(sql.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def verb_of(sql: str) -> str:
    words = sql.lstrip().split(None, 1)
    return words[0].upper().rstrip(";") if words else ""


def is_write(sql: str) -> bool:
    verb = verb_of(sql)
    if verb == "WITH":  # a CTE: a write if any data-modifying verb is in it
        return bool(_WRITE_TARGET.search(sql))
    return verb in _WRITE


def ends_transaction(sql: str) -> bool:
    """``COMMIT``, ``ROLLBACK``, ``BEGIN``... sent as a statement of its own (not a
    savepoint's ``ROLLBACK TO``)."""
    if _ROLLBACK_TO.match(sql):
        return False
    return verb_of(sql) in _TRANSACTION


def written_table(sql: str) -> str | None:
    found = _WRITE_TARGET.search(sql)
    return found.group(1) if found else None


def read_tables(sql: str) -> set[str]:
    return set(_READ_TABLES.findall(sql))


def advisory_lock(sql: str) -> bool:
    return bool(_ADVISORY.search(sql))


def _same_table(a: Any, b: Any) -> bool:
    """ORM statements compare annotated copies of a table and its columns: by name."""
    return bool(
        getattr(a, "name", None) == getattr(b, "name", None)
        and getattr(a, "schema", None) == getattr(b, "schema", None)
    )


def guarded(context: Any) -> bool | None:
    """For a compiled UPDATE or DELETE: does its WHERE compare more than the primary key
    (a version token, a state)? None when the statement is not one SQLAlchemy compiled."""
    statement = getattr(getattr(context, "compiled", None), "statement", None)
    if not isinstance(statement, Update | Delete):
        return None
    where = statement.whereclause
    if where is None:
        return False
    table = statement.table
    keys = {column.name for column in getattr(table, "primary_key", ())}
    compared = {
        element.name
        for element in visitors.iterate(where)
        if isinstance(element, Column) and _same_table(element.table, table)
    }
    return bool(compared - keys)


def unguarded(sql: str, context: Any) -> bool:
    """An UPDATE (or DELETE) that writes a value computed outside the statement to a row
    chosen by its key alone: what a lost update looks like. For a statement SQLAlchemy did
    not compile (``text()``), a WHERE of one comparison stands for "by its key alone"."""
    if not sets_plain_values(sql):
        return False
    by_key = guarded(context)
    if by_key is not None:
        return not by_key
    where = _WHERE.search(sql)
    return where is not None and not re.search(r"\b(?:AND|OR)\b", where.group(1), re.IGNORECASE)


def locks_rows(sql: str, context: Any) -> bool:
    """Whether a read locks what it reads (``with_for_update()``). SQLite leaves the lock
    out of its SQL, so the statement is asked how PostgreSQL would run it."""
    if _LOCKING.search(sql):
        return True
    statement = getattr(getattr(context, "compiled", None), "statement", None)
    if not isinstance(statement, Select):
        return False
    return bool(_LOCKING.search(str(statement.compile(dialect=_POSTGRESQL))))


def sets_plain_values(sql: str) -> bool:
    """Whether an UPDATE assigns a value computed outside the statement (``SET x=?``),
    rather than one computed from the row itself (``SET x=x + ?``)."""
    found = _SET_CLAUSE.search(sql)
    if not found:
        return verb_of(sql) == "DELETE"
    depth, start, parts = 0, 0, []
    clause = found.group(1)
    for index, char in enumerate(clause):
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            parts.append(clause[start:index])
            start = index + 1
    parts.append(clause[start:])
    return any(_PLACEHOLDER.match(part.split("=", 1)[-1]) for part in parts if "=" in part)
