"""Tracing: a consumer span per delivery in the producer's trace, a child span per transaction."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any

import opentelemetry.propagate
import opentelemetry.trace
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from handlers.credit import CreditRequested, apply_credit
from tests.support.pumps import RunPump
from worker import tracing
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.errors import ConfigurationError
from worker.intake import Item, Work
from worker.registry import Registry
from worker.settings import Settings
from worker.tracing import GETTER, Tracing, Transactions

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def registry() -> Registry:
    registry = Registry()
    registry.handler("CreditRequested", CreditRequested, consumer="traced-credit")(apply_credit)
    return registry


def body() -> dict[str, str]:
    return {"account_id": "acct-t", "amount": "2.50"}


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


async def settle_all(
    run: Any, url: str, provider: TracerProvider, *messages: tuple[Any, ...]
) -> None:
    """Deliver ``messages`` through a pump with tracing attached, as ``cli.assemble`` does."""
    engine = create_engine(url)  # for its dialect: the pump has its own
    traced = Tracing(MemoryBroker().connect(), engine, tracer_provider=provider)
    await engine.dispose()
    async with run(registry(), middleware=[traced], stage_middleware=[traced.stages]) as (
        _,
        broker,
    ):
        for message in messages:
            broker.publish(*message)
        await broker.wait_idle(timeout=10)


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


async def test_a_delivery_continues_the_producers_trace(
    run_pump: RunPump, sqlite_url: str, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    await settle_all(run_pump, sqlite_url, provider, ("t-1", "CreditRequested", body(), headers))

    spans = exporter.get_finished_spans()
    [consumer] = by_name(spans, "process memory")
    [transaction] = by_name(spans, "transaction traced-credit")
    assert consumer.kind is SpanKind.CONSUMER
    assert consumer.context is not None and consumer.parent is not None
    assert f"{consumer.context.trace_id:032x}" == TRACE_ID
    assert f"{consumer.parent.span_id:016x}" == PARENT_ID
    assert consumer.parent.is_remote
    attributes = dict(consumer.attributes or {})
    assert attributes["messaging.system"] == "memory"
    assert attributes["messaging.destination.name"] == "memory"
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.message.id"] == "t-1"
    assert attributes["worker.delivery_count"] == 1
    assert attributes["worker.outcome"] == "committed"
    assert attributes["worker.settlement"] == "ack"

    # the database work is a child of the delivery's span
    assert transaction.parent is not None
    assert transaction.parent.span_id == consumer.context.span_id
    child = dict(transaction.attributes or {})
    assert child["db.system.name"] == "sqlite"
    assert child["worker.consumer"] == "traced-credit"
    assert child["worker.outcome"] == "committed"


async def test_without_a_traceparent_each_delivery_starts_a_trace_and_poison_is_an_error(
    run_pump: RunPump, sqlite_url: str, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    await settle_all(run_pump, sqlite_url, provider, ("t-2", "NoSuchType", body()))

    [consumer] = by_name(exporter.get_finished_spans(), "process memory")
    assert consumer.parent is None
    attributes = dict(consumer.attributes or {})
    assert attributes["worker.outcome"] == "poison"
    assert attributes["worker.settlement"] == "dead-letter"
    assert consumer.status.status_code is StatusCode.ERROR
    assert "no handler" in (consumer.status.description or "")


def test_headers_from_any_broker_carry_the_context() -> None:
    kafka_style = {b"traceparent": TRACEPARENT.encode()}
    assert GETTER.get(kafka_style, "traceparent") == [TRACEPARENT]
    assert GETTER.keys(kafka_style) == ["traceparent"]
    service_bus = {"Diagnostic-Id": TRACEPARENT}  # what the Azure SDKs set
    assert GETTER.get(service_bus, "traceparent") == [TRACEPARENT]
    assert GETTER.get({}, "traceparent") is None
    context = opentelemetry.propagate.extract(kafka_style, getter=GETTER)
    span = opentelemetry.trace.get_current_span(context)
    assert f"{span.get_span_context().trace_id:032x}" == TRACE_ID


async def test_off_means_not_one_opentelemetry_call(
    run_pump: RunPump, monkeypatch: pytest.MonkeyPatch
) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("OpenTelemetry was called with tracing off")

    for name in ("get_tracer", "get_current_span", "get_tracer_provider"):
        monkeypatch.setattr(opentelemetry.trace, name, forbidden)
    monkeypatch.setattr(opentelemetry.propagate, "extract", forbidden)

    async with run_pump(registry()) as (pump, broker):
        assert not any(isinstance(m, Tracing | Transactions) for m in pump.middleware)
        headers = {"traceparent": TRACEPARENT}
        for n in range(20):
            broker.publish(f"off-{n}", "CreditRequested", body(), headers)
        await broker.wait_idle(timeout=10)
        assert pump.outcomes["traced-credit", "committed"] == 20


def test_configure_installs_the_sdk_with_an_otlp_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    installed: list[object] = []
    monkeypatch.setattr(opentelemetry.trace, "set_tracer_provider", installed.append)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "billing-worker")

    assert tracing.configure(Settings(tracing=False)) is None
    assert installed == []

    shutdown = tracing.configure(Settings(tracing=True))
    assert shutdown is not None
    [provider] = installed
    assert isinstance(provider, TracerProvider)
    assert provider.resource.attributes["service.name"] == "billing-worker"
    processors = provider._active_span_processor._span_processors
    assert [type(p) for p in processors] == [BatchSpanProcessor]
    shutdown()


def test_an_unreachable_collector_cannot_hold_up_the_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    installed: list[TracerProvider] = []
    monkeypatch.setattr(opentelemetry.trace, "set_tracer_provider", installed.append)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")  # the exporter retries this long
    monkeypatch.setattr(tracing, "SHUTDOWN_TIMEOUT", 0.2)
    shutdown = tracing.configure(Settings(tracing=True))
    assert shutdown is not None
    with installed[0].get_tracer("test").start_as_current_span("lost"):
        pass
    started = time.monotonic()
    shutdown()
    assert time.monotonic() - started < 1.5
    [flush] = [thread for thread in threading.enumerate() if thread.name == "otel-shutdown"]
    assert flush.is_alive()  # still retrying the collector: the bound is what returned
    flush.join(10)  # let it end inside the test, not in the middle of pytest's summary


def test_configure_without_the_sdk_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ConfigurationError, match=r"idempotent-worker\[otel\]"):
        tracing.configure(Settings(tracing=True))


async def test_a_cancelled_delivery_ends_its_span(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    from worker.brokers.memory import MemoryBroker

    consumer = MemoryBroker().connect()
    traced = Tracing(consumer, tracer_provider=provider)

    class FakeDelivery:
        message_id = "c-1"
        type = "T"
        headers: dict[str, str] = {}
        delivery_count = 2
        group = None
        settled = None

    async def hang(_work: Any) -> list[Any]:
        await asyncio.sleep(30)
        return []

    item = Item(FakeDelivery(), "c-1", (), {}, None, 1, True, True)  # type: ignore[arg-type]
    task = asyncio.create_task(traced(Work([item], ()), hang))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [span] = exporter.get_finished_spans()
    assert dict(span.attributes or {})["worker.delivery_count"] == 2
