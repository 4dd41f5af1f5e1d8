"""The one way every runner calls a handler: under its timeout, watched for swallowed
statement errors, with the pump owning the transaction meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from worker.db import HANDLER_RUNNING, HandlerRun
from worker.errors import HandlerTimeout


async def call_handler(call: Awaitable[None], limit: float | None, what: str = "handler") -> None:
    """Await ``call`` (a handler's coroutine) inside the worker's transaction.

    Any commit the handler attempts meanwhile is refused (:data:`HANDLER_RUNNING`); a
    statement that failed and that the handler caught without a savepoint is raised
    afterwards as :class:`~worker.errors.StatementSwallowed`; past ``limit`` seconds
    the call is cancelled and :class:`~worker.errors.HandlerTimeout` raised (a handler's
    own ``TimeoutError`` stays its own).
    """
    run = HandlerRun()
    running = HANDLER_RUNNING.set(run)
    cut = asyncio.timeout(limit)
    try:
        async with cut:
            await call
    except TimeoutError as exc:
        if not cut.expired():
            raise
        raise HandlerTimeout(f"{what} ran longer than WORKER_HANDLER_TIMEOUT={limit}s") from exc
    finally:
        HANDLER_RUNNING.reset(running)
    run.refuse_swallowed()
