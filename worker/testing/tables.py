"""Table snapshots and their differences: what the checker compares between two runs.

A run's state is its business tables plus what the worker keeps of a handler's effects:
the outbox's events, the side-effect claims and the rejections. Columns that cannot be
the same in two runs are left out of the comparison: surrogate keys a sequence hands
out (a rolled-back attempt spends numbers on PostgreSQL), timestamps the database or
a default fills in, and every column whose values differ between two runs that each
apply every message exactly once (found by running that twice: a ``uuid4()``, a
``now()``). A row is then matched by its primary key when that is comparable, else as
one of a multiset.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

from sqlalchemy import DateTime, Integer, MetaData, Select, Table, inspect, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.inbox import TABLE as INBOX
from worker.outbox.model import table as OUTBOX
from worker.rejections import Rejection
from worker.testing.probe import WORKER_TABLES
from worker.testing.scratch import metadatas

Row = dict[str, Any]
Snapshot = dict[str, list[Row]]
"""Table -> its rows, values made comparable (:func:`freeze`)."""


@dataclass(frozen=True, slots=True)
class TableSpec:
    """One table as the checker reads and compares it."""

    name: str
    query: Select[Any]
    columns: tuple[str, ...]
    key: tuple[str, ...] = ()
    ignored: frozenset[str] = frozenset()  # never comparable: surrogate keys, timestamps
    reasons: Mapping[str, str] = field(default_factory=dict)  # why each is ignored


@dataclass(slots=True)
class TableDiff:
    """How one table differs from what was expected."""

    table: str
    compared: tuple[str, ...]
    missing: list[Row] = field(default_factory=list)  # expected, not there
    extra: list[Row] = field(default_factory=list)  # there, not expected
    changed: list[tuple[tuple[Any, ...], dict[str, tuple[Any, Any]]]] = field(default_factory=list)
    repeats: int = 0  # extra rows equal to an expected one in every compared column
    volatile: frozenset[str] = frozenset()  # columns that differ between two exact runs

    def lines(self, expected: str = "expected") -> list[str]:
        out = [f"{self.table}:"]
        for key, columns in self.changed:
            where = ", ".join(show(part) for part in key)
            change = "; ".join(
                f"{c} {show(a)} ({expected}) -> {show(b)}" for c, (a, b) in columns.items()
            )
            out.append(f"  ~ {where}: {change}")
        out.extend(f"  - {show_row(row)}  (missing)" for row in self.missing)
        out.extend(f"  + {show_row(row)}  (extra)" for row in self.extra)
        return out


def freeze(value: Any) -> Any:
    """A value that compares and hashes by what it means: JSON text as canonical JSON,
    bytes as text where they are UTF-8, times as ISO strings."""
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            value = raw.decode()
        except UnicodeDecodeError:
            return raw
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"))
        except ValueError:
            return value
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    return value


def show(value: Any) -> str:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 80 else repr(value[:79] + "…")
    return repr(value)


def show_row(row: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {show(v)}" for k, v in row.items()) + "}"


# -- which tables, which columns ----------------------------------------------------------


def worker_specs(claim_consumers: Iterable[str]) -> list[TableSpec]:
    """What the worker keeps of a handler's effects: events, claims, rejections."""
    o, i = OUTBOX.c, INBOX.c
    rejections = Rejection.__table__.c
    events = (
        "message_id",
        "message_type",
        "body",
        "headers",
        "key",
        "destination",
        "source_message_id",
        "consumer",
    )
    claimers = sorted(set(claim_consumers))
    specs = [
        TableSpec(
            "outbox",
            select(*(o[name] for name in events)).order_by(o.id),
            events,
            ("message_id",),
        ),
        TableSpec(
            "rejections",
            select(
                rejections.message_id,
                rejections.consumer,
                rejections.reason,
                rejections.subject,
                rejections.expected_version,
                rejections.actual_version,
            ).order_by(rejections.id),
            ("message_id", "consumer", "reason", "subject", "expected_version", "actual_version"),
            ("message_id", "consumer"),
        ),
    ]
    if claimers:
        specs.append(
            TableSpec(
                "claims",
                select(i.message_id, i.consumer, i.state)
                .where(i.consumer.in_(claimers))
                .order_by(i.id),
                ("message_id", "consumer", "state"),
                ("message_id", "consumer"),
            )
        )
    return specs


