"""A SIGTERM during ``worker run``'s start-up is never lost, even when a library swallows
the cancellation it causes (the pump then stops as soon as its start returns)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.credits import credit_registry
from tests.support.pumps import engine_for
from worker import cli
from worker.brokers.memory import MemoryBroker, MemoryConsumer
from worker.delivery import Delivery
from worker.pump import Pump
from worker.settings import Settings


class SwallowsOneCancel:
    """The memory consumer behind a start that swallows a CancelledError, as a broker
    library's connect can: the cancel that a start-up SIGTERM sends is lost in it."""

    name = "memory"
    destination = "memory"
    watches = False
    writes_in_commit = False

    def __init__(self, inner: MemoryConsumer) -> None:
        self.inner = inner
        self.stats: Counter[str] = inner.stats
        self.starting = asyncio.Event()
        self.swallowed = False

    @property
    def ready(self) -> bool:
        return self.inner.ready

    async def start(self, prefetch: int) -> None:
        self.starting.set()
        try:
            await asyncio.sleep(2.0)
        except asyncio.CancelledError:
            self.swallowed = True  # and carries on connecting
        await self.inner.start(prefetch)

    async def receive(self) -> Delivery:
        return await self.inner.receive()

    async def stop_receiving(self) -> None:
        await self.inner.stop_receiving()

    async def close(self) -> None:
        await self.inner.close()

    async def ack(self, handle: Any) -> None:
        await self.inner.ack(handle)

    async def ack_many(self, handles: Sequence[Any]) -> list[Any]:
        return await self.inner.ack_many(handles)

    async def nack(self, handle: Any, delay: float | None, counted: bool) -> None:
        await self.inner.nack(handle, delay, counted)

    async def dead_letter(self, handle: Any, reason: str) -> None:
        await self.inner.dead_letter(handle, reason)

    def keep_alive(self, handle: Any, seconds: float) -> None:
        self.inner.keep_alive(handle, seconds)

    async def in_commit(self, session: Any, handles: Sequence[Any]) -> None:
        await self.inner.in_commit(session, handles)


async def test_a_signal_while_the_broker_starts_stops_the_pump_even_if_the_cancel_is_lost(
    sqlite_template: Path, tmp_path: Path
) -> None:
    path = tmp_path / "worker.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite+aiosqlite:///{path}"
    broker = SwallowsOneCancel(MemoryBroker().connect())
    loop = asyncio.get_running_loop()
    async with engine_for(url) as engine:
        pump = Pump(broker, engine, credit_registry(), Settings(database_url=url))
        handed: asyncio.Future[cli._Signals] = loop.create_future()

        async def serve() -> None:  # what worker run does once the pump is built
            signals = cli._Signals()
            handed.set_result(signals)
            signals.hand_over(pump)
            await pump.run()

        task = asyncio.create_task(serve())
        try:
            signals = await asyncio.wait_for(handed, 5)
            await asyncio.wait_for(broker.starting.wait(), 5)
            signals._received()  # SIGTERM, as the loop's signal handler calls it
            await asyncio.wait_for(task, 10)  # before the fix: the pump ran on, never stopped
        finally:
            task.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    assert broker.swallowed, "the start did not see the cancel: the test proves nothing"
    assert pump.started.is_set() and not pump.consuming  # started, then stopped gracefully


async def test_a_signal_before_the_hand_over_whose_cancel_was_lost_stops_the_pump_it_meets(
    sqlite_template: Path, tmp_path: Path
) -> None:
    path = tmp_path / "worker.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite+aiosqlite:///{path}"
    loop = asyncio.get_running_loop()
    async with engine_for(url) as engine:
        pump = Pump(MemoryBroker().connect(), engine, credit_registry(), Settings(database_url=url))

        async def serve() -> None:
            signals = cli._Signals()
            signals._received()  # SIGTERM before the pump exists: the start-up is cancelled...
            with contextlib.suppress(asyncio.CancelledError):  # ...and something on the
                await asyncio.sleep(0)  # way swallows that cancel
            signals.hand_over(pump)
            await pump.run()

        task = asyncio.create_task(serve())
        try:
            await asyncio.wait_for(task, 10)  # the pump it meets stops at once
        finally:
            task.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    assert pump.started.is_set() and not pump.consuming
