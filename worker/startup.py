"""A start that survives a blip: the database and the broker are retried with jittered
backoff until ``WORKER_START_TIMEOUT``, and only configuration that cannot work fails at once.

A cluster restarts an exiting pod with growing delays (up to five minutes), and after a
broker partition the whole fleet would restart at once: a worker that starts during a
transient fault waits for it instead, alive (``/healthz``) and not ready (``/readyz``),
logging one line per failed try with the reason.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.exc import ArgumentError, DBAPIError

from worker.db import sqlstate
from worker.errors import BrokerUnavailable, ConfigurationError

_FIRST_DELAY = 0.5
_MAX_DELAY = 15.0


def reason(exc: BaseException) -> str:
    """An error's one-line reason, never empty: its type when its text says nothing."""
    text = " ".join(str(exc).split())
    cause = exc.__cause__ or exc.__context__
    if not text and cause is not None and cause is not exc:
        return f"{type(exc).__name__}: {reason(cause)}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def database_refuses(exc: BaseException) -> bool:
    """What no retry fixes: a refused login (28xxx), a missing database (3D000), a URL
    that cannot be used (a non-numeric port, an unknown driver)."""
    if isinstance(exc, ArgumentError | ValueError):
        return True
    code = sqlstate(exc) if isinstance(exc, DBAPIError) else getattr(exc, "sqlstate", None)
    return isinstance(code, str) and (code.startswith("28") or code == "3D000")


async def until_up(
    what: str,
    start: Callable[[], Awaitable[None]],
    *,
    within: float | None,
    log: Any,
    fatal: Callable[[BaseException], bool] = lambda exc: isinstance(exc, ConfigurationError),
    transient: tuple[type[BaseException], ...] = (Exception,),
) -> None:
    """Await ``start()`` until it succeeds; retry a transient failure until ``within``
    seconds have passed (None: no retry), then raise the last failure."""
    deadline = None if within is None else time.monotonic() + within
    attempt = 0
    while True:
        attempt += 1
        try:
            await start()
            if attempt > 1:
                log.info(f"{what} available, starting", attempts=attempt)
            return
        except transient as exc:
            if fatal(exc) or deadline is None:
                raise
            delay = random.uniform(0.5, 1.0) * min(_MAX_DELAY, _FIRST_DELAY * 2 ** (attempt - 1))
            if time.monotonic() + delay > deadline:
                log.error(
                    f"{what} unavailable at start, giving up",
                    attempt=attempt,
                    reason=reason(exc),
                    start_timeout_s=within,
                )
                raise
            log.warning(
                f"{what} unavailable at start, retrying",
                attempt=attempt,
                reason=reason(exc),
                retry_in_s=round(delay, 2),
            )
            await asyncio.sleep(delay)


async def broker_up(start: Callable[[], Awaitable[None]], within: float | None, log: Any) -> None:
    """The broker's start: ``BrokerUnavailable`` is retried, anything else is not."""
    await until_up("broker", start, within=within, log=log, transient=(BrokerUnavailable,))
