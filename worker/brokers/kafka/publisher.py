"""The outbox relay's publisher on Kafka: ``acks=all`` sends, a verdict per message.

The relay (:mod:`worker.outbox.relay`) opens it through
:func:`worker.brokers.publishers.open_publisher`; it lives with the adapter so that the
relay of a worker on another broker never imports aiokafka.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiokafka.errors import (  # type: ignore[import-untyped]
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
)

from worker.brokers.kafka.settings import start_producer
from worker.errors import BrokerUnavailable

if TYPE_CHECKING:
    from worker.brokers.kafka.settings import KafkaSettings
    from worker.brokers.outgoing import Outgoing


class KafkaPublisher:
    """aiokafka with ``acks=all`` (idempotent when ``WORKER_KAFKA_IDEMPOTENT_PRODUCER``).

    Headers follow the CloudEvents Kafka binding (``ce_id``, ``ce_type``, ...) and
    carry the worker's own id and type headers, so another worker deduplicates it.
    """

    name = "kafka"

    def __init__(self, kafka: KafkaSettings, timeout: float) -> None:
        self.kafka = kafka
        self.timeout = timeout
        self._producer: Any = None

    async def _started(self) -> Any:
        if self._producer is None:
            # A send waits for its topic's metadata and its ack at most half the publish
            # timeout (a metadata round trip may follow that wait), so a topic the broker
            # won't serve comes back as that row's refusal, UnknownTopicOrPartitionError,
            # before the timeout below gives up on the whole call as an unreachable broker.
            self._producer = await start_producer(self.kafka, request_timeout=self.timeout / 2)
        return self._producer

    def headers(self, message: Outgoing) -> list[tuple[str, bytes]]:
        headers = [
            (name.replace("ce-", "ce_", 1) if name.startswith("ce-") else name, value.encode())
            for name, value in message.headers.items()
        ]
        headers.append((self.kafka.message_id_header, message.message_id.encode()))
        headers.append((self.kafka.type_header, message.type.encode()))
        return headers

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        unavailable: tuple[type[BaseException], ...] = (
            KafkaConnectionError,
            KafkaTimeoutError,
            NodeNotReadyError,
            RequestTimedOutError,
        )
        producer = await self._started()

        async def send(message: Outgoing) -> str | None:
            topic = message.destination or message.type
            key = message.key.encode() if message.key is not None else None
            try:
                sent = await producer.send(
                    topic, message.body, key=key, headers=self.headers(message)
                )
                await sent
            except unavailable:
                raise
            except KafkaError as exc:
                return f"topic {topic!r}: {type(exc).__name__}: {exc}"
            return None

        try:
            async with asyncio.timeout(self.timeout):
                return list(await asyncio.gather(*(send(m) for m in messages)))
        except TimeoutError:
            raise BrokerUnavailable(f"kafka: no acks within {self.timeout}s") from None
        except unavailable as exc:
            raise BrokerUnavailable(f"kafka: {exc}") from None

    async def close(self) -> None:
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.stop()
        self._producer = None
