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

The inbox's own health (markers, purge lag, claims) costs queries, so it is never
read per scrape: an :class:`InboxMonitor` runs a few bounded queries every
``interval`` seconds in a background task and the scrape reads its last snapshot
(:class:`InboxCollector`). ``worker_inbox_health_polled_timestamp_seconds`` says how
fresh that snapshot is.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

from prometheus_client import REGISTRY, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.concurrency import stats as concurrency_stats
from worker.logs import get_logger
from worker.verdict import Outcome, Verb

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine


# A handler outcome (the pump's verdict for one consumer) -> the ``outcome`` label,
# from the one vocabulary (worker/verdict.py); an unknown outcome keeps its own name.
OUTCOME_LABELS = {outcome.value: outcome.settlement for outcome in Outcome}
SETTLEMENTS = (*(verb.value for verb in Verb), "settlement-lost")
_RETRIED = "retried-"
# pump.stats keys -> the ``path`` label of worker_duplicates
DUPLICATE_PATHS = {"duplicates-fast-path": "fast-path", "duplicates-constraint": "constraint"}
# Outcomes that dead-letter, and outcomes that are recorded and acked (Rejected):
# the ``reason`` label of worker_dead_letters / worker_rejections.
DEAD_LETTER_REASONS = {Outcome.POISON.value: "poison", Outcome.EXHAUSTED.value: "exhausted"}
REJECTION_REASONS = {
    Outcome.PRECONDITION_FAILED.value: "precondition",
    Outcome.DELETED.value: "deleted",
    Outcome.MERGE_CONFLICT.value: "merge-conflict",
    Outcome.REJECTED.value: "rejected",
}

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
INBOX_PARTITIONS = Counter(
    "worker_inbox_partitions",
    "Partitions of a partitioned inbox, by action: created (ahead), dropped (past the "
    "retention), postponed (a step whose locks stayed taken; the next pass retries).",
    ["action"],
)
CLAIMS_SWEPT = Counter(
    "worker_claims_swept",
    "Claims the sweeper acted on, by action (e.g. taken-over, finished, stale).",
    ["action"],
)
SWEEPER_RUNS = Counter("worker_sweeper_runs", "Sweeper passes, by result (ok, failed).", ["result"])

REVISION_VARIABLE = "IDEMPOTENT_WORKER_REVISION"
"""The source revision the image was built from: the Dockerfile sets it from its
``REVISION`` build argument. Not a ``WORKER_*`` name on purpose: it is no setting,
and the unknown-variable check would report it on every start."""


def build_identity() -> tuple[str, str]:
    """(version, revision) of this installation: the package's version, and the image's
    source revision (``unknown`` outside an image that was told it)."""
    from importlib import metadata

    try:
        version = metadata.version("idempotent-worker")
    except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH, not installed
        version = "unknown"
    return version, os.environ.get(REVISION_VARIABLE, "").strip() or "unknown"


BUILD_INFO = Info("worker_build", "The running worker's version and source revision.")
BUILD_INFO.info(dict(zip(("version", "revision"), build_identity(), strict=True)))

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


def inbox_partitions(action: str, count: int) -> None:
    """A rollover pass ``action``-ed ``count`` partitions: created, dropped or postponed."""
    if count > 0:
        INBOX_PARTITIONS.labels(action).inc(count)


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


class _Health(Protocol):
    outages: int

    @property
    def available(self) -> bool: ...


class _Broker(Protocol):
    name: str
    stats: collections.Counter[str]

    @property
    def ready(self) -> bool: ...


class Tallies(Protocol):
    """What the metrics read from a pump: plain tallies and states, nothing else.

    A Protocol, so this module never imports the pump (no cycle, not even for typing).
    """

    stats: collections.Counter[str]
    outcomes: collections.Counter[tuple[str, str]]
    consuming: bool

    @property
    def in_flight(self) -> int: ...

    @property
    def health(self) -> _Health: ...

    @property
    def broker(self) -> _Broker: ...

    @property
    def ready(self) -> bool: ...


