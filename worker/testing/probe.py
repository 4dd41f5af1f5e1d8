"""What the kit sees of a handler while the real pump runs it, and the faults it injects.

A :class:`Probe` is stage middleware (:mod:`worker.middleware`): around every handler's
runner it marks the task's context, and three process-wide listeners act only inside
a marked context:

- SQLAlchemy's ``before_cursor_execute`` and ``commit`` on every engine: each statement
  and commit on the pump's engines is a *boundary* of the handler's unit of work (the
  marker's insert, the handler's own statements, the commit); a statement through
  any other engine is a write that escaped the transaction;
- Python's audit event ``socket.connect``: a connection a transaction handler opens to
  anything but the database is a call outside a claim.

A :class:`Plan` says what to inject: a :class:`SimulatedCrash` before the Nth boundary
of a message's first attempt (the transaction rolls back; the pump gives the delivery
back and the broker redelivers it), or a concurrent writer that commits between the
handler's read of a table and its first UPDATE or DELETE of it. The writer is the same
handler on the same message under another id, on its own engine and session; the
statement waits for it (``sqlalchemy.util.await_``, inside the greenlet the event runs
in), at most ``writer_wait`` seconds, since a handler that locked the row makes the
writer wait for its commit instead.
"""

from __future__ import annotations

import asyncio
import contextvars
import re
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Column, Delete, Select, Update, event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql import visitors

from worker import histories
from worker.context import Context
from worker.db import create_engine, discard, session_factory
from worker.registry import Runs

try:  # SQLAlchemy 2.1 names it await_; 2.0 only await_only
    from sqlalchemy.util import await_
except ImportError:  # pragma: no cover - SQLAlchemy 2.0
    from sqlalchemy.util import await_only as await_

if TYPE_CHECKING:
    from pydantic import BaseModel

    from worker.middleware import NextStage
    from worker.registry import Handler
    from worker.verdict import Verdict
    from worker.work import Stage

WORKER_TABLES = histories.WORKER_TABLES | {histories.VERSION_TABLE, histories.LEGACY_VERSION_TABLE}
"""The worker's own tables: never a handler's business table."""

_WRITE = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE", "MERGE", "UPSERT"})
_NAME = r'(?:"?\w+"?\.)?"?(\w+)"?'
_READ_TABLES = re.compile(rf"\b(?:FROM|JOIN)\s+{_NAME}", re.IGNORECASE)
_WRITE_TARGET = re.compile(
    rf"\b(?:INSERT\s+(?:OR\s+\w+\s+)?INTO|REPLACE\s+INTO|UPDATE|DELETE\s+FROM|MERGE\s+INTO)\s+{_NAME}",
    re.IGNORECASE,
)
_SET_CLAUSE = re.compile(r"\bSET\s+(.*?)(?:\bWHERE\b|\bRETURNING\b|$)", re.IGNORECASE | re.DOTALL)
_POSTGRESQL = make_url("postgresql+asyncpg://").get_dialect()()
_LOCKING = re.compile(r"\bFOR\s+(?:NO\s+KEY\s+)?(?:UPDATE|SHARE)\b", re.IGNORECASE)
# a bound value, with asyncpg's cast if any: ?, $1, $1::NUMERIC(18, 2), %(name)s, :name
_PLACEHOLDER = re.compile(r"^\s*(?:\?|\$\d+(?:::[\w ]+(?:\([\d, ]*\))?)?|%\(\w+\)s|:\w+)\s*$")


class SimulatedCrash(Exception):
    """Raised by the kit where a process would have died: the attempt ends, nothing commits."""


class EscapedWrite(Exception):
    """A handler wrote through another engine to the pump's own SQLite file.

    SQLite has one writer, and the pump's transaction is it: the write would wait for a
    commit that waits for the write. The kit fails the statement at once instead.
    """


