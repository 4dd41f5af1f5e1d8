"""Faults through real connections: nothing here stands in for the database.

- PostgreSQL: the workers connect through a :class:`~tests.support.proxy.TcpProxy`, which
  refuses, resets or black-holes their traffic; a statement fails with a SQLSTATE because
  the server raises it (a real bad cast, a real unique violation, a real sort over
  ``temp_file_limit``, a real ``pg_terminate_backend``, a real read-only transaction, and
  ``RAISE ... USING ERRCODE`` from a PL/pgSQL function for the codes that need a server in
  trouble: a full disk, a missing database, too many connections, a security policy).
- SQLite: the real conditions where SQLite has them (``PRAGMA max_page_count`` for a full
  file, ``PRAGMA query_only`` for a read-only one, a missing table, a unique violation, an
  integer the driver cannot bind); otherwise the driver's own exception classes, raised
  where the driver raises them: in SQLAlchemy's ``before_cursor_execute`` (inside its
  error handling, so the pump sees exactly what a failing ``sqlite3`` call gives it) and in
  ``do_connect`` while the file is "unreachable".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sqlite3
import time
from typing import Any

from sqlalchemy import Engine, event, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from tests.explorer.schedule import Schedule, StatementFault
from tests.support.proxy import TcpProxy, proxied
from worker.db import create_engine

SQLITE_HEADROOM_PAGES = 1000
"""Pages a SQLite file may still grow by: ample for a schedule's small rows, too few for
one oversized write (SQLITE_FULL for that write only, as on a nearly full disk)."""
_OVERSIZED = (SQLITE_HEADROOM_PAGES + 500) * 4096

_RAISED = {
    # PostgreSQL codes only a server in trouble raises: from a function, with its message
    "40001": "could not serialize access due to concurrent update",
    "40P01": "deadlock detected",
    "08006": "connection failure",
    "3D000": 'database "explorer" does not exist',
    "53300": "sorry, too many clients already",
    "42501": 'new row violates row-level security policy for table "explorer_effects"',
    "53100": 'could not extend file "base/16384/16385": No space left on device',
    "55P03": "canceling statement due to lock timeout",
}

FUNCTION_SQL = """
CREATE OR REPLACE FUNCTION explorer_raise(code text, message text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message;
END $$
"""

_SQLITE_RAISED = {
    # SQLite conditions without a cheap real trigger: sqlite3's own classes and messages
    "40001": "database is locked",
    "08006": "unable to open database file",
}
_SPILLING_SORT = text(
    "SELECT count(*) FROM (SELECT g FROM generate_series(1, 100000) g ORDER BY g DESC) sorted"
)
_SQLITE_MARK = "SELECT 'explorer-fault'"
_UNREACHABLE = "unable to open database file"
_LOST = "disk I/O error"


class Outages:
    """The database unreachable until a moment: on PostgreSQL through every pump's proxy
    (refused or black-holed; a pump that starts meanwhile meets it too), on SQLite through
    the driver. Overlapping outages end with the last one."""

    def __init__(self) -> None:
        self._proxies: set[TcpProxy] = set()
        self._until = 0.0
        self._how = ""
        self._task: asyncio.Task[None] | None = None
        self.lose_next = False  # SQLite: the next statement's connection breaks

    @property
    def down(self) -> bool:
        return time.monotonic() < self._until

    def attach(self, proxy: TcpProxy) -> None:
        self._proxies.add(proxy)
        if self.down:
            self._cut(proxy)

    def detach(self, proxy: TcpProxy) -> None:
        self._proxies.discard(proxy)

    def begin(self, how: str, seconds: float) -> None:
        """Start now (callable from a synchronous engine event): ``reset`` drops every
        open connection, ``refuse`` also refuses new ones, ``blackhole`` stalls them."""
        if how == "reset" or seconds <= 0:
            for proxy in self._proxies:
                proxy.reset()
            self.lose_next = not self._proxies
            return
        if not self.down:
            self._how = how
        self._until = max(self._until, time.monotonic() + seconds)
        for proxy in self._proxies:
            self._cut(proxy)  # at once: the statement about to run meets a dead socket
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._hold(), context=contextvars.Context())

    def _cut(self, proxy: TcpProxy) -> None:
        if self._how == "blackhole":
            proxy.blackhole()
        else:
            proxy.reset()

    async def _hold(self) -> None:
        refused: set[TcpProxy] = set()
        try:
            while (left := self._until - time.monotonic()) > 0:
                for proxy in list(self._proxies - refused):
                    if self._how != "blackhole":
                        refused.add(proxy)
                        await proxy.refuse()
                await asyncio.sleep(min(left, 0.05))
        finally:
            for proxy in list(self._proxies):
                await proxy.heal()
            self._task = None

    async def end(self) -> None:
        """Heal now (the workload is over, or the run is)."""
        self._until = 0.0
        self.lose_next = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for proxy in list(self._proxies):
            await proxy.heal()


class Paths:
    """Each pump's own way to the database, as a process of its own has: its own engine
    (the injector installed) and, on PostgreSQL, its own TCP path through a proxy. When the
    process dies its connections vanish with it (its proxy resets and closes; on SQLite its
    statements fail as on a closed file), so the database drops its transactions and locks
    at once, as it does for a killed pod."""

    def __init__(self, url: str, pool_size: int, injector: Injector, outages: Outages) -> None:
        self.url = url
        self.pool_size = pool_size
        self.injector = injector
        self.outages = outages
        self._proxies: dict[AsyncEngine, TcpProxy] = {}
        self._closing: set[asyncio.Task[None]] = set()

    async def open(self) -> AsyncEngine:
        url, proxy = self.url, None
        if not url.startswith("sqlite"):
            proxy, url = await proxied(url)
            self.outages.attach(proxy)
        engine = create_engine(url, pool_size=self.pool_size)
        self.injector.install(engine)
        if proxy is not None:
            self._proxies[engine] = proxy
        return engine

    def sever(self, engine: AsyncEngine) -> None:
        self.injector.severed.add(engine.sync_engine)
        proxy = self._proxies.pop(engine, None)
        if proxy is not None:
            self.outages.detach(proxy)
            proxy.reset()
            task = asyncio.get_running_loop().create_task(proxy.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._closing, return_exceptions=True)
        for proxy in self._proxies.values():
            self.outages.detach(proxy)
            await proxy.close()
        self._proxies.clear()


class Injector:
    """Installed on every worker engine: counts the statements the workers send, fires the
    schedule's statement faults, and makes SQLite unreachable while an outage lasts."""

    def __init__(self, schedule: Schedule, outages: Outages) -> None:
        self.outages = outages
        self.sqlite = schedule.database == "sqlite"
        self.severed: set[Engine] = set()  # engines of dead processes
        self.active = False
        self.statements = 0
        self.fired: list[str] = []
        self._faults: dict[int, StatementFault] = {}
        for fault in schedule.statement_faults:
            self._faults.setdefault(fault.n, fault)

    def install(self, engine: AsyncEngine) -> None:
        sync = engine.sync_engine
        event.listen(sync, "before_cursor_execute", self._statement)
        if self.sqlite:
            event.listen(sync, "do_connect", self._connect)
            event.listen(sync, "connect", _sqlite_limits)
            event.listen(sync, "checkout", _sqlite_writable)

    def _statement(
        self, _conn: Any, _cursor: Any, _sql: str, params: Any, _context: Any, _many: bool
    ) -> None:
        if self.sqlite and _conn.engine in self.severed:
            raise sqlite3.OperationalError(_LOST)
        if self.sqlite:
            if _sql.startswith(_SQLITE_MARK):  # the handler asked for this driver error
                raise sqlite3.OperationalError(_SQLITE_RAISED[params[0]])
            if self.outages.down:
                raise sqlite3.OperationalError(_UNREACHABLE)
            if self.outages.lose_next:
                self.outages.lose_next = False
                raise sqlite3.OperationalError(_LOST)
        if not self.active:
            return
        self.statements += 1
        fault = self._faults.pop(self.statements, None)
        if fault is None:
            return
        self.fired.append(str(fault))
        if fault.kind == "cancel":
            raise asyncio.CancelledError(f"explorer: {fault}")
        self.outages.begin("reset" if fault.kind == "lost" else fault.kind, fault.seconds)
        if self.sqlite:  # the statement that met it fails as the driver's would
            self._statement(_conn, _cursor, _sql, params, _context, _many)

    def _connect(self, *_args: Any) -> None:
        if self.outages.down:
            raise sqlite3.OperationalError(_UNREACHABLE)


def _sqlite_limits(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA page_count")
    used = cursor.fetchone()[0]
    cursor.execute(f"PRAGMA max_page_count = {used + SQLITE_HEADROOM_PAGES}")
    cursor.close()


def _sqlite_writable(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    # a handler that made its connection read-only (25006 below) left it so: the next
    # checkout finds the file writable again, as a remount would
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA query_only = 0")
    cursor.close()


async def fail_statement(session: AsyncSession, code: str, database: str) -> None:
    """Make the handler's next statement fail with ``code``, as the database would."""
    if database == "postgresql":
        await _postgres(session, code)
    else:
        await _sqlite(session, code)
    raise AssertionError(f"explorer: SQLSTATE {code} was not raised")  # pragma: no cover


async def _postgres(session: AsyncSession, code: str) -> None:
    if code == "57P01":  # the server ends this backend: a restart as one connection sees it
        await session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
    elif code == "25006":
        await session.execute(text("SET LOCAL transaction_read_only = on"))
        await session.execute(text("INSERT INTO explorer_unique (code) VALUES ('read-only')"))
    elif code == "53400":  # a sort that spills past temp_file_limit
        await session.execute(text("SET LOCAL work_mem = '64kB'"))
        await session.execute(text("SET LOCAL temp_file_limit = '64kB'"))
        await session.execute(_SPILLING_SORT)
    elif code == "42P01":
        await session.execute(text("SELECT * FROM explorer_missing"))
    elif code == "22P02":
        await session.execute(text("SELECT CAST('not a number' AS integer)"))  # the server's
    elif code == "23505":
        await session.execute(text("INSERT INTO explorer_unique (code) VALUES ('taken')"))
    else:
        await session.execute(
            text("SELECT explorer_raise(:code, :message)"), {"code": code, "message": _RAISED[code]}
        )


async def _sqlite(session: AsyncSession, code: str) -> None:
    if code == "53100":  # one write larger than the room left in the file
        await session.execute(
            text("INSERT INTO explorer_blobs (data) VALUES (zeroblob(:n))"), {"n": _OVERSIZED}
        )
    elif code == "25006":
        await session.execute(text("PRAGMA query_only = 1"))
        await session.execute(text("INSERT INTO explorer_unique (code) VALUES ('read-only')"))
    elif code == "42P01":
        await session.execute(text("SELECT * FROM explorer_missing"))
    elif code == "22003":
        await session.execute(text("SELECT :v"), {"v": 2**70})
    elif code == "23505":
        await session.execute(text("INSERT INTO explorer_unique (code) VALUES ('taken')"))
    else:
        await session.execute(text(f"{_SQLITE_MARK}, :code"), {"code": code})


async def unreachable(session: AsyncSession, outages: Outages, how: str, seconds: float) -> None:
    """The database becomes unreachable under the handler, which then sends a statement."""
    outages.begin(how, seconds)
    await session.execute(text("SELECT 1"))
