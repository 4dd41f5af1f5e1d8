"""Middleware: what sees every unit of work, attached where the process is assembled.

Two chains, both ``(thing, call_next)``, composed the way procrastinate composes its
middleware: a :class:`WorkMiddleware` wraps one unit of work from the moment a worker
takes it to the moment its runners are done (tracing opens the delivery's span here);
a :class:`StageMiddleware` wraps one handler's runner over it (timing, the
transaction's span). The pump knows neither what they are nor whether there are any.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from worker import metrics

if TYPE_CHECKING:
    from worker.intake import Work
    from worker.transaction import Stage
    from worker.verdict import Verdict

T = TypeVar("T")
R = TypeVar("R")

NextWork = Callable[["Work"], Awaitable[list["Verdict"]]]
NextStage = Callable[["Stage"], Awaitable[list["Verdict"]]]


class WorkMiddleware(Protocol):
    async def __call__(self, work: Work, call_next: NextWork) -> list[Verdict]: ...


class StageMiddleware(Protocol):
    async def __call__(self, stage: Stage, call_next: NextStage) -> list[Verdict]: ...


def compose(
    middlewares: Sequence[Callable[[T, Callable[[T], Awaitable[R]]], Awaitable[R]]],
    inner: Callable[[T], Awaitable[R]],
) -> Callable[[T], Awaitable[R]]:
    """``inner`` wrapped by each middleware, the first outermost."""
    wrapped = inner
    for middleware in reversed(middlewares):
        wrapped = _bind(middleware, wrapped)
    return wrapped


def _bind(
    middleware: Callable[[T, Callable[[T], Awaitable[R]]], Awaitable[R]],
    call_next: Callable[[T], Awaitable[R]],
) -> Callable[[T], Awaitable[R]]:
    async def call(thing: T) -> R:
        return await middleware(thing, call_next)

    return call


class Timing:
    """``worker_handler_duration_seconds{consumer}``: one observation per delivery a
    handler's runner took (a batch's time shared out among its deliveries)."""

    async def __call__(self, stage: Stage, call_next: NextStage) -> list[Verdict]:
        started = time.perf_counter()
        try:
            return await call_next(stage)
        finally:
            items = len(stage.items)
            share = (time.perf_counter() - started) / max(items, 1)
            for _ in range(items):
                metrics.observe_handler(stage.handler.consumer, share)