def shorten(sql: str, limit: int = 120) -> str:
    """A statement on one line, cut to ``limit`` characters."""
    line = " ".join(sql.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def verb_of(sql: str) -> str:
    words = sql.lstrip().split(None, 1)
    return words[0].upper() if words else ""


def is_write(sql: str) -> bool:
    verb = verb_of(sql)
    if verb == "WITH":  # a CTE: a write if any data-modifying verb is in it
        return bool(_WRITE_TARGET.search(sql))
    return verb in _WRITE


def written_table(sql: str) -> str | None:
    found = _WRITE_TARGET.search(sql)
    return found.group(1) if found else None


def read_tables(sql: str) -> set[str]:
    return set(_READ_TABLES.findall(sql))


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
        if isinstance(element, Column) and element.table is table
    }
    return bool(compared - keys)


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


# -- what one stage run left behind ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Escape:
    """A write through an engine that is not the pump's."""

    sql: str
    engine: str  # its URL, password masked


@dataclass(frozen=True, slots=True)
class WriterOutcome:
    """How the concurrent writer went: it committed before the handler's write, waited
    behind the handler's lock (and committed after it), could not interleave at all, or
    failed."""

    message_id: str
    writer_id: str
    state: str  # "before", "after", "serialized", "failed"
    detail: str = ""


@dataclass(slots=True)
class Trace:
    """One handler's stage over one delivery, as the probe saw it."""

    message_id: str
    consumer: str
    delivery_count: int
    runs: Runs
    first: bool  # the first stage run of this (message, consumer)
    boundaries: list[str] = field(default_factory=list)
    escaped: list[Escape] = field(default_factory=list)
    network: list[str] = field(default_factory=list)
    unguarded: list[str] = field(default_factory=list)
    written: set[str] = field(default_factory=set)  # tables, through any engine
    writer: WriterOutcome | None = None
    crashed: str | None = None  # the boundary it crashed before


# -- what to inject -----------------------------------------------------------------

Writer = Callable[["Handler[Any]", "BaseModel", str, Any], Awaitable[WriterOutcome]]
"""Runs the concurrent writer for (handler, message, message id, headers)."""


@dataclass(frozen=True, slots=True)
class Crash:
    message_id: str
    consumer: str
    at: int  # 1-based boundary of the first attempt


@dataclass(frozen=True, slots=True)
class Plan:
    crash: Crash | None = None
    writer: Writer | None = None


_RUN: contextvars.ContextVar[_StageRun | None] = contextvars.ContextVar(
    "worker_testing_stage", default=None
)


class Probe:
    """Stage middleware that traces every handler's stage, and injects ``plan``."""

    def __init__(
        self,
        engines: Iterable[Engine],
        database_url: str,
        plan: Plan | None = None,
    ) -> None:
        install()
        self.engines = set(engines)
        self.plan = plan or Plan()
        self.traces: list[Trace] = []
        self.sqlite_file = _sqlite_file(database_url)
        self.database_addresses = _addresses(database_url)
        self._seen: set[tuple[str, str]] = set()

    async def __call__(self, stage: Stage, call_next: NextStage) -> list[Verdict]:
        run = _StageRun(self, stage)
        token = _RUN.set(run)
        try:
            return await call_next(stage)
        finally:
            _RUN.reset(token)
            self.traces.append(run.trace)

    def first(self, message_id: str, consumer: str) -> bool:
        key = (message_id, consumer)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


