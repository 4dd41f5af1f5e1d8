"""What the kit sees of a handler while the real pump runs it, and the faults it injects.

A :class:`Probe` is stage middleware around every handler's runner: it marks the task's
context, and process-wide listeners act only inside a marked context:

- SQLAlchemy's ``before_cursor_execute``, ``after_cursor_execute``, ``commit`` and
  ``rollback`` on every engine: each statement and commit on the pump's engines is a
  *boundary* of the handler's unit of work (the marker's insert, the handler's own
  statements, the commit), and each committed transaction's writes are recorded with
  what they did (:mod:`worker.testing.replay`); a write through any other engine, or
  through a second connection of the pump's own engine while the handler runs, is a
  write that escaped the transaction, and a ``COMMIT`` the handler sends is one too;
- the database drivers' ``connect`` (sqlite3, aiosqlite, asyncpg, psycopg, psycopg2)
  called from the handler's code rather than SQLAlchemy's: a connection of its own;
- the client libraries' calls (:mod:`worker.testing.effects`): requests, publishes,
  mails, with their idempotency keys; and Python's audit event ``socket.connect``: a
  connection a transaction handler opens to anything but the database.

Around each stage the probe also compares the replica's copy of the handler modules
before and after (:mod:`worker.testing.isolation`): the module state the handler
changed.

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
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession

from worker import histories
from worker.context import Context, session_factory
from worker.db import create_engine, discard, redact
from worker.registry import Registry, Runs
from worker.testing import effects
from worker.testing.core import handler_call
from worker.testing.effects import Effect
from worker.testing.isolation import Replica, changes
from worker.testing.replay import Statement, Transaction, replayable, returned_rows
from worker.testing.statements import (
    advisory_lock,
    ends_transaction,
    is_write,
    locks_rows,
    read_tables,
    shorten,
    unguarded,
    verb_of,
    written_table,
)

try:  # SQLAlchemy 2.1 names it await_; 2.0 only await_only
    from sqlalchemy.util import await_
except ImportError:  # pragma: no cover - SQLAlchemy 2.0
    from sqlalchemy.util import await_only as await_

if TYPE_CHECKING:
    from pydantic import BaseModel

    from worker.registry import Handler
    from worker.testing.core import NextStage, Stage, Verdict

WORKER_TABLES = histories.WORKER_TABLES | {histories.VERSION_TABLE, histories.LEGACY_VERSION_TABLE}
"""The worker's own tables: never a handler's business table."""


class SimulatedCrash(Exception):
    """Raised by the kit where a process would have died: the attempt ends, nothing commits."""


class EscapedWrite(Exception):
    """A handler wrote to the pump's own SQLite file past the pump's transaction (another
    engine, a second connection, a connection of its own).

    SQLite has one writer, and the pump's transaction is it: the write would wait for a
    commit that waits for the write. The kit fails it at once instead.
    """


# -- what one stage run left behind ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Escape:
    """A write past the pump's transaction: through another engine, a second connection,
    a connection of the handler's own, or a COMMIT of its own."""

    sql: str
    engine: str  # where: its URL, password masked, or what it was
    how: str = "through another engine"


@dataclass(frozen=True, slots=True)
class WriterOutcome:
    """How the concurrent writer went: it committed before the handler's write, waited
    behind the handler's lock (and committed after it), or failed."""

    message_id: str
    writer_id: str
    state: str  # "before", "after", "failed"
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
    effects: list[Effect] = field(default_factory=list)
    unguarded: list[str] = field(default_factory=list)
    read: set[str] = field(default_factory=set)  # tables, before any write to them
    written: set[str] = field(default_factory=set)  # tables, through any engine
    transactions: list[Transaction] = field(default_factory=list)  # committed, on the pump's
    state: list[str] = field(default_factory=list)  # module globals the stage changed
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
    """Stage middleware that traces every handler's stage, and injects ``plan``.

    One probe serves every replica of a run (the crash of a message's first attempt is
    the first attempt on any of them); :meth:`middleware` is its stage middleware for one
    replica, which also watches that replica's copy of the handler modules."""

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

    def middleware(self, replica: Replica | None = None) -> ReplicaProbe:
        return ReplicaProbe(self, replica)

    async def __call__(self, stage: Stage, call_next: NextStage) -> list[Verdict]:
        return await self.stage(None, stage, call_next)

    async def stage(
        self, replica: Replica | None, stage: Stage, call_next: NextStage
    ) -> list[Verdict]:
        run = _StageRun(self, stage)
        if replica is not None and replica.amnesia:
            replica.forget()
        before = replica.fingerprint() if replica is not None else {}
        token = _RUN.set(run)
        try:
            return await call_next(stage)
        finally:
            _RUN.reset(token)
            if replica is not None:
                run.trace.state = changes(before, replica.fingerprint())
            self.traces.append(run.trace)

    def first(self, message_id: str, consumer: str) -> bool:
        key = (message_id, consumer)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


