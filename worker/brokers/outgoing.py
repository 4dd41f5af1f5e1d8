"""What the outbox relay hands a broker's publisher: :class:`Outgoing` rows and the
:class:`Publisher` Protocol each adapter's publisher implements.

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

The adapters' publishers import this module and nothing of the loader
(:mod:`worker.brokers.publishers`), which imports them: no cycle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


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


def encode_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """Header values as text: what every broker can carry."""
    return {
        str(k): v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        for k, v in headers.items()
    }
