"""The pumps of one schedule, each a process of its own: started, killed, restarted.

A pump is a :class:`~worker.pump.Pump` on its own :class:`RecordingConsumer`, its own
engine and its own registry, run with ``pump.running()``. A death is what a killed pod
does to the broker: its consumer vanishes and the broker offers everything it held
unsettled again (``MemoryConsumer.crash``); and to the database: its connections vanish
(tests/explorer/faults.py ``Paths.sever``), so its transactions and locks go at once. A
new pump, on a new consumer, engine and registry, takes its slot at once, while the dead
one is stopped in the background (its late settlements lost, as a dead process's are).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from tests.explorer.faults import Paths
from tests.explorer.recording import Journal, RecordingConsumer
from tests.explorer.workload import Plans, registry
from worker.brokers.memory import MemoryBroker
from worker.pump import Pump
from worker.registry import Registry
from worker.settings import Settings

START_WITHIN = 15.0
STOP_WITHIN = 15.0


@dataclass(eq=False)
class Member:
    slot: int
    label: str
    consumer: RecordingConsumer
    engine: AsyncEngine
    registry: Registry
    pump: Pump
    stack: contextlib.AsyncExitStack

    def given(self) -> list[object]:
        """What the pump was handed and does not own (left out of its footprint)."""
        handlers = [h for t in self.registry.message_types for h in self.registry.for_type(t)]
        return [
            self.consumer,
            self.consumer.broker,
            self.engine,
            self.registry,
            *handlers,  # the registry's, even where the pump keeps them in a table of its own
            self.pump.settings,
        ]


class ProcessDied(Exception):
    """Raised in a handler whose process the schedule kills: nothing after it reaches the
    broker (the consumer is gone), and the pump is stopped."""


class Fleet:
    def __init__(
        self,
        broker: MemoryBroker,
        journal: Journal,
        plans: Plans,
        settings: Settings,
        paths: Paths,
        audit: bool,
    ) -> None:
        self.broker = broker
        self.journal = journal
        self.plans = plans
        self.settings = settings
        self.paths = paths
        self.audit = audit
        self.members: dict[int, Member] = {}
        self.dead: list[Member] = []  # stopped after their death: their stats still count
        self.problems: list[str] = []
        self._generation = 0
        self._deaths: set[asyncio.Task[None]] = set()

    async def start(self, slot: int) -> Member:
        self._generation += 1
        label = f"p{slot}.{self._generation}"
        consumer = RecordingConsumer(self.broker, label, self.journal)
        self.broker.consumers.append(consumer)
        engine = await self.paths.open()

        async def die() -> None:
            self.kill(slot)
            # what the handler had written dies with it: its transaction rolls back now (a
            # killed process's locks go at once), and whatever its pump still settles is lost
            raise ProcessDied(label)

        handlers = registry(self.plans, label, die, self.audit)
        pump = Pump(consumer, engine, handlers, self.settings, name=label)
        stack = contextlib.AsyncExitStack()
        stack.push_async_callback(engine.dispose)
        await stack.enter_async_context(pump.running(START_WITHIN))
        member = Member(slot, label, consumer, engine, handlers, pump, stack)
        self.members[slot] = member
        return member

    def kill(self, slot: int) -> None:
        """The pump in ``slot`` dies now; a new one takes the slot, the old one is stopped
        (bounded) in the background."""
        member = self.members.get(slot)
        if member is None or member.consumer.dead:
            return
        self.journal.deaths += 1
        member.consumer.die()
        self.paths.sever(member.engine)
        # a fresh context: the new process inherits nothing of the dying handler's (the
        # worker's "a handler is running" mark would refuse every commit of the new pump)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._replace(member), context=contextvars.Context())
        self._deaths.add(task)
        task.add_done_callback(self._deaths.discard)

    async def _replace(self, member: Member) -> None:
        # a new process starts on its own, while the dead one is being cleaned away
        self.dead.append(member)
        member.pump.stop()
        await asyncio.gather(self._stop(member), self.start(member.slot))

    async def settled(self) -> None:
        """Wait for deaths under way to be replaced."""
        while self._deaths:
            await asyncio.gather(*self._deaths, return_exceptions=True)

    async def _stop(self, member: Member) -> None:
        try:
            async with asyncio.timeout(STOP_WITHIN):
                await member.stack.aclose()
        except TimeoutError:
            self.problems.append(f"pump {member.label} did not stop within {STOP_WITHIN}s")
        except Exception as exc:
            self.problems.append(f"pump {member.label} failed: {type(exc).__name__}: {exc}")

    async def stop(self) -> None:
        """Every pump, told to stop at once (pods stopped together), each bounded."""
        await self.settled()
        members = list(self.members.values())
        for member in members:
            member.pump.stop()
        await asyncio.gather(*(self._stop(member) for member in members))

    def all(self) -> list[Member]:
        return [*self.dead, *self.members.values()]
