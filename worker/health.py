"""Database health: pause intake during an outage instead of failing every message."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.db import ping

_PING_TIMEOUT = 5.0


class DatabaseHealth:
    """A gate the pump waits on before it takes a delivery.

    After a connection error the pump asks :meth:`confirm`. One ping decides:
    the database answers (a dropped connection; retry the attempt) or it does
    not (close the gate, log once, probe with backoff until it answers). While
    the gate is closed no delivery is taken, so an outage of minutes neither
    marches messages into the dead-letter queue nor logs one traceback each.
    """

    def __init__(self, engine: AsyncEngine, log: Any, backoff_max: float = 5.0) -> None:
        self._engine = engine
        self._log = log
        self._backoff_max = backoff_max
        self._open = asyncio.Event()
        self._open.set()
        self._lock = asyncio.Lock()
        self._probe: asyncio.Task[None] | None = None
        self._schema_pauses = 0
        self._last_schema_pause = 0.0
        self.outages = 0

    @property
    def available(self) -> bool:
        return self._open.is_set()

    async def wait_available(self) -> None:
        if not self._open.is_set():
            await self._open.wait()

    async def confirm(self) -> bool:
        """True when the database answers now; otherwise pause the pump and say False."""
        async with self._lock:
            if not self._open.is_set():
                return False
            try:
                async with asyncio.timeout(_PING_TIMEOUT):
                    await ping(self._engine)
                return True
            except Exception as exc:
                self._pause(exc)
                return False

    def pause_for_schema(self, exc: BaseException) -> None:
        """A table or column the handlers need is missing: a rollout ahead of its migration.

        The database answers, so a ping cannot say when to resume; intake pauses for
        a while (doubling on every schema pause in a row, up to 30 s) and tries again.
        """
        if not self._open.is_set():
            return
        now = time.monotonic()
        if now - self._last_schema_pause > 120.0:  # a new episode starts short again
            self._schema_pauses = 0
        self._last_schema_pause = now
        self._schema_pauses += 1
        wait = min(0.5 * 2 ** (self._schema_pauses - 1), 30.0)
        self._pause(exc, first_probe=wait, what="database schema is behind the code")

    def _pause(
        self, exc: BaseException, first_probe: float = 0.1, what: str = "database unavailable"
    ) -> None:
        self.outages += 1
        self._open.clear()
        self._log.warning(f"{what}, pausing intake", error=exc)
        self._probe = asyncio.create_task(
            self._probe_until_available(time.monotonic(), first_probe)
        )

    async def _probe_until_available(self, since: float, delay: float) -> None:
        while True:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(_PING_TIMEOUT):
                    await ping(self._engine)
            except Exception as exc:
                self._log.debug("database probe failed", error=exc, next_probe_s=delay)
                delay = min(max(delay, 0.1) * 2, self._backoff_max)
                continue
            self._open.set()
            self._log.info(
                "database available, resuming", outage_s=round(time.monotonic() - since, 2)
            )
            return

    async def close(self) -> None:
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
