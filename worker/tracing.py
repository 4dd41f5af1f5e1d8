"""OpenTelemetry tracing: a consumer span per delivery, a child span per consumer's transaction.

Off by default. With ``WORKER_TRACING=false`` no :class:`Tracing` middleware is
attached (``worker.cli.assemble``) and nothing calls into OpenTelemetry.
With ``WORKER_TRACING=true``:

- the W3C context (``traceparent``/``tracestate``) is extracted from the delivery's
  headers, whatever the broker (AMQP headers, Kafka record headers, Service Bus
  application properties; bytes keys and values are decoded, and Service Bus'
  ``Diagnostic-Id`` stands in for a missing ``traceparent``);
- each delivery gets a ``CONSUMER`` span named ``process <destination>`` with the
  messaging semantic-convention attributes and, once settled, ``worker.outcome``
  (the verdict: committed, duplicate, poison...) and ``worker.settlement``;
- each consumer's transaction (inbox marker, handler, commit, in-process retries)
  is a child span ``transaction <consumer>`` carrying ``db.system.name``.

``worker run`` installs the SDK with an OTLP/HTTP exporter (:func:`configure`),
configured by the standard ``OTEL_*`` variables; the SDK and the exporter are the
optional ``otel`` extra. An application embedding the pump may install its own
tracer provider instead: the spans go wherever the global provider sends them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from worker.errors import ConfigurationError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from worker.brokers import Broker
    from worker.delivery import Delivery
    from worker.intake import Work
    from worker.middleware import NextStage, NextWork
    from worker.settings import Settings
    from worker.transaction import Stage
    from worker.verdict import Verdict

# Adapter name -> the semantic conventions' ``messaging.system`` value.
MESSAGING_SYSTEMS = {"rabbitmq": "rabbitmq", "kafka": "kafka", "servicebus": "servicebus"}
_FAILED_SETTLEMENTS = frozenset({"dead-letter"})
SHUTDOWN_TIMEOUT = 3.0  # seconds the last spans get to reach the collector at exit


class HeaderGetter(Getter[Mapping[Any, Any]]):
    """Reads propagation fields from any adapter's headers mapping."""

    def get(self, carrier: Mapping[Any, Any], key: str) -> list[str] | None:
        value = _lookup(carrier, key)
        if value is None and key == "traceparent":
            value = _lookup(carrier, "Diagnostic-Id")  # what the Azure SDKs send
        if value is None:
            return None
        if isinstance(value, bytes | bytearray):
            return [bytes(value).decode("utf-8", "replace")]
        return [str(value)]

    def keys(self, carrier: Mapping[Any, Any]) -> list[str]:
        return [k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k) for k in carrier]


def _lookup(carrier: Mapping[Any, Any], key: str) -> Any:
    value = carrier.get(key)
    if value is None:
        value = carrier.get(key.encode())
    return value


GETTER = HeaderGetter()


class Tracing:
    """Spans for one pump, as middleware; built only when tracing is on.

    The object is the work middleware (a ``CONSUMER`` span per delivery; a batch's
    span links every delivery's context); :attr:`stages` is the stage middleware (a
    ``transaction <consumer>`` child span per handler's runner).
    """

    def __init__(
        self,
        broker: Broker,
        engine: AsyncEngine | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self._tracer = trace.get_tracer("worker", tracer_provider=tracer_provider)
        self._system = MESSAGING_SYSTEMS.get(broker.name, broker.name)
        self._destination = broker.destination
        self._db_system = engine.dialect.name if engine is not None else None
        self._name = f"process {self._destination}"
        self.stages = Transactions(self)

    async def __call__(self, work: Work, call_next: NextWork) -> list[Verdict]:
        """Run the unit of work inside its consumer span."""
        if len(work.items) == 1:
            delivery = work.items[0].delivery
            parent = propagate.extract(delivery.headers, getter=GETTER)
            links: list[Link] = []
            attributes = self._attributes(delivery)
        else:
            parent = None
            links = [_link(item.delivery.headers) for item in work.items]
            attributes = self._common()
            attributes["messaging.batch.message_count"] = len(work.items)
        with self._tracer.start_as_current_span(
            self._name, context=parent, kind=SpanKind.CONSUMER, attributes=attributes, links=links
        ) as span:
            verdicts = await call_next(work)
            _record(span, verdicts)
            return verdicts

    def _common(self) -> dict[str, Any]:
        return {
            "messaging.system": self._system,
            "messaging.destination.name": self._destination,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
        }

    def _attributes(self, delivery: Delivery) -> dict[str, Any]:
        attributes = self._common()
        attributes["worker.delivery_count"] = delivery.delivery_count
        if delivery.message_id is not None:
            attributes["messaging.message.id"] = str(delivery.message_id)
        if isinstance(delivery.type, str):
            attributes["worker.message_type"] = delivery.type
        if self._system == "servicebus":
            attributes["messaging.servicebus.message.delivery_count"] = delivery.delivery_count
        return attributes

    @contextmanager
    def transaction(self, consumer: str) -> Iterator[Span]:
        """The child span around one consumer's database work on this delivery."""
        attributes: dict[str, Any] = {"worker.consumer": consumer}
        if self._db_system is not None:
            attributes["db.system.name"] = self._db_system
        with self._tracer.start_as_current_span(
            f"transaction {consumer}", attributes=attributes
        ) as span:
            yield span


class Transactions:
    """The stage middleware of :class:`Tracing`."""

    def __init__(self, tracing: Tracing) -> None:
        self._tracing = tracing

    async def __call__(self, stage: Stage, call_next: NextStage) -> list[Verdict]:
        with self._tracing.transaction(stage.handler.consumer) as span:
            verdicts = await call_next(stage)
            if len(verdicts) == 1:
                span.set_attribute("worker.outcome", verdicts[0].outcome)
            return verdicts


def _link(headers: Mapping[Any, Any]) -> Link:
    context = trace.get_current_span(propagate.extract(headers, getter=GETTER)).get_span_context()
    return Link(context)


def _record(span: Span, ended: list[Verdict]) -> None:
    """The verdicts on the consumer span: its outcome and the settlement it leads to."""
    if not ended:
        span.set_attribute("worker.settlement", "unsettled")
        return
    if len(ended) == 1:
        [verdict] = ended
        span.set_attribute("worker.outcome", verdict.outcome)
        span.set_attribute("worker.settlement", verdict.verb)
        if verdict.verb in _FAILED_SETTLEMENTS:
            span.set_status(Status(StatusCode.ERROR, verdict.reason or verdict.outcome))
        return
    for verb in {verdict.verb for verdict in ended}:
        span.set_attribute(f"worker.settlements.{verb}", sum(v.verb == verb for v in ended))


def configure(settings: Settings) -> Callable[[], None] | None:
    """Install the SDK with an OTLP/HTTP exporter when tracing is on; returns its shutdown.

    Leaves an already installed SDK provider alone (``opentelemetry-instrument``
    or the embedding application configured one), and returns ``None`` when
    tracing is off.
    """
    if not settings.tracing:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ConfigurationError(
            f"WORKER_TRACING=true needs the SDK: pip install 'idempotent-worker[otel]' ({exc})"
        ) from None
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return None
    service = os.environ.get("OTEL_SERVICE_NAME") or "idempotent-worker"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)

    def shutdown() -> None:
        # Flushing retries an unreachable collector for up to its timeout: bound it, so a
        # dead collector cannot eat the pod's termination grace period.
        flush = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
        flush.start()
        flush.join(SHUTDOWN_TIMEOUT)

    return shutdown