def business_tables(models: Sequence[MetaData], written: Iterable[str] = ()) -> list[str]:
    """The handlers' tables: every model table that is not the worker's, and any table a
    handler wrote to (even one no model names)."""
    names = {name for metadata in metadatas(models) for name in metadata.tables}
    names.update(written)
    return sorted(names - WORKER_TABLES)


async def table_specs(
    engine: AsyncEngine, names: Sequence[str], models: Sequence[MetaData] = ()
) -> list[TableSpec]:
    """Specs for ``names``: a model's table as declared, any other as reflected."""
    async with engine.connect() as connection:
        return [_spec(await find_table(connection, name, models)) for name in names]


async def find_table(
    connection: AsyncConnection, name: str, models: Sequence[MetaData] = ()
) -> Table:
    """The model's table called ``name``, else the database's, reflected."""
    for metadata in metadatas(models):
        if name in metadata.tables:
            return metadata.tables[name]
    reflected = MetaData()

    def load(sync: Any) -> Table:
        if not inspect(sync).has_table(name):
            raise LookupError(f"no table {name!r} in the database")
        return Table(name, reflected, autoload_with=sync)

    return await connection.run_sync(load)


def _spec(table: Table) -> TableSpec:
    columns = tuple(column.name for column in table.columns)
    key = tuple(column.name for column in table.primary_key.columns)
    reasons = {}
    surrogate = table.autoincrement_column
    if surrogate is not None:
        reasons[surrogate.name] = NUMBERED
    elif len(key) == 1 and isinstance(table.columns[key[0]].type, Integer):
        reasons[key[0]] = NUMBERED  # a reflected integer key: the database numbers it
    for column in table.columns:
        filled = column.server_default is not None or column.default is not None
        if isinstance(column.type, DateTime) and (filled or column.onupdate is not None):
            reasons[column.name] = STAMPED
    order = list(table.primary_key.columns) or list(table.columns)
    return TableSpec(
        table.name,
        select(table).order_by(*order),
        columns,
        key,
        frozenset(reasons),
        reasons,
    )


NUMBERED = "a key the database numbers"
STAMPED = "a time the database or a default fills in"
VOLATILE = "differs between two runs that apply each message once"


def left_out(specs: Sequence[TableSpec], volatile: Mapping[str, frozenset[str]]) -> list[str]:
    """Every column no comparison reads, with why: one line per reason."""
    by_reason: dict[str, list[str]] = {}
    for spec in specs:
        for column in spec.columns:
            why = spec.reasons.get(column)
            if why is None and column in volatile.get(spec.name, ()):
                why = VOLATILE
            if why is not None:
                by_reason.setdefault(why, []).append(f"{spec.name}.{column}")
    return [f"not compared: {', '.join(names)} ({why})" for why, names in by_reason.items()]


def unstable(
    first: Snapshot, second: Snapshot, start: Snapshot, specs: Sequence[TableSpec]
) -> list[str]:
    """How two runs that apply every message once, from the same rows, disagree beyond
    values that change from run to run: a table with another number of rows, or a value
    the second run left as it was at the start where the first changed it (the work was
    skipped: something outside the database said it was done)."""
    found = []
    for spec in specs:
        a, b = first.get(spec.name, []), second.get(spec.name, [])
        if len(a) != len(b):
            found.append(f"{spec.name}: {len(a)} rows, then {len(b)}")
            continue
        if not spec.key or set(spec.key) & spec.ignored:
            continue
        before = {_project(row, spec.key): row for row in start.get(spec.name, [])}
        after = {_project(row, spec.key): row for row in b}
        for row in a:
            key = _project(row, spec.key)
            old, again = before.get(key), after.get(key)
            if old is None or again is None:
                continue
            for column in spec.columns:
                if column in spec.ignored or row[column] == again[column]:
                    continue
                if again[column] == old[column]:
                    where = ", ".join(show(part) for part in key)
                    found.append(
                        f"{spec.name}: {where}: {column} {show(row[column])}, then "
                        f"{show(again[column])} (as at the start)"
                    )
    return found


