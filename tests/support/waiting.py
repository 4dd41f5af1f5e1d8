"""Polling with a deadline: every wait in the tests is bounded and says what it waited for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import TypeVar, overload

import pytest

T = TypeVar("T")


@overload
async def wait_for(
    predicate: Callable[[], Coroutine[object, object, T]],
    seconds: float,
    what: str,
    step: float = 0.05,
) -> T: ...


@overload
async def wait_for(
    predicate: Callable[[], T], seconds: float, what: str, step: float = 0.05
) -> T: ...


async def wait_for(
    predicate: Callable[[], object], seconds: float, what: str, step: float = 0.05
) -> object:
    """Poll an (async or plain) predicate every ``step`` seconds until it is truthy and return
    its value, or fail the test after ``seconds`` saying it waited for ``what``.

    The only poller of the suite: state without an event to wait on (a pump's counters,
    rows, a log file) is polled here, never in a hand-written loop."""
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {seconds}s waiting for {what}")
        await asyncio.sleep(step)
