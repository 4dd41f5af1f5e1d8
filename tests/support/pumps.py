"""In-process pumps for tests: consuming inside an ``async with``, stopped gracefully after.

The suite's only pump runner, built on :meth:`worker.pump.Pump.running` (the embedder's
way to run one): a start that fails raises at the ``async with``, and the graceful stop
(in-flight work settled within the grace period, the broker closed) happens on the way
out, whatever the block raised. The stop is not bounded here: the test's own timeout
(pytest-timeout) bounds a stop that hangs, as it bounded the hand-written loops before.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.brokers import Broker
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.middleware import StageMiddleware, WorkMiddleware
from worker.pump import Pump
from worker.registry import Registry
from worker.settings import Settings

START_WITHIN = 30.0
"""Seconds a pump may take to start consuming (a Kafka group join under load included)."""

RunPumps = Callable[
    [Sequence[Broker], Sequence[AsyncEngine], Registry, Settings],
    AbstractAsyncContextManager[list[Pump]],
]
"""The ``run_pumps`` fixture (tests/conftest.py): :func:`pumps_on`."""

RunPump = Callable[..., AbstractAsyncContextManager[tuple[Pump, MemoryBroker]]]
"""The ``run_pump`` fixture (tests/ops/conftest.py): ``run_pump(registry, **settings)``, one
pump on a memory broker and a SQLite file of the test's own."""

MakeSettings = Callable[..., Settings]
"""The ``make_settings`` fixture (tests/conftest.py): ``make_settings(**overrides)``."""


@contextlib.asynccontextmanager
async def running_pump(
    broker: Broker,
    engine: AsyncEngine,
    registry: Registry,
    settings: Settings,
    *,
    name: str = "pump",
    start_within: float = START_WITHIN,
    middleware: Sequence[WorkMiddleware] = (),
    stage_middleware: Sequence[StageMiddleware] = (),
) -> AsyncIterator[Pump]:
    """``async with running_pump(broker, engine, registry, settings) as pump:`` one pump,
    consuming inside the block."""
    pump = Pump(
        broker,
        engine,
        registry,
        settings,
        name=name,
        middleware=middleware,
        stage_middleware=stage_middleware,
    )
    async with pump.running(start_within) as running:
        yield running


@contextlib.asynccontextmanager
async def running_pumps(
    pumps: Sequence[Pump], start_within: float = START_WITHIN
) -> AsyncIterator[list[Pump]]:
    """Several pumps, all consuming inside the block and told to stop together on the way
    out (as pods stopped at once), each then awaited until it settled its work."""
    async with contextlib.AsyncExitStack() as stack:
        for pump in pumps:
            await stack.enter_async_context(pump.running(start_within))
        try:
            yield list(pumps)
        finally:
            for pump in pumps:
                pump.stop()  # all at once: none takes over what another gives back


def pumps_on(
    brokers: Sequence[Broker],
    engines: Sequence[AsyncEngine],
    registry: Registry,
    settings: Settings,
) -> AbstractAsyncContextManager[list[Pump]]:
    """One pump per broker connection, the engines shared round-robin, named ``pump-<n>``."""
    return running_pumps(
        [
            Pump(broker, engines[n % len(engines)], registry, settings, name=f"pump-{n}")
            for n, broker in enumerate(brokers)
        ]
    )


@contextlib.asynccontextmanager
async def engine_for(url: str, pool_size: int | None = None) -> AsyncIterator[AsyncEngine]:
    """An engine of the test's own (``create_engine``'s pool unless ``pool_size``), disposed
    on the way out (after the pumps using it)."""
    engine = create_engine(url) if pool_size is None else create_engine(url, pool_size=pool_size)
    try:
        yield engine
    finally:
        await engine.dispose()


LEARNED = "learned"
"""The account of :func:`learned`'s credit: a balance of 0 that tests expect beside theirs."""


async def learned(broker: MemoryBroker, message_type: str = "Credit") -> None:
    """One credit of 0 to the account ``learned`` through the running pump(s), and wait
    for it: a type's first unit of work runs alone, before anything says how long its
    deliveries take (worker/intake.py, _GROUP_TIME), so a test that expects the next
    deliveries of the type to share a group teaches the pump that first."""
    body = b'{"account_id": "%s", "amount": "0.00"}' % LEARNED.encode()
    broker.publish(f"learn-{message_type}", message_type, body)
    await broker.wait_idle(10)
