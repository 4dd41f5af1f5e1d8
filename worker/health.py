"""Database health: pause intake while the database cannot serve anyone, and probe it.

A database that is down, read-only, out of disk or refusing a privilege is the
environment's fault, never a message's (DESIGN: "the environment's faults are not
the message's"). The runner that meets such a failure gives its delivery back
uncounted and closes this gate; intake takes nothing while it is closed, so an
outage of minutes neither marches messages into the dead-letter queue nor logs one
traceback each. Each kind of trouble is probed with a check that can tell it is over:

=================  ===============================================================
trouble            the probe that reopens the gate
=================  ===============================================================
unreachable        a ping (``SELECT 1``) answers
read-only          the server takes writes again (PostgreSQL: not in recovery and
                   ``transaction_read_only`` off; SQLite: a write lock can be taken)
privilege          the role holds again a privilege it lacked on the table the
                   error named (``has_table_privilege``); time when none was named
out of resources   a small write goes through (a marker inserted and rolled back:
                   it needs disk for the log, memory for the statement)
=================  ===============================================================

A statement that cannot reach its server (a black hole: the connection stays open and
nothing comes back) would hang its attempt until WORKER_HANDLER_TIMEOUT. So while
attempts are under way (:attr:`DatabaseHealth.attempts`, each a cut-able timeout), the
database is pinged every ``LIVENESS`` seconds (a quarter of WORKER_HANDLER_TIMEOUT when
that is shorter) that any of them has been running that long; one that does not answer
within 5 s (or that period) closes the gate and cuts every attempt: each
is given back uncounted, as for any outage. A slow statement on a database that answers
is left alone.

A pause ends only on a probe's evidence (or, where nothing can tell, after a wait that
doubles with each pause of an episode, 1 s to 30 s). A message that trips the same
fault right after each recovery is then bounded like any other give-back
(worker.settle): it is what a message that causes the fault does.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.db import Failure, ping

_PING_TIMEOUT = 5.0
LIVENESS = 10.0
"""Seconds an attempt runs before the watch asks whether the database still answers."""
_EPISODE = 120.0  # a pause this long after the last one starts a new episode
_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE")
_DENIED_TABLE = re.compile(r"permission denied for (?:table|relation) \"?([\w.]+)\"?")

Probe = Callable[[AsyncEngine], Awaitable[bool]]
"""True once the trouble is over."""


_LEFT_BEHIND: set[asyncio.Task[None]] = set()


async def _ping_within(engine: AsyncEngine, seconds: float) -> None:
    """Ping, raising ``TimeoutError`` after ``seconds`` without waiting for the ping's
    cancellation: on a black-holed connection that waits as long as the hole does (the
    driver cancels the statement over the network), so the ping is left to end alone."""
    task = asyncio.ensure_future(ping(engine))
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        _LEFT_BEHIND.add(task)
        task.add_done_callback(_LEFT_BEHIND.discard)
        raise TimeoutError(f"the database did not answer a ping within {seconds}s")
    task.result()


async def _reachable(engine: AsyncEngine) -> bool:
    await ping(engine)
    return True


async def _writable(engine: AsyncEngine) -> bool:
    async with engine.connect() as connection:
        if connection.dialect.name == "postgresql":
            row = await connection.execute(
                text(
                    "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'"
                )
            )
            return not row.scalar()
        return await _sqlite_write_lock(connection)


_PROBE_WRITE = text("INSERT INTO inbox (message_id, consumer) VALUES (:m, 'worker-health-probe')")


async def _writes(engine: AsyncEngine) -> bool:
    """A small write goes through: a marker, rolled back (it needs disk for the log and
    memory for the statement; what a message too big for either leaves to the others)."""
    async with engine.connect() as connection:
        transaction = await connection.begin()
        try:
            await connection.execute(_PROBE_WRITE, {"m": f"probe-{time.monotonic_ns()}"})
        except Exception:
            return False
        finally:
            await transaction.rollback()
    return True


async def _sqlite_write_lock(connection: AsyncConnection) -> bool:
    """An UPDATE that changes nothing still takes SQLite's write lock, which a read-only
    file refuses; rolled back, it leaves nothing behind."""
    transaction = await connection.begin()
    try:
        await connection.execute(text("UPDATE inbox SET id = id WHERE id < 0"))
    except Exception:
        return False
    finally:
        await transaction.rollback()
    return True


def _privileges(table: str, missing: frozenset[str]) -> Probe:
    async def granted(engine: AsyncEngine) -> bool:
        async with engine.connect() as connection:
            for privilege in missing:
                held = await connection.execute(
                    text("SELECT has_table_privilege(:t, :p)"), {"t": table, "p": privilege}
                )
                if held.scalar():
                    return True
        return False

    return granted


async def _missing_privileges(engine: AsyncEngine, table: str) -> frozenset[str]:
    async with engine.connect() as connection:
        missing = set()
        for privilege in _PRIVILEGES:
            held = await connection.execute(
                text("SELECT has_table_privilege(:t, :p)"), {"t": table, "p": privilege}
            )
            if not held.scalar():
                missing.add(privilege)
    return frozenset(missing)


class DatabaseHealth:
    """A gate intake waits on before it takes a delivery, and the probe that reopens it."""

    def __init__(self, engine: AsyncEngine, log: Any, backoff_max: float = 5.0) -> None:
        self._engine = engine
        self._log = log
        self._backoff_max = backoff_max
        self.gate = asyncio.Event()
        """Set while the database can serve; intake takes nothing while it is clear."""
        self.gate.set()
        self._lock = asyncio.Lock()
        self._probe: asyncio.Task[None] | None = None
        self._timed_pauses = 0
        self._last_timed_pause = 0.0
        self._watch: asyncio.Task[None] | None = None
        self.outages = 0
        self.attempts: set[asyncio.Timeout] = set()
        """The attempts under way, each cut (its timeout expired at once) when the database
        stops answering; a runner adds its attempt's timeout and removes it when done."""

    @property
    def available(self) -> bool:
        return self.gate.is_set()

    async def wait_available(self) -> None:
        if not self.gate.is_set():
            await self.gate.wait()

    async def confirm(self, within: float = _PING_TIMEOUT) -> bool:
        """True when the database answers now, within ``within`` seconds; otherwise pause
        intake and say False."""
        async with self._lock:
            if not self.gate.is_set():
                return False
            try:
                await _ping_within(self._engine, within)
                return True
            except Exception as exc:
                self._pause(exc, "database unavailable", _reachable)
                return False

    async def pause_for(self, failure: Failure, exc: BaseException) -> None:
        """Close the gate for an environment failure (``Failure.environment``)."""
        async with self._lock:
            if not self.gate.is_set():
                return
            if failure is Failure.READ_ONLY:
                self._pause(exc, "database is read-only", _writable)
            elif failure is Failure.PRIVILEGE:
                self._pause(exc, "database refuses a privilege", await self._privilege_probe(exc))
            else:
                self._pause(exc, "database is out of resources", _writes)

    async def _privilege_probe(self, exc: BaseException) -> Probe | None:
        found = _DENIED_TABLE.search(str(exc))
        if found is None or self._engine.dialect.name != "postgresql":
            return None
        try:
            async with asyncio.timeout(_PING_TIMEOUT):
                missing = await _missing_privileges(self._engine, found.group(1))
        except Exception:
            return None
        return _privileges(found.group(1), missing) if missing else None

    def _timed_wait(self) -> float:
        now = time.monotonic()
        if now - self._last_timed_pause > _EPISODE:
            self._timed_pauses = 0
        self._last_timed_pause = now
        self._timed_pauses += 1
        return min(2.0 ** (self._timed_pauses - 1), 30.0)

    def _pause(self, exc: BaseException, what: str, probe: Probe | None) -> None:
        # nothing can tell when it is over: reopen after a wait, and the next failure says
        first = 0.1 if probe is not None else self._timed_wait()
        self.outages += 1
        self.gate.clear()
        self._log.warning(f"{what}, pausing intake", error=exc, probe_after_s=first)
        self._probe = asyncio.create_task(
            self._probe_until_available(time.monotonic(), first, probe, what)
        )

    async def _probe_until_available(
        self, since: float, delay: float, probe: Probe | None, what: str
    ) -> None:
        while True:
            await asyncio.sleep(delay)
            if probe is None:
                break
            try:
                async with asyncio.timeout(_PING_TIMEOUT):
                    if await probe(self._engine):
                        break
                self._log.debug("database probe: not yet", trouble=what, next_probe_s=delay)
            except Exception as exc:
                self._log.debug("database probe failed", error=exc, next_probe_s=delay)
            delay = min(max(delay, 0.1) * 2, self._backoff_max)
        self.gate.set()
        self._log.info(
            "database available, resuming",
            trouble=what,
            outage_s=round(time.monotonic() - since, 2),
        )

    def watch(self, timeout: float | None) -> None:
        """Start watching the attempts under way (the pump does, once it consumes), each
        bounded by ``timeout`` (WORKER_HANDLER_TIMEOUT): the database is asked often
        enough to cut them before that timeout would count them as the handler's."""
        if self._watch is None:
            period = LIVENESS if timeout is None else min(LIVENESS, timeout / 4)
            self._watch = asyncio.create_task(self._watching(period), name="database watch")

    async def _watching(self, period: float) -> None:
        long: set[int] = set()  # attempts already under way at the last look
        while True:
            await asyncio.sleep(period)
            running = {id(attempt) for attempt in self.attempts}
            overdue, long = running & long, running
            if not overdue or not self.gate.is_set():
                continue
            try:
                await _ping_within(self._engine, min(_PING_TIMEOUT, period))
            except Exception as exc:
                await self._unreachable(exc)

    async def _unreachable(self, exc: BaseException) -> None:
        """The database does not answer while attempts wait on it: pause, cut them all."""
        async with self._lock:
            if self.gate.is_set():
                self._pause(exc, "database does not answer", _reachable)
        now = asyncio.get_running_loop().time()
        for attempt in list(self.attempts):
            if attempt.when() is None or attempt.when() > now:  # type: ignore[operator]
                attempt.reschedule(now)

    async def close(self) -> None:
        for task in (self._probe, self._watch):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