class PumpCollector(Collector):
    """Reads every live pump's tallies when Prometheus scrapes.

    Scrapes may come from the ops thread while the pump mutates its counters on
    the event loop: ``dict(counter)`` copies in one C call under the GIL, so a
    scrape sees a consistent snapshot and never "dict changed size" errors.
    """

    def __init__(self) -> None:
        self._pumps: weakref.WeakSet[Tallies] = weakref.WeakSet()

    def track(self, pump: Tallies) -> None:
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
        running = [pump for pump in pumps if pump.consuming]
        brokers: dict[str, float] = {}
        for pump in running:
            name = pump.broker.name
            brokers[name] = min(brokers.get(name, 1.0), float(bool(pump.broker.ready)))
        for name, up in sorted(brokers.items()):
            connected.add_metric([name], up)
        ready.add_metric([], float(bool(running) and all(pump.ready for pump in running)))
        if running:
            database.add_metric([], float(all(pump.health.available for pump in running)))
        yield from _classified(pumps, stats)
        yield _broker_events(pumps)
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


def _broker_events(pumps: list[Tallies]) -> Metric:
    """The adapters' own tallies (``broker.stats``), summed per broker name."""
    family = CounterMetricFamily(
        "worker_broker_events",
        "The broker adapter's own events (reconnects, lost acks, rebalances...).",
        labels=["broker", "event"],
    )
    events: dict[tuple[str, str], int] = {}
    for broker in {id(pump.broker): pump.broker for pump in pumps}.values():
        for event, count in dict(broker.stats).items():
            events[broker.name, event] = events.get((broker.name, event), 0) + count
    for (name, event), count in sorted(events.items()):
        family.add_metric([name, event], count)
    return family


def _classified(pumps: list[Tallies], stats: dict[str, int]) -> Iterator[Metric]:
    """Duplicates by path, dead letters and rejections by reason class."""
    duplicates = CounterMetricFamily(
        "worker_duplicates",
        "Duplicates caught, by path: fast-path (the marker was seen before the handler "
        "ran) or constraint (the inbox's unique constraint rejected the marker).",
        labels=["path"],
    )
    for name, path in DUPLICATE_PATHS.items():
        duplicates.add_metric([path], stats.get(name, 0))
    dead_letters = CounterMetricFamily(
        "worker_dead_letters",
        "Deliveries dead-lettered, per consumer (empty: before any handler ran), by reason class.",
        labels=["consumer", "reason"],
    )
    for (consumer, reason), count in sorted(_by_reason(pumps, DEAD_LETTER_REASONS).items()):
        dead_letters.add_metric([consumer, reason], count)
    rejections = CounterMetricFamily(
        "worker_rejections",
        "Deliveries recorded as rejected and acked, by reason class (precondition = "
        "expected version mismatch, deleted, merge-conflict).",
        labels=["consumer", "reason"],
    )
    for (consumer, reason), count in sorted(_by_reason(pumps, REJECTION_REASONS).items()):
        rejections.add_metric([consumer, reason], count)
    yield from (duplicates, dead_letters, rejections)


def _by_reason(pumps: list[Tallies], classes: dict[str, str]) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for pump in pumps:
        for (consumer, outcome), count in dict(pump.outcomes).items():
            reason = classes.get(outcome)
            if reason is not None:
                counts[consumer, reason] = counts.get((consumer, reason), 0) + count
    return counts


PUMPS = PumpCollector()
REGISTRY.register(PUMPS)


def track(pump: Tallies) -> None:
    """Export this pump's tallies (held weakly: a discarded pump drops out)."""
    PUMPS.track(pump)


# -- inbox health: polled, not scraped ---------------------------------------------------