class ReplicaProbe:
    """The probe as one replica's stage middleware."""

    def __init__(self, probe: Probe, replica: Replica | None) -> None:
        self.probe = probe
        self.replica = replica

    async def __call__(self, stage: Stage, call_next: NextStage) -> list[Verdict]:
        return await self.probe.stage(self.replica, stage, call_next)


class _StageRun:
    """The probe's state inside one stage: the statements so far, what was read, the
    transactions open on the pump's connections."""

    __slots__ = (
        "_call",
        "_crash_at",
        "_last_pump",
        "_locked",
        "_mine",
        "_open",
        "_pending",
        "_probe",
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
        self._locked: set[str] = set()  # read with FOR UPDATE / FOR SHARE
        self._open: dict[int, Transaction] = {}  # per pump connection, until it commits
        self._pending: dict[int, Statement] = {}  # the statement each connection runs
        self._call: object | None = None  # the handler call in progress
        self._mine: Any = None  # the DBAPI connection of that call
        self._last_pump: Any = None  # the one the pump used last, outside any call

    def boundary(self, what: str) -> None:
        trace = self.trace
        trace.boundaries.append(what)
        if self._crash_at == len(trace.boundaries):
            self._crash_at = None
            trace.crashed = what
            raise SimulatedCrash(f"simulated crash before {what}")

    def statement(
        self, connection: Connection, sql: str, parameters: Any, context: Any, many: bool
    ) -> None:
        probe = self._probe
        write = is_write(sql)
        table = written_table(sql) if write else None
        if connection.engine not in probe.engines:
            if write:
                self._escaped(connection, sql, table, "through another engine")
            return
        self._second_connection(connection, sql, write, table)
        self.boundary(shorten(sql))
        if ends_transaction(sql) and handler_call() is not None:
            self.trace.escaped.append(Escape(shorten(sql), "the pump's transaction", "sent"))
        transaction = self._open.setdefault(id(connection), Transaction())
        if advisory_lock(sql):  # the lock comes first in the statement: its key is the first value
            transaction.advisory.add(repr(_first(parameters)))
        if not write:
            if verb_of(sql) in ("SELECT", "WITH"):
                tables = read_tables(sql) - WORKER_TABLES
                transaction.read |= tables
                self.trace.read |= tables - self.trace.written
                if locks_rows(sql, context):
                    self._locked |= tables
                    transaction.locked |= tables
            if replayable(sql):  # a savepoint
                self._record(connection, transaction, sql, parameters, many)
            return
        self._record(connection, transaction, sql, parameters, many)
        if table is not None and table not in WORKER_TABLES:
            self.trace.written.add(table)
            if table in transaction.read and verb_of(sql) in ("UPDATE", "DELETE"):
                self._read_then_write(connection, sql, context)

    def _record(
        self,
        connection: Connection,
        transaction: Transaction,
        sql: str,
        parameters: Any,
        many: bool,
    ) -> None:
        statement = Statement(sql, parameters, many)
        transaction.statements.append(statement)
        self._pending[id(connection)] = statement

    def executed(self, connection: Connection, cursor: Any, sql: str) -> None:
        statement = self._pending.pop(id(connection), None)
        if statement is None or statement.sql is not sql:
            return
        statement.rowcount = getattr(cursor, "rowcount", -1)
        statement.returned = returned_rows(cursor, sql)
        statement.lastrowid = getattr(cursor, "lastrowid", None)

    def commit(self, connection: Connection) -> None:
        if connection.engine not in self._probe.engines:
            return
        try:
            self.boundary("the commit")
        except SimulatedCrash:
            connection.invalidate()  # the connection dies with the process: nothing commits
            raise
        transaction = self._open.pop(id(connection), None)
        if transaction is not None and transaction.statements:
            transaction.failed = any(s.rowcount is None for s in transaction.statements)
            self.trace.transactions.append(transaction)

    def rolled_back(self, connection: Connection) -> None:
        self._open.pop(id(connection), None)
        self._pending.pop(id(connection), None)

    def connected(self, address: Any) -> None:
        if self.handler.runs is not Runs.TRANSACTION:
            return  # a claim's call is what claims are for
        where = _address(address)
        if where is not None and where not in self._probe.database_addresses:
            self.trace.network.append(f"{where[0]}:{where[1]}")

    def effect(self, effect: Effect) -> None:
        message_id = self.item.message_id
        if effect.key is None and self.handler.runs is Runs.CLAIM and message_id in effect.content:
            effect = replace(effect, key=message_id)  # ctx.idempotency_key, sent otherwise
        self.trace.effects.append(replace(effect, content=""))

    def own_connection(self, driver: str, target: str) -> None:
        """The handler's code opened a database connection with the driver itself."""
        self.trace.escaped.append(
            Escape(f"{driver}.connect({target})", target, "through a connection of its own")
        )
        same_file = self._probe.sqlite_file
        if same_file is not None and _sqlite_file(f"sqlite:///{target}") == same_file:
            raise EscapedWrite(
                f"{driver}.connect({target}): a connection of the handler's own to the pump's "
                "SQLite file would wait for the pump's transaction to write"
            )

    def _second_connection(
        self, connection: Connection, sql: str, write: bool, table: str | None
    ) -> None:
        """A statement of the handler's on another connection of the pump's own engine
        (a session of its own on ``ctx.session.bind``): it commits on its own."""
        dbapi = connection.connection.dbapi_connection
        call = handler_call()
        if call is None:
            self._last_pump = dbapi
            return
        if call is not self._call:  # a new attempt: its connection is the pump's last one
            self._call, self._mine, self._last_pump = call, self._last_pump, None
        if self._mine is None:
            self._mine = dbapi
        elif dbapi is not self._mine and write and self.handler.runs is Runs.TRANSACTION:
            self._escaped(
                connection, sql, table, "through a second connection of the pump's engine"
            )

    def _escaped(self, connection: Connection, sql: str, table: str | None, how: str) -> None:
        url = connection.engine.url
        self.trace.escaped.append(
            Escape(shorten(sql), url.render_as_string(hide_password=True), how)
        )
        if table is not None:
            self.trace.written.add(table)
        same_file = self._probe.sqlite_file
        if same_file is not None and _sqlite_file(str(url)) == same_file:
            raise EscapedWrite(
                f"a write {how} to the pump's own SQLite file "
                f"({shorten(sql, 80)}) would wait for the pump's transaction for ever"
            )

    def _read_then_write(self, connection: Connection, sql: str, context: Any) -> None:
        trace = self.trace
        if self.handler.runs is not Runs.TRANSACTION:
            return
        table = written_table(sql)
        if unguarded(sql, context) and table not in self._locked:
            trace.unguarded.append(shorten(sql))
        writer = self._probe.plan.writer
        if writer is None or not trace.first or trace.writer is not None:
            return
        if connection.dialect.name == "sqlite":
            return  # SQLite's one write lock lets no writer in: the checker emulates it
        message_id = self.item.message_id
        message = self.item.message(self.handler)
        trace.writer = await_(writer(self.handler, message, message_id, self.item.delivery.headers))


# -- process-wide listeners, active only inside a probe's stage -------------------------

_installed = False


def install() -> None:
    """Attach the listeners once per process (an audit hook cannot be removed again;
    outside a probe's stage each costs one context-variable read), and wrap the client
    libraries and drivers imported since the last call."""
    global _installed
    effects.install(_effect)
    _wrap_drivers()
    if _installed:
        return
    event.listen(Engine, "before_cursor_execute", _before_cursor_execute)
    event.listen(Engine, "after_cursor_execute", _after_cursor_execute)
    event.listen(Engine, "commit", _commit)
    event.listen(Engine, "rollback", _rollback)
    sys.addaudithook(_audit)
    _installed = True


def _before_cursor_execute(
    connection: Connection,
    _cursor: Any,
    statement: str,
    parameters: Any,
    context: Any,
    executemany: bool,
) -> None:
    run = _RUN.get()
    if run is not None:
        run.statement(connection, statement, parameters, context, executemany)


def _after_cursor_execute(
    connection: Connection,
    cursor: Any,
    statement: str,
    _parameters: Any,
    _context: Any,
    _executemany: bool,
) -> None:
    run = _RUN.get()
    if run is not None:
        run.executed(connection, cursor, statement)


def _commit(connection: Connection) -> None:
    run = _RUN.get()
    if run is not None:
        run.commit(connection)


def _rollback(connection: Connection) -> None:
    run = _RUN.get()
    if run is not None:
        run.rolled_back(connection)


def _audit(name: str, args: tuple[Any, ...]) -> None:
    if name != "socket.connect":
        return
    run = _RUN.get()
    if run is not None and len(args) > 1:
        run.connected(args[1])


def _effect(effect: Effect) -> None:
    run = _RUN.get()
    if run is not None:
        run.effect(effect)


def _first(parameters: Any) -> Any:
    if isinstance(parameters, dict):
        return next(iter(parameters.values()), None)
    if isinstance(parameters, list | tuple):
        return parameters[0] if parameters else None
    return parameters


# -- a handler's own database connections ------------------------------------------------

_DRIVERS = (
    ("sqlite3", "connect"),
    ("aiosqlite", "connect"),
    ("aiosqlite.core", "connect"),
    ("asyncpg", "connect"),
    ("psycopg", "connect"),
    ("psycopg2", "connect"),
)
_WRAPPED = "__worker_testing_driver__"


def _wrap_drivers() -> None:
    for name, attribute in _DRIVERS:
        module = sys.modules.get(name)
        original = getattr(module, attribute, None)
        if module is None or original is None or getattr(original, _WRAPPED, False):
            continue
        setattr(module, attribute, _connect_wrapper(name.split(".")[0], original))


def _connect_wrapper(driver: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def connect(*args: Any, **kwargs: Any) -> Any:
        run = _RUN.get()
        if run is not None and not _called_by_sqlalchemy():
            run.own_connection(driver, _target(args, kwargs))
        return original(*args, **kwargs)

    setattr(connect, _WRAPPED, True)
    connect.__doc__ = original.__doc__
    return connect


def _called_by_sqlalchemy() -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return isinstance(caller, str) and caller.split(".")[0] in ("sqlalchemy", "aiosqlite")


def _target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    target = (
        args[0] if args else kwargs.get("database") or kwargs.get("dsn") or kwargs.get("conninfo")
    )
    if target is None:
        return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "password")
    text = str(target)
    return redact(text) if "://" in text else text


# -- addresses ------------------------------------------------------------------------


def _sqlite_file(url: str) -> Path | None:
    if not url.startswith("sqlite"):
        return None
    try:
        database = make_url(url).database
    except Exception:
        return None
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
    and commits after it (``close`` waits for it, at most ``settle_within`` seconds).
    ``handlers``: where it finds the handler's function by consumer (a replica of its own,
    as another process would be); default: the stage's own."""

    def __init__(
        self, url: str, wait: float, settle_within: float, handlers: Registry | None = None
    ) -> None:
        self._handlers = {h.consumer: h for h in handlers} if handlers is not None else {}
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
        handler = self._handlers.get(handler.consumer, handler)
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
