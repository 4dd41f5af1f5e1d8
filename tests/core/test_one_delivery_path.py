"""The path of one delivery, measured at run time: the worker's modules it enters and the
Python calls it makes inside them, from the publish to the ack.

Every call on that path is CPU a pod pays per message, and every module a place a reader
must visit to follow it. The bounds are the ones the lean-path issue set (8 modules, 80
calls; the round before it entered 18 and made 185). A call is what ``sys.setprofile``
reports as one: a function entered, or a coroutine resumed after it waited.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import Hashable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import text

from tests.support.migrations import migrate_with_the_example
from worker.brokers.memory import MemoryBroker
from worker.context import Context
from worker.db import create_engine
from worker.pump import Pump
from worker.registry import Registry
from worker.settings import Settings

MODULES = 8
CALLS = 80


class Note(BaseModel):
    text: str


async def _trace(url: str, keyed: bool) -> Counter[tuple[str, str]]:
    engine = create_engine(url)
    async with engine.begin() as connection:
        await connection.execute(text("CREATE TABLE notes (id TEXT PRIMARY KEY, text TEXT)"))
    registry = Registry()

    async def note(ctx: Context, message: Note) -> None:
        statement = text("INSERT INTO notes VALUES (:i, :t)")
        await ctx.session.execute(statement, {"i": ctx.message_id, "t": message.text})

    def key(message: Note) -> Hashable:
        return message.text

    registry.handler("Note", Note, consumer="note", key=key if keyed else None)(note)
    broker = MemoryBroker()
    settings = Settings(database_url=url, concurrency=4, purge_interval=0)
    calls: Counter[tuple[str, str]] = Counter()

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("worker"):
                calls[module, frame.f_code.co_name] += 1

    try:
        async with Pump(broker.connect(), engine, registry, settings).running():
            broker.publish("warm", "Note", b'{"text": "a"}')  # statements compiled, pool filled
            await broker.wait_idle(10)
            for _ in range(5):
                await asyncio.sleep(0)
            sys.setprofile(profile)
            try:
                broker.publish("m-1", "Note", b'{"text": "b"}')
                async with asyncio.timeout(10):
                    while broker.stats["acked"] < 2:  # noqa: ASYNC110 - no worker frame in the wait
                        await asyncio.sleep(0)
                for _ in range(5):  # the worker back at intake.next
                    await asyncio.sleep(0)
            finally:
                sys.setprofile(None)
    finally:
        await engine.dispose()
    return calls


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
async def test_one_first_delivery_enters_few_modules_and_makes_few_calls(
    tmp_path: Path, keyed: bool
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'path.db'}"
    await asyncio.to_thread(migrate_with_the_example, url)
    calls = await _trace(url, keyed)
    modules = Counter[str]()
    for (module, _), count in calls.items():
        modules[module] += count
    table = "\n".join(f"{count:4d} {module}.{name}" for (module, name), count in calls.items())
    assert "worker.pump" in modules and "worker.transaction" in modules  # it saw the path
    assert len(modules) <= MODULES, f"{sorted(modules)}\n{table}"
    assert sum(calls.values()) <= CALLS, table


def test_the_bound_can_fail() -> None:
    """The profile counts what it should: a call into a worker module is seen."""
    from worker.retry import backoff

    calls: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_globals.get("__name__", "").startswith("worker"):
            calls[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        backoff(1, 0.1, 1.0)
    finally:
        sys.setprofile(None)
    assert calls == {"backoff": 1}
