"""Polling with a deadline: every wait in the tests is bounded and says what it waited for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest


async def wait_for(
    predicate: Callable[[], Any], seconds: float, what: str, step: float = 0.05
) -> Any:
    """Poll an (async or plain) predicate until truthy and return its value, or fail."""
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