MARKER_COUNT_CAP = 1_000_000
"""The marker count reads at most this many index entries; beyond, PostgreSQL's estimate."""
INBOX_POLL_INTERVAL = 30.0
_POLL_TIMEOUT = 10.0


# The planner's row estimate, summed over a partitioned inbox's partitions (a partitioned
# parent keeps none of its own; a table never analyzed says -1).
_ESTIMATE = (
    "SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::bigint FROM pg_class c "
    "WHERE c.oid = 'inbox'::regclass "
    "OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'inbox'::regclass)"
)


@dataclass(frozen=True, slots=True)
class InboxHealth:
    """One reading of the inbox; ages in seconds, by the database's clock on PostgreSQL."""

    markers: int
    oldest_finished_age: float | None  # the oldest finished (or abandoned) marker
    purge_lag: float  # how far that marker is past the retention: 0 when the purge keeps up
    claims_unfinished: int
    oldest_claim_age: float | None
    leases_expired: int  # unfinished claims whose lease ran out: a sweeper's work


async def read_inbox_health(
    engine: AsyncEngine, retention: timedelta, *, cap: int = MARKER_COUNT_CAP
) -> InboxHealth:
    """Three bounded queries: a capped count, one index probe, and the (few) claims."""
    from sqlalchemy import DateTime, Table, and_, case, func, literal, select, text

    from worker.inbox import ABANDONED, CLAIMED, FINISHED, InboxMarker

    inbox = cast(Table, InboxMarker.__table__)
    c = inbox.c
    async with engine.connect() as connection, connection.begin():
        postgres = connection.dialect.name == "postgresql"
        if postgres:  # a bound the database enforces too, should the plan go wrong
            await connection.execute(text("SET LOCAL statement_timeout = '5s'"))
            now_expr: Any = func.statement_timestamp()
        else:  # SQLite runs on this host: its clock is ours
            now_expr = literal(datetime.now(UTC), DateTime(timezone=True))
        now = _aware((await connection.execute(select(now_expr))).scalar_one())
        capped = select(literal(1)).select_from(inbox).limit(cap).subquery()
        markers = (await connection.execute(select(func.count()).select_from(capped))).scalar()
        markers = int(markers or 0)
        if postgres and markers >= cap:
            estimate = await connection.execute(text(_ESTIMATE))
            markers = max(markers, int(estimate.scalar() or 0))
        oldest = (
            await connection.execute(
                select(c.processed_at)
                .where(c.state.in_((FINISHED, ABANDONED)), c.processed_at.is_not(None))
                .order_by(c.processed_at)
                .limit(1)
            )
        ).scalar()
        claims = (
            await connection.execute(
                select(
                    func.count(),
                    func.min(c.received_at),
                    func.coalesce(func.sum(case((c.lease_until < now, 1), else_=0)), 0),
                ).where(and_(c.lease_until.is_not(None), c.state == CLAIMED))
            )
        ).one()
    oldest_age = None if oldest is None else (now - _aware(oldest)).total_seconds()
    lag = 0.0 if oldest_age is None else max(0.0, oldest_age - retention.total_seconds())
    claim_age = None if claims[1] is None else (now - _aware(claims[1])).total_seconds()
    return InboxHealth(
        markers=markers,
        oldest_finished_age=oldest_age,
        purge_lag=lag,
        claims_unfinished=int(claims[0] or 0),
        oldest_claim_age=claim_age,
        leases_expired=int(claims[2] or 0),
    )