# -- reading and comparing ----------------------------------------------------------------


async def snapshot(source: AsyncEngine | AsyncConnection, specs: Sequence[TableSpec]) -> Snapshot:
    """The tables of ``specs`` as they are, read on a connection of ``source`` (or on the
    connection given: inside its transaction)."""
    if isinstance(source, AsyncConnection):
        return await _read(source, specs)
    async with source.connect() as connection:
        return await _read(connection, specs)


async def _read(connection: AsyncConnection, specs: Sequence[TableSpec]) -> Snapshot:
    found: Snapshot = {}
    for spec in specs:
        result = await connection.execute(spec.query)
        found[spec.name] = [
            {name: freeze(value) for name, value in zip(spec.columns, row, strict=True)}
            for row in result
        ]
    return found


def volatile(
    first: Snapshot, second: Snapshot, specs: Sequence[TableSpec]
) -> dict[str, frozenset[str]]:
    """Per table, the columns whose values differ between two runs that apply every
    message exactly once: they cannot be compared with a third run either."""
    found = {}
    for spec in specs:
        a, b = first.get(spec.name, []), second.get(spec.name, [])
        differ = {
            column
            for column in spec.columns
            if column not in spec.ignored
            and Counter(row[column] for row in a) != Counter(row[column] for row in b)
        }
        found[spec.name] = frozenset(differ)
    return found


def compare(
    expected: Snapshot,
    actual: Snapshot,
    specs: Sequence[TableSpec],
    volatile: Mapping[str, frozenset[str]],
) -> list[TableDiff]:
    """Every table that differs, with its missing, extra and changed rows."""
    diffs = []
    for spec in specs:
        moving = volatile.get(spec.name, frozenset())
        skip = spec.ignored | moving
        compared = tuple(c for c in spec.columns if c not in skip)
        key = spec.key if spec.key and not set(spec.key) & skip else ()
        diff = TableDiff(spec.name, compared, volatile=moving)
        want, got = expected.get(spec.name, []), actual.get(spec.name, [])
        if key:
            _by_key(diff, key, want, got)
        else:
            _as_multiset(diff, want, got)
        if diff.missing or diff.extra or diff.changed:
            diffs.append(diff)
    return diffs


def _project(row: Row, columns: Sequence[str]) -> tuple[Any, ...]:
    return tuple(row[c] for c in columns)


def _by_key(diff: TableDiff, key: tuple[str, ...], want: list[Row], got: list[Row]) -> None:
    compared = diff.compared
    expected = {_project(row, key): row for row in want}
    actual = {_project(row, key): row for row in got}
    for k, row in expected.items():
        other = actual.get(k)
        if other is None:
            diff.missing.append({c: row[c] for c in compared})
            continue
        changed = {c: (row[c], other[c]) for c in compared if row[c] != other[c]}
        if changed:
            diff.changed.append((k, changed))
    contents = Counter(_project(row, compared) for row in want)
    for k, row in actual.items():
        if k not in expected:
            diff.extra.append({c: row[c] for c in compared})
            if contents[_project(row, compared)]:
                diff.repeats += 1


def _as_multiset(diff: TableDiff, want: list[Row], got: list[Row]) -> None:
    compared = diff.compared
    expected = Counter(_project(row, compared) for row in want)
    actual = Counter(_project(row, compared) for row in got)
    for values, count in (expected - actual).items():
        diff.missing.extend(dict(zip(compared, values, strict=True)) for _ in range(count))
    for values, count in (actual - expected).items():
        diff.extra.extend(dict(zip(compared, values, strict=True)) for _ in range(count))
        if expected[values]:
            diff.repeats += count
