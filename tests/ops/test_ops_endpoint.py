"""The ops endpoint against a running pump: probes, a stalled loop, metrics, and when it is off."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from handlers.credit import CreditRequested, apply_credit
from tests.support.pumps import RunPump
from tests.support.waiting import wait_for
from worker import metrics
from worker.errors import ConfigurationError, Poison
from worker.metrics import PumpCollector
from worker.ops import HEALTHZ, METRICS, READYZ, OpsServer, start_ops
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings


def credit_registry(gate: asyncio.Event | None = None) -> Registry:
    registry = Registry()
    registry.handler("CreditRequested", CreditRequested, consumer="ops-credit")(apply_credit)

    # no inbox: an open SQLite write transaction would block the other handlers
    @registry.handler("Held", CreditRequested, consumer="ops-held", inbox=False)
    async def held(ctx: Context, message: CreditRequested) -> None:
        assert gate is not None
        await gate.wait()

    @registry.handler("Rejected", CreditRequested, consumer="ops-rejected")
    async def rejected(ctx: Context, message: CreditRequested) -> None:
        raise Poison("never valid")

    return registry


def body(account: str = "acct-1", amount: str = "1.00") -> dict[str, str]:
    return {"account_id": account, "amount": amount}


async def get(port: int, path: str, **headers: str) -> tuple[int, str, str]:
    timeout = aiohttp.ClientTimeout(total=5)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"http://127.0.0.1:{port}{path}", headers=headers) as response,
    ):
        return response.status, response.headers["Content-Type"], await response.text()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return found


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def own_registry(pump: Pump) -> CollectorRegistry:
    """Only this pump's tallies: other tests' pumps share the process and its default registry."""
    collector = PumpCollector()
    collector.track(pump)
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def registry_text(registry: CollectorRegistry = REGISTRY) -> str:
    return generate_latest(registry).decode()


async def test_off_unless_a_port_is_set() -> None:
    assert await start_ops(Settings(), object()) is None  # type: ignore[arg-type]


async def test_probes_follow_the_pump(run_pump: RunPump) -> None:
    async with run_pump(credit_registry()) as (pump, _broker):
        server = OpsServer(pump, port=0)
        await server.start()
        try:
            status, content_type, text = await get(server.port, HEALTHZ)
            assert (status, json.loads(text)) == (200, {"alive": True})
            assert content_type.startswith("application/json")
            status, _, text = await get(server.port, READYZ)
            assert status == 200
            assert json.loads(text) == {
                "ready": True,
                "broker": True,
                "database": True,
                "running": True,
            }

            pump.stop()  # what SIGTERM does: readiness drops at once
            status, _, text = await get(server.port, READYZ)
            assert status == 503
            assert json.loads(text)["ready"] is False
            status, _, _ = await get(server.port, HEALTHZ)
            assert status == 200  # shutting down is not dead
        finally:
            await server.stop()


async def test_not_ready_while_the_database_is_down(run_pump: RunPump) -> None:
    async with run_pump(credit_registry()) as (pump, _broker):
        server = OpsServer(pump, port=0)
        await server.start()
        try:
            pump.health.gate.clear()  # what a detected outage does
            status, _, text = await get(server.port, READYZ)
            assert status == 503
            assert json.loads(text)["database"] is False
            pump.health.gate.set()
            assert (await get(server.port, READYZ))[0] == 200
        finally:
            await server.stop()


async def test_a_stalled_event_loop_fails_liveness_from_the_ops_thread(run_pump: RunPump) -> None:
    async with run_pump(credit_registry()) as (pump, _broker):
        server = OpsServer(pump, port=0, stall_timeout=0.3)
        await server.start()
        try:
            answers: list[tuple[int, str]] = []

            def probe() -> None:
                time.sleep(0.8)  # the loop below is stuck all along: past the stall timeout
                url = f"http://127.0.0.1:{server.port}{HEALTHZ}"
                try:
                    with urllib.request.urlopen(url, timeout=5) as response:
                        answers.append((response.status, response.read().decode()))
                except urllib.error.HTTPError as exc:
                    answers.append((exc.code, exc.read().decode()))

            prober = threading.Thread(target=probe)
            prober.start()
            # the point: blocking code stops the whole loop, here until the probe has its
            # answer (a fixed 1.5 s block let a probe delayed by a busy machine arrive late)
            prober.join(10)
            assert len(answers) == 1
            status, text = answers[0]
            assert status == 503
            assert "event loop stalled" in json.loads(text)["reason"]

            async with asyncio.timeout(5):  # the loop turns again: alive again
                while (await get(server.port, HEALTHZ))[0] != 200:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        finally:
            await server.stop()


async def test_metrics_count_outcomes_per_consumer_and_read_the_pump(run_pump: RunPump) -> None:
    gate = asyncio.Event()
    histogram = "worker_handler_duration_seconds_count"
    timed_before = REGISTRY.get_sample_value(histogram, {"consumer": "ops-credit"}) or 0.0
    async with run_pump(credit_registry(gate)) as (pump, broker):
        registry = own_registry(pump)
        server = OpsServer(pump, port=0, registry=registry)
        await server.start()
        try:
            broker.publish("ops-m1", "CreditRequested", body())
            broker.publish("ops-m2", "CreditRequested", body(), copies=2)  # a producer retry
            broker.publish("ops-m3", "Rejected", body())
            broker.publish("ops-m4", "Unknown", body())
            await wait_for(
                lambda: broker.stats["acked"] == 3 and len(broker.dead_letters) == 2,
                5.0,
                "three acks and two dead letters",
                step=0.01,
            )
            broker.publish("ops-m5", "Held", body())
            await wait_for(lambda: pump.in_flight == 1, 5.0, "one handler in flight", step=0.01)

            status, content_type, text = await get(server.port, METRICS)
            assert status == 200
            assert content_type.startswith("text/plain")
            deliveries = "worker_deliveries_total"
            assert value(text, deliveries, consumer="ops-credit", outcome="committed") == 2
            assert value(text, deliveries, consumer="ops-credit", outcome="duplicate") == 1
            assert value(text, deliveries, consumer="ops-rejected", outcome="dead-lettered") == 1
            assert value(text, "worker_settlements_total", verb="dead-letter") == 2
            assert value(text, "worker_settlements_total", verb="ack") == 3
            assert value(text, "worker_in_flight") == 1
            assert value(text, "worker_broker_connected", broker="memory") == 1
            assert value(text, "worker_ready") == 1
            assert value(text, "worker_database_available") == 1
            timed = REGISTRY.get_sample_value(histogram, {"consumer": "ops-credit"}) or 0.0
            assert timed - timed_before == 3  # one observation per consumer per delivery

            gate.set()
            await wait_for(
                lambda: pump.in_flight == 0 and broker.idle, 5.0, "the pump idle", step=0.01
            )
            text = (await get(server.port, METRICS))[2]
            assert value(text, "worker_in_flight") == 0
            assert value(text, deliveries, consumer="ops-held", outcome="committed") == 1
        finally:
            await server.stop()
    # a stopped pump is not ready and reports no broker connection
    text = registry_text(registry)
    assert value(text, "worker_ready") == 0
    assert value(text, "worker_broker_connected", broker="memory") is None
    assert value(text, "worker_settlements_total", verb="ack") == 4  # counters survive the stop


async def test_retention_and_sweeper_counters_are_exported(run_pump: RunPump) -> None:
    before = samples(registry_text())
    metrics.inbox_purged(250)
    metrics.inbox_purged(0)
    metrics.purge_run("ok")
    metrics.claims_swept("taken-over", 2)
    metrics.sweep_run("ok")
    after = samples(registry_text())

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("worker_inbox_purged_rows_total") == 250
    assert grew("worker_inbox_purge_runs_total", result="ok") == 1
    assert grew("worker_claims_swept_total", action="taken-over") == 2
    assert grew("worker_sweeper_runs_total", result="ok") == 1


async def test_conflict_resolutions_are_exported(run_pump: RunPump) -> None:
    from worker.concurrency import stats

    before = samples(registry_text())
    stats["resolved-merge"] += 3
    after = samples(registry_text())
    key = ("worker_conflict_resolutions_total", (("event", "resolved-merge"),))
    assert after[key] - before.get(key, 0.0) == 3


async def test_openmetrics_when_the_scraper_asks_for_it(run_pump: RunPump) -> None:
    async with run_pump(credit_registry()) as (pump, _broker):
        server = OpsServer(pump, port=0)
        await server.start()
        try:
            accept = "application/openmetrics-text; version=1.0.0"
            status, content_type, text = await get(server.port, METRICS, Accept=accept)
            assert status == 200
            assert content_type.startswith("application/openmetrics-text")
            assert text.rstrip().endswith("# EOF")
        finally:
            await server.stop()


async def test_a_taken_port_is_a_configuration_error(run_pump: RunPump) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with run_pump(credit_registry()) as (pump, _broker):
            settings = Settings(ops_port=port, ops_host="127.0.0.1")
            with pytest.raises(ConfigurationError, match=f"WORKER_OPS_PORT={port}"):
                await start_ops(settings, pump)
