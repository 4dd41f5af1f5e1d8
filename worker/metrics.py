"""Prometheus metrics: counted where counting is free, read at scrape time where it is not.

The pump already keeps plain :class:`collections.Counter` tallies (``pump.stats``,
``pump.outcomes``) and an ``in_flight`` integer. :class:`PumpCollector` turns those
into metric families when Prometheus scrapes, so a delivery pays one dict increment
for its counters and no lock; only the handler duration histogram is observed per
handler call.

Retention and the claim sweeper run rarely and count through the functions at the
bottom (:func:`inbox_purged`, :func:`purge_run`, :func:`claims_swept`,
:func:`sweep_run`). Every metric lives in prometheus-client's default registry, so
an application embedding the worker can serve it with its own exporter.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.concurrency import stats as concurrency_stats

if TYPE_CHECKING:
    from worker.pump import Pump

# A handler outcome (the pump's verdict for one consumer) -> the ``outcome`` label.
# Outcomes not listed here (a newer pump's) are exported under their own name.
OUTCOME_LABELS = {
    "committed": "committed",
    "duplicate": "duplicate",
    "poison": "dead-lettered",
    "exhausted": "dead-lettered",
    "failed": "nacked",
    "attempts-exhausted": "nacked",
    "paused": "nacked",
    "retry-requested": "nacked",
    "nacked": "nacked",
}
SETTLEMENTS = ("ack", "nack", "dead-letter", "settlement-lost")
_RETRIED = "retried-"

HANDLER_SECONDS = Histogram(
    "worker_handler_duration_seconds",
    "Time one consumer took for one delivery: inbox, handler, commit and in-process retries.",
    ["consumer"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
INBOX_PURGED = Counter("worker_inbox_purged_rows", "Inbox rows deleted by retention.")
INBOX_PURGE_RUNS = Counter(
    "worker_inbox_purge_runs", "Retention passes, by result (ok, skipped, failed).", ["result"]
)
CLAIMS_SWEPT = Counter(
    "worker_claims_swept",
    "Claims the sweeper acted on, by action (e.g. taken-over, finished, stale).",
    ["action"],
)
SWEEPER_RUNS = Counter("worker_sweeper_runs", "Sweeper passes, by result (ok, failed).", ["result"])

_handler_children: dict[str, Any] = {}


def observe_handler(consumer: str, seconds: float) -> None:
    """Record one consumer's time on one delivery (the child is cached: no label lookup)."""
    child = _handler_children.get(consumer)
    if child is None:
        child = _handler_children[consumer] = HANDLER_SECONDS.labels(consumer)
    child.observe(seconds)


def inbox_purged(rows: int) -> None:
    """Retention deleted ``rows`` inbox rows (call once per batch)."""
    if rows > 0:
        INBOX_PURGED.inc(rows)


def purge_run(result: str) -> None:
    """One retention pass ended: ``ok``, ``skipped`` (another replica purges) or ``failed``."""
    INBOX_PURGE_RUNS.labels(result).inc()


def claims_swept(action: str, count: int = 1) -> None:
    """The sweeper ``action``-ed ``count`` claims (``taken-over``, ``finished``, ``stale``...)."""
    if count > 0:
        CLAIMS_SWEPT.labels(action).inc(count)


def sweep_run(result: str) -> None:
    """One sweeper pass ended: ``ok`` or ``failed``."""
    SWEEPER_RUNS.labels(result).inc()


class PumpCollector(Collector):
    """Reads every live pump's tallies when Prometheus scrapes.

    Scrapes may come from the ops thread while the pump mutates its counters on
    the event loop: ``dict(counter)`` copies in one C call under the GIL, so a
    scrape sees a consistent snapshot and never "dict changed size" errors.
    """

    def __init__(self) -> None:
        self._pumps: weakref.WeakSet[Pump] = weakref.WeakSet()

    def track(self, pump: Pump) -> None:
        self._pumps.add(pump)

    def describe(self) -> Iterable[Metric]:
        return []  # the families below are built per scrape; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        deliveries = CounterMetricFamily(
            "worker_deliveries",
            "Deliveries per consumer, by how that consumer's work ended.",
            labels=["consumer", "outcome"],
        )
        settlements = CounterMetricFamily(
            "worker_settlements", "Settlements sent to the broker, by verb.", labels=["verb"]
        )
        retries = CounterMetricFamily(
            "worker_retries",
            "In-process retries on a fresh session (conflict = version conflict).",
            labels=["reason"],
        )
        outages = CounterMetricFamily("worker_database_outages", "Database outages detected.")
        in_flight = GaugeMetricFamily("worker_in_flight", "Deliveries being processed now.")
        connected = GaugeMetricFamily(
            "worker_broker_connected",
            "1 while the broker is connected and consuming.",
            labels=["broker"],
        )
        database = GaugeMetricFamily(
            "worker_database_available", "1 unless the pump paused for an outage."
        )
        ready = GaugeMetricFamily("worker_ready", "1 while /readyz reports ready.")
        conflicts = CounterMetricFamily(
            "worker_conflict_resolutions",
            "What save() and the guarded bulk writes met: conflicts and how they ended.",
            labels=["event"],
        )
        for event, count in sorted(dict(concurrency_stats).items()):
            conflicts.add_metric([event], count)

        by_outcome: dict[tuple[str, str], int] = {}
        stats: dict[str, int] = {}
        flying = outage_count = 0
        pumps = list(self._pumps)
        for pump in pumps:
            for (consumer, outcome), count in dict(pump.outcomes).items():
                key = (consumer, OUTCOME_LABELS.get(outcome, outcome))
                by_outcome[key] = by_outcome.get(key, 0) + count
            for name, count in dict(pump.stats).items():
                stats[name] = stats.get(name, 0) + count
            flying += pump.in_flight
            outage_count += pump.health.outages
        for (consumer, outcome), count in sorted(by_outcome.items()):
            deliveries.add_metric([consumer, outcome], count)
        for verb in SETTLEMENTS:
            settlements.add_metric([verb], stats.get(verb, 0))
        for name, count in sorted(stats.items()):
            if name.startswith(_RETRIED):
                retries.add_metric([name.removeprefix(_RETRIED)], count)
        outages.add_metric([], outage_count)
        in_flight.add_metric([], flying)

        # Gauges describe the pumps that run now; a stopped pump has no connection to report.
        running = [pump for pump in pumps if pump.running]
        brokers: dict[str, float] = {}
        for pump in running:
            name = pump.broker.name
            brokers[name] = min(brokers.get(name, 1.0), float(bool(pump.broker.ready)))
        for name, up in sorted(brokers.items()):
            connected.add_metric([name], up)
        ready.add_metric([], float(bool(running) and all(pump.ready for pump in running)))
        if running:
            database.add_metric([], float(all(pump.health.available for pump in running)))
        yield from (
            deliveries,
            settlements,
            retries,
            conflicts,
            outages,
            in_flight,
            connected,
            ready,
            database,
        )


PUMPS = PumpCollector()
REGISTRY.register(PUMPS)


def track(pump: Pump) -> None:
    """Export this pump's tallies (held weakly: a discarded pump drops out)."""
    PUMPS.track(pump)
