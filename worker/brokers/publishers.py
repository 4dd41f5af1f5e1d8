"""Confirmed publishing for the outbox relay, one class per broker.

A publisher sends a batch and says, per message, whether the broker took it:

- ``None``: the broker confirmed it (RabbitMQ publisher confirm, Kafka ``acks=all``,
  Service Bus send returned, the memory broker enqueued it);
- a string: the broker refused *this* message (unroutable, too large, no such
  entity); the relay counts it against the row and parks it after
  ``WORKER_OUTBOX_MAX_ATTEMPTS``.

A broker that cannot be reached at all raises :class:`~worker.errors.BrokerUnavailable`
instead: no row is to blame, none spends an attempt (the same rule as a database
outage in the pump).

Destinations, as stored on a row (``None``: the message type):

- RabbitMQ: ``"exchange/routing.key"``; without a ``/``, a routing key on
  ``WORKER_RABBITMQ_EXCHANGE``; ``"/queue"`` is the default exchange straight to a queue.
- Kafka: the topic; the row's key picks the partition.
- Service Bus: ``"queue:name"``, ``"topic:name"``, or a bare queue name.
- Memory: a name in the publisher's routes; the default broker for ``None``.

Each adapter package holds its own publisher (``worker/brokers/<name>/publisher.py``,
memory's in ``memory.py``); :func:`open_publisher` imports only the one
``WORKER_BROKER`` names, so ``worker run`` on one broker never imports another's SDK.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from worker.errors import ConfigurationError

if TYPE_CHECKING:
    from worker.settings import Settings


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One outbox row on its way out."""

    message_id: str
    type: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    key: str | None = None
    destination: str | None = None


class Publisher(Protocol):
    name: str

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        """Send ``messages``; per message None (confirmed) or the broker's refusal."""
        ...

    async def close(self) -> None: ...


def open_publisher(settings: Settings, broker: Any = None, *, timeout: float = 10.0) -> Publisher:
    """The publisher for ``WORKER_BROKER``; ``broker`` is the running pump's adapter, if any.

    The memory broker exists only inside one process: its publisher needs the pump's
    own broker, so the messages reach the consumers of this process.
    """
    if settings.broker == "memory":
        from worker.brokers.memory import MemoryConsumer
        from worker.brokers.memory import open_publisher as open_memory

        if not isinstance(broker, MemoryConsumer):
            raise ConfigurationError(
                "WORKER_BROKER=memory: the outbox relay can only run inside `worker run`"
            )
        return open_memory(broker)
    if settings.broker == "rabbitmq":
        from worker.brokers.rabbitmq import open_publisher as open_rabbitmq

        return open_rabbitmq(settings, timeout)
    if settings.broker == "kafka":
        from worker.brokers.kafka import open_publisher as open_kafka

        return open_kafka(settings, timeout)
    from worker.brokers.servicebus import open_publisher as open_servicebus

    return open_servicebus(settings, timeout)


def encode_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """Header values as text: what every broker can carry."""
    return {
        str(k): v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        for k, v in headers.items()
    }
