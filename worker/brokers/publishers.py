"""The outbox relay's publisher loader: :func:`open_publisher` for ``WORKER_BROKER``.

Each adapter package holds its own publisher (``worker/brokers/<name>/publisher.py``,
memory's in ``memory.py``); :func:`open_publisher` imports only the one
``WORKER_BROKER`` names, so ``worker run`` on one broker never imports another's SDK.
What a publisher is and what it is handed (:class:`Outgoing`, :class:`Publisher`,
:func:`encode_headers`) lives in :mod:`worker.brokers.outgoing`, which the publishers
import instead of this module; the names are re-exported here for the relay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.brokers.outgoing import Outgoing, Publisher, encode_headers
from worker.errors import ConfigurationError

if TYPE_CHECKING:
    from worker.settings import Settings

__all__ = ["Outgoing", "Publisher", "encode_headers", "open_publisher"]


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