class _StageRun:
    """The probe's state inside one stage: the statements so far, what was read."""

    __slots__ = (
        "_crash_at",
        "_locked",
        "_probe",
        "_read",
        "_started_write",
        "handler",
        "item",
        "trace",
    )

    def __init__(self, probe: Probe, stage: Stage) -> None:
        self._probe = probe
        self.item = item = stage.items[0]
        self.handler = handler = stage.handler
        delivery = item.delivery
        first = probe.first(item.message_id, handler.consumer)
        self.trace = Trace(
            item.message_id, handler.consumer, delivery.delivery_count, handler.runs, first
        )
        crash = probe.plan.crash
        self._crash_at: int | None = None
        if (
            first
            and crash is not None
            and (crash.message_id, crash.consumer) == (item.message_id, handler.consumer)
        ):
            self._crash_at = crash.at
        self._read: set[str] = set()
        self._locked: set[str] = set()  # read with FOR UPDATE / FOR SHARE
        self._started_write = False

    def boundary(self, what: str) -> None:
        trace = self.trace
        trace.boundaries.append(what)
        if self._crash_at == len(trace.boundaries):
            self._crash_at = None
            trace.crashed = what
            raise SimulatedCrash(f"simulated crash before {what}")

    def statement(self, connection: Connection, sql: str, context: Any) -> None:
        probe = self._probe
        write = is_write(sql)
        table = written_table(sql) if write else None
        if connection.engine not in probe.engines:
            if write:
                self._escaped(connection, sql, table)
            return
        self.boundary(shorten(sql))
        if not write:
            if verb_of(sql) in ("SELECT", "WITH"):
                tables = read_tables(sql) - WORKER_TABLES
                self._read |= tables
                if locks_rows(sql, context):
                    self._locked |= tables
            return
        if table is not None and table not in WORKER_TABLES:
            self.trace.written.add(table)
            if table in self._read and verb_of(sql) in ("UPDATE", "DELETE"):
                self._read_then_write(connection, sql, context)
        self._started_write = True

    def commit(self, connection: Connection) -> None:
        if connection.engine not in self._probe.engines:
            return
        try:
            self.boundary("the commit")
        except SimulatedCrash:
            connection.invalidate()  # the connection dies with the process: nothing commits
            raise

    def connected(self, address: Any) -> None:
        if self.handler.runs is not Runs.TRANSACTION:
            return  # a claim's call is what claims are for
        where = _address(address)
        if where is not None and where not in self._probe.database_addresses:
            self.trace.network.append(f"{where[0]}:{where[1]}")

    def _escaped(self, connection: Connection, sql: str, table: str | None) -> None:
        url = connection.engine.url
        self.trace.escaped.append(Escape(shorten(sql), url.render_as_string(hide_password=True)))
        if table is not None:
            self.trace.written.add(table)
        same_file = self._probe.sqlite_file
        if same_file is not None and _sqlite_file(str(url)) == same_file:
            raise EscapedWrite(
                f"a write through another engine to the pump's own SQLite file "
                f"({shorten(sql, 80)}) would wait for the pump's transaction for ever"
            )

    def _read_then_write(self, connection: Connection, sql: str, context: Any) -> None:
        trace = self.trace
        if self.handler.runs is not Runs.TRANSACTION:
            return
        table = written_table(sql)
        if guarded(context) is False and sets_plain_values(sql) and table not in self._locked:
            trace.unguarded.append(shorten(sql))
        writer = self._probe.plan.writer
        if writer is None or not trace.first or trace.writer is not None:
            return
        message_id = self.item.message_id
        if connection.dialect.name == "sqlite" and self._started_write:
            # The transaction holds SQLite's one write lock (the marker took it): no other
            # writer can commit before this one does, so there is no race to run here.
            trace.writer = WriterOutcome(message_id, "", "serialized")
            return
        message = self.item.message(self.handler)
        trace.writer = await_(writer(self.handler, message, message_id, self.item.delivery.headers))


# -- process-wide listeners, active only inside a probe's stage -------------------------

_installed = False


def install() -> None:
    """Attach the listeners once per process (an audit hook cannot be removed again;
    outside a probe's stage each costs one context-variable read)."""
    global _installed
    if _installed:
        return
    event.listen(Engine, "before_cursor_execute", _before_cursor_execute)
    event.listen(Engine, "commit", _commit)
    sys.addaudithook(_audit)
    _installed = True


def _before_cursor_execute(
    connection: Connection,
    _cursor: Any,
    statement: str,
    _parameters: Any,
    context: Any,
    _executemany: bool,
) -> None:
    run = _RUN.get()
    if run is not None:
        run.statement(connection, statement, context)


