"""Azure Service Bus through azure-servicebus's asyncio client, in PEEK_LOCK mode.

The package is split by role, and this module is what the rest of the worker sees:
the loader in :mod:`worker.brokers` calls :func:`open_broker` and :func:`open_admin`,
the outbox relay :func:`open_publisher`.

- :mod:`~worker.brokers.servicebus.settings`: ``WORKER_SERVICEBUS_*``;
- :mod:`~worker.brokers.servicebus.client`: the SDK surface the adapter calls, and clients;
- :mod:`~worker.brokers.servicebus.messages`: identity, properties, body, type, copies;
- :mod:`~worker.brokers.servicebus.consumer`: the pump's Broker (receiving, settlement)
  and the verb mapping;
- :mod:`~worker.brokers.servicebus.links`: a client and its receiver, opened, retired,
  closed, and what a failed first open means;
- :mod:`~worker.brokers.servicebus.locks`: the lock per message held, and its renewal;
- :mod:`~worker.brokers.servicebus.clock`: broker timestamps against the local clock;
- :mod:`~worker.brokers.servicebus.giveback`: the uncounted give-back's confirmed copy,
  and the counts it carries;
- :mod:`~worker.brokers.servicebus.admin`: ``worker publish`` and ``worker dlq``;
- :mod:`~worker.brokers.servicebus.publisher`: the outbox relay's publishing.

docs/servicebus.md explains the design; sessions are not supported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.brokers import load_identity
from worker.brokers.servicebus.admin import ServiceBusAdmin
from worker.brokers.servicebus.client import (
    Client,
    ClientFactory,
    Connector,
    Receiver,
    Sender,
)
from worker.brokers.servicebus.consumer import ServiceBusConsumer
from worker.brokers.servicebus.messages import (
    COPIED_AT_PROPERTY,
    DELIVERIES_PROPERTY,
    GIVE_BACKS_PROPERTY,
    TypeResolver,
    application_properties,
    body_of,
    default_message_id,
)
from worker.brokers.servicebus.publisher import ServiceBusPublisher
from worker.brokers.servicebus.settings import ServiceBusSettings, load_settings
from worker.logs import get_logger

if TYPE_CHECKING:
    from worker.settings import Settings

__all__ = [
    "COPIED_AT_PROPERTY",
    "DELIVERIES_PROPERTY",
    "GIVE_BACKS_PROPERTY",
    "Client",
    "ClientFactory",
    "Connector",
    "Receiver",
    "Sender",
    "ServiceBusAdmin",
    "ServiceBusConsumer",
    "ServiceBusPublisher",
    "ServiceBusSettings",
    "TypeResolver",
    "application_properties",
    "body_of",
    "default_message_id",
    "load_settings",
    "open_admin",
    "open_broker",
    "open_publisher",
]


def open_broker(
    settings: Settings,
    *,
    servicebus: ServiceBusSettings | None = None,
    client_factory: ClientFactory | None = None,
) -> ServiceBusConsumer:
    """``WORKER_BROKER=servicebus``; tests pass their own settings and client factory."""
    sb = servicebus or load_settings()
    on_close = None
    if client_factory is None:
        connector = Connector(sb)
        client_factory, on_close = connector, connector.close
    if settings.max_deliveries >= sb.entity_max_delivery_count:
        get_logger(broker="servicebus").warning(
            "WORKER_MAX_DELIVERIES is not below the entity's MaxDeliveryCount: the entity may "
            "dead-letter a message before the pump can say why",
            max_deliveries=settings.max_deliveries,
            entity_max_delivery_count=sb.entity_max_delivery_count,
        )
    identity = load_identity(settings.message_id_func, default_message_id)
    return ServiceBusConsumer(sb, client_factory, identity=identity, on_close=on_close)


def open_admin(
    settings: Settings,
    *,
    servicebus: ServiceBusSettings | None = None,
    client_factory: ClientFactory | None = None,
) -> ServiceBusAdmin:
    sb = servicebus or load_settings()
    on_close = None
    if client_factory is None:
        connector = Connector(sb)
        client_factory, on_close = connector, connector.close
    return ServiceBusAdmin(sb, client_factory, on_close=on_close)


def open_publisher(settings: Settings, timeout: float) -> ServiceBusPublisher:
    """The outbox relay's publisher, on a client of its own."""
    servicebus = load_settings()
    return ServiceBusPublisher(servicebus, Connector(servicebus), timeout)