def _aware(value: datetime) -> datetime:
    """SQLite hands datetimes back naive; they were written in UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


class InboxMonitor:
    """Reads :func:`read_inbox_health` every ``interval`` seconds on an engine of its own.

    Its own single connection keeps the pump's pool untouched; a failed reading is
    counted and logged once (not once per poll), and the last good snapshot stays
    exported, its age visible through the polled-at timestamp.
    """

    def __init__(
        self, database_url: str, retention: timedelta, interval: float = INBOX_POLL_INTERVAL
    ) -> None:
        self.database_url = database_url
        self.retention = retention
        self.interval = interval
        self.latest: InboxHealth | None = None
        self.polled_at: float | None = None  # unix time of the last good reading
        self.polls: dict[str, int] = {"ok": 0, "failed": 0}
        self._engine: AsyncEngine | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._log = get_logger(component="inbox-metrics")
        INBOX.track(self)

    async def start(self) -> None:
        from worker.db import create_engine

        self._engine = create_engine(self.database_url, pool_size=1)
        self._task = asyncio.create_task(self._run(), name="inbox-metrics")

    async def poll(self) -> InboxHealth | None:
        """One reading now (the loop calls this; tests may too)."""
        if self._engine is None:
            from worker.db import create_engine

            self._engine = create_engine(self.database_url, pool_size=1)
        try:
            async with asyncio.timeout(_POLL_TIMEOUT):
                health = await read_inbox_health(self._engine, self.retention)
        except Exception as exc:  # the database may be down: the pump reports that itself
            self.polls["failed"] += 1
            if not self._failing:
                self._log.warning("inbox metrics: reading failed", error=exc)
            self._failing = True
            return None
        if self._failing:
            self._log.info("inbox metrics: reading again")
        self._failing = False
        self.polls["ok"] += 1
        self.latest, self.polled_at = health, time.time()
        return health

    async def _run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        """Stop reading; the last reading is no longer exported (it would only grow stale)."""
        self.latest = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None


class InboxCollector(Collector):
    """Exports the last snapshot of every live :class:`InboxMonitor` (one per process)."""

    def __init__(self) -> None:
        self._monitors: weakref.WeakSet[InboxMonitor] = weakref.WeakSet()

    def track(self, monitor: InboxMonitor) -> None:
        self._monitors.add(monitor)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, documentation: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, documentation)

        families = {
            "markers": gauge("worker_inbox_markers", "Inbox rows (markers and claims)."),
            "oldest": gauge(
                "worker_inbox_oldest_finished_age_seconds",
                "Age of the oldest finished marker (the next the purge deletes).",
            ),
            "lag": gauge(
                "worker_inbox_purge_lag_seconds",
                "How far the oldest finished marker is past the retention; 0: the purge keeps up.",
            ),
            "claims": gauge(
                "worker_inbox_claims_unfinished", "Side-effect claims not finished yet."
            ),
            "claim_age": gauge(
                "worker_inbox_oldest_claim_age_seconds", "Age of the oldest unfinished claim."
            ),
            "expired": gauge(
                "worker_inbox_leases_expired",
                "Unfinished claims whose lease ran out (the sweeper's or a redelivery's work).",
            ),
            "polled": gauge(
                "worker_inbox_health_polled_timestamp_seconds",
                "Unix time of the last good inbox health reading.",
            ),
        }
        polls = CounterMetricFamily(
            "worker_inbox_health_polls", "Inbox health readings, by result.", labels=["result"]
        )
        results = {"ok": 0, "failed": 0}
        for monitor in list(self._monitors):
            for result, count in monitor.polls.items():
                results[result] = results.get(result, 0) + count
            health = monitor.latest
            if health is None or monitor.polled_at is None:
                continue
            families["markers"].add_metric([], health.markers)
            if health.oldest_finished_age is not None:
                families["oldest"].add_metric([], health.oldest_finished_age)
            families["lag"].add_metric([], health.purge_lag)
            families["claims"].add_metric([], health.claims_unfinished)
            families["claim_age"].add_metric([], health.oldest_claim_age or 0.0)
            families["expired"].add_metric([], health.leases_expired)
            families["polled"].add_metric([], monitor.polled_at)
            break  # one monitor per process; a second would read the same database
        for result, count in sorted(results.items()):
            polls.add_metric([result], count)
        yield from families.values()
        yield polls


INBOX = InboxCollector()
REGISTRY.register(INBOX)
