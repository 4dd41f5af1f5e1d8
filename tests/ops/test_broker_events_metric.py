"""The adapter's own tallies (``broker.stats``) reach Prometheus as
``worker_broker_events_total{broker, event}``, read from the live consumer at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from tests.support.pumps import RunPump
from tests.support.waiting import wait_for
from worker.errors import Poison
from worker.metrics import PumpCollector
from worker.pump import Pump
from worker.registry import Context, Registry


class Note(BaseModel):
    text: str


def _registry() -> Registry:
    registry = Registry()

    @registry.handler("Note", Note, consumer="events-note")
    async def note(ctx: Context, message: Note) -> None:
        if message.text == "poison":
            raise Poison("refused")

    return registry


def _events(pump: Pump) -> dict[str, float]:
    collector = PumpCollector()
    collector.track(pump)
    registry = CollectorRegistry()
    registry.register(collector)
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name == "worker_broker_events_total":
                assert sample.labels["broker"] == "memory"
                found[sample.labels["event"]] = sample.value
    return found


async def test_the_consumers_event_tallies_are_exported_per_broker(run_pump: RunPump) -> None:
    async with run_pump(_registry()) as (pump, broker):
        assert _events(pump) == {}  # nothing happened yet: no series
        broker.publish("ev-1", "Note", {"text": "hello"})
        broker.publish("ev-2", "Note", {"text": "hello"})
        broker.publish("ev-3", "Note", {"text": "poison"})
        await wait_for(lambda: broker.stats["acked"] == 2 and broker.dead_letters, 5.0, "settled")
        events = _events(pump)
        assert events["delivered"] == 3
        assert events["acked"] == 2
        assert events["dead_lettered"] == 1
        assert events == {name: float(count) for name, count in pump.broker.stats.items()}
    # the counters are the consumer's: they survive its stop, as Prometheus counters must
    assert _events(pump)["acked"] == 2