def _commit(connection: Connection) -> None:
    run = _RUN.get()
    if run is not None:
        run.commit(connection)


def _audit(name: str, args: tuple[Any, ...]) -> None:
    if name != "socket.connect":
        return
    run = _RUN.get()
    if run is not None and len(args) > 1:
        run.connected(args[1])


# -- addresses ------------------------------------------------------------------------


def _sqlite_file(url: str) -> Path | None:
    if not url.startswith("sqlite"):
        return None
    database = make_url(url).database
    if not database or database == ":memory:":
        return None
    return Path(database).resolve()


def _address(address: Any) -> tuple[str, int] | None:
    if isinstance(address, tuple) and len(address) >= 2 and isinstance(address[1], int):
        return str(address[0]), address[1]
    return None  # a Unix socket path: not a network call


def _addresses(url: str) -> frozenset[tuple[str, int]]:
    """Where the database listens, by every address its host resolves to."""
    if url.startswith("sqlite"):
        return frozenset()
    parsed = make_url(url)
    host, port = parsed.host or "localhost", parsed.port or 5432
    found = {(host, port)}
    try:
        for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            found.add((str(sockaddr[0]), port))
    except OSError:
        pass
    return frozenset(found)


async def bounded(task: asyncio.Task[WriterOutcome], wait: float) -> WriterOutcome | None:
    """The task's outcome if it ends within ``wait`` seconds, else None (it runs on)."""
    done, _ = await asyncio.wait({task}, timeout=wait)
    return task.result() if done else None


class ConcurrentWriter:
    """The writer of a :class:`Plan`: the handler's own function on the same message under
    the id ``<id>~writer``, on an engine and a session of its own, in a context of its own
    (so neither the pump's marks nor the probe's follow it), committed as the pump would.
    It gets ``wait`` seconds; one still waiting then waits for a lock the handler holds
    and commits after it (``close`` waits for it, at most ``settle_within`` seconds)."""

    def __init__(self, url: str, wait: float, settle_within: float) -> None:
        self._engine = create_engine(url, pool_size=2)
        self._sessions = session_factory(self._engine)
        self._wait = wait
        self._settle_within = settle_within
        self._late: dict[str, asyncio.Task[WriterOutcome]] = {}
        self.outcomes: dict[str, WriterOutcome] = {}

    async def __call__(
        self, handler: Handler[Any], message: BaseModel, message_id: str, headers: Any
    ) -> WriterOutcome:
        writer_id = f"{message_id}~writer"
        # a context of its own: the handler's marks (the pump's, the probe's) stay behind
        task = asyncio.create_task(
            self._write(handler, message, message_id, writer_id, headers),
            context=contextvars.Context(),
        )
        outcome = await bounded(task, self._wait)
        if outcome is None:  # it waits for a lock the handler holds: it commits after it
            self._late[message_id] = task
            outcome = WriterOutcome(message_id, writer_id, "after", "waited for the handler")
        self.outcomes[message_id] = outcome
        return outcome

    async def _write(
        self,
        handler: Handler[Any],
        message: BaseModel,
        message_id: str,
        writer_id: str,
        headers: Any,
    ) -> WriterOutcome:
        session = self._sessions()
        try:
            await handler.func(
                Context(session, writer_id, handler.consumer, 1, 1, headers), message
            )
            await AsyncSession.commit(session)
        except Exception as exc:
            return WriterOutcome(message_id, writer_id, "failed", f"{type(exc).__name__}: {exc}")
        finally:
            await discard(session)
        return WriterOutcome(message_id, writer_id, "before")

    async def close(self) -> None:
        try:
            for message_id, task in self._late.items():
                done = await bounded(task, self._settle_within)
                if done is None or done.state == "failed":
                    task.cancel()
                    self.outcomes[message_id] = WriterOutcome(
                        message_id, f"{message_id}~writer", "failed", "never committed"
                    )
        finally:
            await self._engine.dispose()
