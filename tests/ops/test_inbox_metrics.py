"""Inbox health metrics against databases with known contents (SQLite and PostgreSQL).

The readings come from a few bounded queries in a background task
(:class:`worker.metrics.InboxMonitor`), never from a scrape.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert

from handlers.credit import CreditRequested, apply_credit
from tests.support.database import INBOX
from tests.support.pumps import RunPump
from worker.db import create_engine
from worker.errors import Poison
from worker.metrics import InboxCollector, InboxMonitor, PumpCollector, read_inbox_health
from worker.registry import Context, Registry

RETENTION = timedelta(days=1)


def _ago(**delta: float) -> datetime:
    return datetime.now(UTC) - timedelta(**delta)


def _row(message_id: str, state: str, **values: Any) -> dict[str, Any]:
    row = {"message_id": message_id, "consumer": "credit", "state": state, "lease_until": None}
    row.update(values)
    return row


async def _fill(url: str) -> None:
    """Six rows: four finished or abandoned markers, a live claim and one whose lease ran out."""
    rows = [
        _row("old", "finished", received_at=_ago(hours=26), processed_at=_ago(hours=26)),
        _row("recent", "finished", received_at=_ago(hours=1), processed_at=_ago(hours=1)),
        _row("fresh", "finished", received_at=_ago(minutes=10), processed_at=_ago(minutes=10)),
        _row("given-up", "abandoned", received_at=_ago(minutes=5), processed_at=_ago(minutes=5)),
        _row("live", "claimed", received_at=_ago(minutes=10), processed_at=None,
             lease_until=datetime.now(UTC) + timedelta(minutes=5)),
        _row("stuck", "claimed", received_at=_ago(minutes=30), processed_at=None,
             lease_until=_ago(minutes=20)),
    ]  # fmt: skip
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.begin() as connection:
            await connection.execute(insert(INBOX), rows)
    finally:
        await engine.dispose()


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _near(value: float | None, expected: float, slack: float = 120.0) -> bool:
    return value is not None and abs(value - expected) <= slack


async def test_inbox_health_reads_known_contents(database_url: str) -> None:
    await _fill(database_url)
    engine = create_engine(database_url, pool_size=1)
    try:
        health = await read_inbox_health(engine, RETENTION)
    finally:
        await engine.dispose()
    assert health.markers == 6
    assert _near(health.oldest_finished_age, (RETENTION + timedelta(hours=2)).total_seconds())
    assert _near(health.purge_lag, timedelta(hours=2).total_seconds())  # the purge lags 2 h
    assert health.claims_unfinished == 2
    assert _near(health.oldest_claim_age, timedelta(minutes=30).total_seconds())
    assert health.leases_expired == 1


async def test_an_empty_inbox_reads_zero_and_a_capped_count_stays_bounded(
    database_url: str,
) -> None:
    engine = create_engine(database_url, pool_size=1)
    try:
        empty = await read_inbox_health(engine, RETENTION)
        assert (empty.markers, empty.purge_lag, empty.claims_unfinished) == (0, 0.0, 0)
        assert empty.oldest_finished_age is None and empty.oldest_claim_age is None
        await _fill(database_url)
        capped = await read_inbox_health(engine, RETENTION, cap=4)
        assert capped.markers in (4, 6)  # the cap, or PostgreSQL's estimate once analyzed
    finally:
        await engine.dispose()


async def test_the_monitor_exports_its_last_reading(database_url: str) -> None:
    await _fill(database_url)
    monitor = InboxMonitor(database_url, RETENTION, interval=0.05)
    collector = InboxCollector()
    collector.track(monitor)
    registry = CollectorRegistry()
    registry.register(collector)
    assert ("worker_inbox_markers", ()) not in _samples(registry)  # nothing read yet
    await monitor.start()
    try:
        async with asyncio.timeout(10):
            while monitor.polls["ok"] < 2:  # noqa: ASYNC110 - the monitor's own loop ran twice
                await asyncio.sleep(0.02)
        found = _samples(registry)
    finally:
        await monitor.stop()
    assert ("worker_inbox_markers", ()) not in _samples(registry)  # stopped: nothing stale
    assert found["worker_inbox_markers", ()] == 6
    assert found["worker_inbox_claims_unfinished", ()] == 2
    assert found["worker_inbox_leases_expired", ()] == 1
    assert _near(found["worker_inbox_purge_lag_seconds", ()], 7200)
    assert _near(found["worker_inbox_oldest_claim_age_seconds", ()], 1800)
    assert _near(found["worker_inbox_oldest_finished_age_seconds", ()], 86400 + 7200)
    polled = found["worker_inbox_health_polled_timestamp_seconds", ()]
    assert _near(polled, datetime.now().timestamp())
    assert found["worker_inbox_health_polls_total", (("result", "ok"),)] >= 2


async def test_a_failed_reading_is_counted_and_exports_no_stale_guess(tmp_path: Path) -> None:
    unmigrated = f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"  # no inbox table
    monitor = InboxMonitor(unmigrated, RETENTION)
    collector = InboxCollector()
    collector.track(monitor)
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        assert await monitor.poll() is None
        assert await monitor.poll() is None
    finally:
        await monitor.stop()
    found = _samples(registry)
    assert found["worker_inbox_health_polls_total", (("result", "failed"),)] == 2
    assert ("worker_inbox_markers", ()) not in found


async def test_duplicates_by_path_and_dead_letters_by_reason(run_pump: RunPump) -> None:
    registry = Registry()
    registry.handler("CreditRequested", CreditRequested, consumer="credit")(apply_credit)

    @registry.handler("Audit", CreditRequested, consumer="audit")
    async def audit(ctx: Context, message: CreditRequested) -> None:
        if message.account_id == "poison":
            raise Poison("never valid")
        raise RuntimeError("the audit store is down")

    body = {"account_id": "a", "amount": "1.00"}
    async with run_pump(registry, fast_path=False, max_deliveries=1) as (pump, broker):
        own = CollectorRegistry()
        collector = PumpCollector()
        collector.track(pump)
        own.register(collector)
        broker.publish("m1", "CreditRequested", body)
        async with asyncio.timeout(10):
            while broker.stats["acked"] < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        broker.publish("m1", "CreditRequested", body)  # a redelivery: the constraint says so
        broker.publish("m2", "Audit", {"account_id": "poison", "amount": "1"})
        broker.publish("m3", "Audit", body)  # fails its only allowed delivery: exhausted
        async with asyncio.timeout(10):
            while broker.stats["acked"] < 2 or len(broker.dead_letters) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        found = _samples(own)
    assert found["worker_duplicates_total", (("path", "constraint"),)] == 1
    assert found["worker_duplicates_total", (("path", "fast-path"),)] == 0
    dead = "worker_dead_letters_total"
    assert found[dead, (("consumer", "audit"), ("reason", "poison"))] == 1
    assert found[dead, (("consumer", "audit"), ("reason", "exhausted"))] == 1


async def test_the_ops_endpoint_serves_the_inbox_reading(database_url: str) -> None:
    """``worker run`` starts the monitor with the endpoint; a scrape reads its snapshot."""
    import aiohttp

    from tests.support.processes import free_port
    from worker.ops import start_ops
    from worker.settings import Settings

    await _fill(database_url)

    class Target:
        ready = True

    settings = Settings(database_url=database_url, ops_port=free_port(), ops_host="127.0.0.1")
    server = await start_ops(settings, Target())
    assert server is not None and server.monitor is not None
    try:
        async with asyncio.timeout(10):
            while server.monitor.polls["ok"] < 1:  # noqa: ASYNC110 - its first reading
                await asyncio.sleep(0.02)
        timeout = aiohttp.ClientTimeout(total=5)
        url = f"http://127.0.0.1:{server.port}/metrics"
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
            text = await response.text()
    finally:
        await server.stop()
    assert server.monitor._task is None  # stopped with the endpoint
    found = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert found["worker_inbox_markers", ()] == 6
    assert found["worker_inbox_leases_expired", ()] == 1
