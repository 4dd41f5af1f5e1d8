"""Optional features are wired where the process is assembled (``worker.cli.assemble``), not
in the pump; ``async with pump.running():`` is the embedder's way to run one."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.credits import credit_registry
from tests.support.pumps import MakeSettings
from worker.brokers.memory import MemoryBroker
from worker.cli import assemble
from worker.errors import BrokerUnavailable
from worker.metrics import PUMPS
from worker.middleware import Timing
from worker.pump import Pump
from worker.tracing import Tracing


def tracked(pump: Pump) -> bool:
    return pump in set(PUMPS._pumps)


async def test_a_bare_pump_has_no_tracing_and_exports_nothing(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    pump = Pump(MemoryBroker().connect(), engine, credit_registry(), make_settings(tracing=True))
    assert pump.middleware == ()  # the pump does not read WORKER_TRACING: no middleware at all
    assert not tracked(pump)  # nor register itself in the process-wide collector


async def test_assemble_wires_tracing_and_the_metrics_export(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    broker = MemoryBroker().connect()
    traced = assemble(make_settings(tracing=True), broker, engine, credit_registry())
    kinds = [type(middleware) for middleware in traced.middleware]
    assert Tracing in kinds and Timing in kinds and tracked(traced)
    plain = assemble(make_settings(), broker, engine, credit_registry())
    assert [type(middleware) for middleware in plain.middleware] == [Timing] and tracked(plain)


async def test_running_consumes_inside_the_block_and_stops_on_the_way_out(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    broker = MemoryBroker()
    pump = Pump(broker.connect(), engine, credit_registry(), make_settings())
    async with pump.running() as running:
        assert running is pump and pump.consuming and pump.ready
        broker.publish("m-1", "CreditRequested", {"account_id": "a", "amount": "1"})
        await broker.wait_idle(timeout=10)
    assert not pump.consuming
    assert [verb for verb, _, _ in broker.history] == ["ack"]


async def test_running_raises_a_failed_start(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    consumer = MemoryBroker().connect()

    async def refuse(prefetch: int) -> None:
        raise BrokerUnavailable("no broker here")

    consumer.start = refuse  # type: ignore[method-assign]
    pump = Pump(consumer, engine, credit_registry(), make_settings())
    with pytest.raises(BrokerUnavailable, match="no broker here"):
        async with pump.running():
            pytest.fail("the block must not run")
