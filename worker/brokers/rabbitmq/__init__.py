"""RabbitMQ through aio-pika: a robust connection, manual acks, delayed retries, a DLX.

The package is split by role, and this module is what the rest of the worker sees:
the loader in :mod:`worker.brokers` calls :func:`open_broker` and :func:`open_admin`,
the outbox relay :func:`open_publisher`.

- :mod:`~worker.brokers.rabbitmq.settings`: ``WORKER_RABBITMQ_*``, TLS, connecting;
- :mod:`~worker.brokers.rabbitmq.messages`: type, dedup key, delivery count, copies;
- :mod:`~worker.brokers.rabbitmq.topology`: the queues and exchanges, and their migration;
- :mod:`~worker.brokers.rabbitmq.consumer`: the pump's Broker and the verb mapping;
- :mod:`~worker.brokers.rabbitmq.giveback`: copy-then-ack for nacks and dead letters, held
  and parked while the broker refuses a copy;
- :mod:`~worker.brokers.rabbitmq.admin`: ``worker publish`` and ``worker dlq``;
- :mod:`~worker.brokers.rabbitmq.publisher`: the outbox relay's confirmed publishing.

docs/rabbitmq.md explains the design and the migration from older queues.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.brokers.rabbitmq.admin import RabbitMQAdmin
from worker.brokers.rabbitmq.consumer import RabbitMQConsumer
from worker.brokers.rabbitmq.messages import (
    DELIVERIES_HEADER,
    REASON_HEADER,
    content_hash_id,
    copy_message,
    default_message_id,
    delivery_count,
    make_identity,
    message_type,
)
from worker.brokers.rabbitmq.publisher import RabbitMQPublisher
from worker.brokers.rabbitmq.settings import RabbitMQSettings, ssl_context
from worker.brokers.rabbitmq.topology import (
    declare_topology,
    delete_topology,
    drain_legacy_queues,
)
from worker.settings import load

if TYPE_CHECKING:
    from worker.settings import Settings

__all__ = [
    "DELIVERIES_HEADER",
    "REASON_HEADER",
    "RabbitMQAdmin",
    "RabbitMQConsumer",
    "RabbitMQPublisher",
    "RabbitMQSettings",
    "content_hash_id",
    "copy_message",
    "declare_topology",
    "default_message_id",
    "delete_topology",
    "delivery_count",
    "drain_legacy_queues",
    "make_identity",
    "message_type",
    "open_admin",
    "open_broker",
    "open_publisher",
    "ssl_context",
]


def open_broker(settings: Settings) -> RabbitMQConsumer:
    rabbit = load(RabbitMQSettings)
    ssl_context(rabbit)  # a bad TLS setting fails at start, as one line
    return RabbitMQConsumer(rabbit, make_identity(rabbit, settings.message_id_func))


def open_admin(settings: Settings) -> RabbitMQAdmin:
    rabbit = load(RabbitMQSettings)
    return RabbitMQAdmin(rabbit, make_identity(rabbit, settings.message_id_func))


def open_publisher(settings: Settings, timeout: float) -> RabbitMQPublisher:
    """The outbox relay's publisher, on a connection of its own."""
    return RabbitMQPublisher(load(RabbitMQSettings), timeout)
