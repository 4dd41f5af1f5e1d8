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

The adapters' SDKs are imported by the class that needs them, so ``worker run`` on
one broker never imports another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from worker.errors import BrokerUnavailable, ConfigurationError
from worker.logs import scrub

if TYPE_CHECKING:
    from worker.brokers.kafka import KafkaSettings
    from worker.brokers.memory import MemoryBroker
    from worker.brokers.rabbitmq import RabbitMQSettings
    from worker.brokers.servicebus import ClientFactory, Sender, ServiceBusSettings
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


# -- memory ------------------------------------------------------------------------


class MemoryPublisher:
    """Into in-process :class:`~worker.brokers.memory.MemoryBroker` queues."""

    name = "memory"

    def __init__(
        self, default: MemoryBroker, routes: Mapping[str, MemoryBroker] | None = None
    ) -> None:
        self.default = default
        self.routes = dict(routes or {})

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        results: list[str | None] = []
        for message in messages:
            target = self.default if message.destination is None else None
            target = target or self.routes.get(message.destination or "")
            if target is None:
                results.append(f"no such destination {message.destination!r}")
                continue
            target.publish(message.message_id, message.type, message.body, message.headers)
            results.append(None)
        return results

    async def close(self) -> None:
        return None


# -- RabbitMQ ----------------------------------------------------------------------


class RabbitMQPublisher:
    """aio-pika on its own robust connection; a channel with publisher confirms.

    Every message is published ``mandatory``: a message no queue is bound for comes
    back (``basic.return``) and counts as refused instead of vanishing. A confirm
    that does not arrive within ``timeout`` means the broker is not answering.
    """

    name = "rabbitmq"

    def __init__(self, settings: RabbitMQSettings, timeout: float) -> None:
        self.settings = settings
        self.timeout = timeout
        self._connection: Any = None
        self._channel: Any = None
        self._exchanges: dict[str, Any] = {}

    async def _open(self) -> Any:
        import aio_pika

        from worker.brokers.rabbitmq import _connect_args, _start_failure

        if self._connection is None:
            try:
                self._connection = await aio_pika.connect_robust(
                    self.settings.url,
                    reconnect_interval=self.settings.reconnect_interval,
                    **_connect_args(self.settings),
                )
            except Exception as exc:
                self._connection = None
                raise _start_failure(self.settings, exc) from None
        if self._channel is None or self._channel.is_closed:
            try:
                async with asyncio.timeout(self.timeout):
                    self._channel = await self._connection.channel(
                        publisher_confirms=True, on_return_raises=True
                    )
            except Exception as exc:
                raise BrokerUnavailable(f"rabbitmq channel: {scrub(str(exc))}") from None
            self._exchanges = {}
        return self._channel

    def _route(self, message: Outgoing) -> tuple[str, str]:
        destination = message.destination
        if destination is None:
            return self.settings.exchange, message.type
        exchange, slash, routing_key = destination.partition("/")
        if not slash:
            return self.settings.exchange, destination
        return exchange, routing_key

    async def _exchange(self, name: str) -> Any:
        """The exchange, checked once (passively, on a throwaway channel): None if missing.

        A publish to a missing exchange closes the channel, failing every other
        publish in flight on it; checking first keeps the refusal on its own rows.
        """
        from aiormq.exceptions import ChannelNotFoundEntity

        exchange = self._exchanges.get(name)
        if exchange is not None:
            return exchange
        channel = await self._open()
        if not name:
            exchange = self._exchanges[name] = channel.default_exchange
            return exchange
        probe = await self._connection.channel(publisher_confirms=False)
        try:
            await probe.get_exchange(name, ensure=True)
        except ChannelNotFoundEntity:
            return None
        finally:
            with contextlib.suppress(Exception):
                await probe.close()
        exchange = self._exchanges[name] = await channel.get_exchange(name, ensure=False)
        return exchange

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        import aio_pika
        from aiormq.exceptions import AMQPError, DeliveryError

        async def send(message: Outgoing, exchange: Any, routing_key: str) -> str | None:
            amqp = aio_pika.Message(
                message.body,
                headers=dict(message.headers),
                message_id=message.message_id,
                type=message.type,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            try:
                await exchange.publish(amqp, routing_key, mandatory=True)
            except DeliveryError as exc:  # returned (unroutable: PublishError) or nacked
                what = "unroutable" if exc.message is not None else "refused by the broker"
                return f"{what}: exchange {exchange.name!r}, routing key {routing_key!r}"
            return None

        try:
            async with asyncio.timeout(self.timeout):
                results: list[str | None] = [None] * len(messages)
                sends = {}
                for index, message in enumerate(messages):
                    exchange_name, routing_key = self._route(message)
                    exchange = await self._exchange(exchange_name)
                    if exchange is None:
                        results[index] = f"no exchange {exchange_name!r}"
                    else:
                        sends[index] = send(message, exchange, routing_key)
                done = await asyncio.gather(*sends.values())
        except TimeoutError:
            raise BrokerUnavailable(f"rabbitmq: no confirms within {self.timeout}s") from None
        except (AMQPError, OSError, RuntimeError) as exc:  # connection or channel lost
            self._channel, self._exchanges = None, {}  # exchanges belong to their channel
            raise BrokerUnavailable(f"rabbitmq: {scrub(str(exc))}") from None
        for index, result in zip(sends, done, strict=True):
            results[index] = result
        return results

    async def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
        self._connection = self._channel = None


# -- Kafka -------------------------------------------------------------------------


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
        from worker.brokers.kafka import start_producer

        if self._producer is None:
            self._producer = await start_producer(self.kafka)
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
        from aiokafka.errors import (  # type: ignore[import-untyped]
            KafkaConnectionError,
            KafkaError,
            KafkaTimeoutError,
            NodeNotReadyError,
            RequestTimedOutError,
        )

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


# -- Service Bus -------------------------------------------------------------------


class ServiceBusPublisher:
    """azure-servicebus senders, one per entity; ``send_messages`` returning is the confirm."""

    name = "servicebus"

    def __init__(
        self,
        servicebus: ServiceBusSettings,
        client_factory: ClientFactory,
        timeout: float,
    ) -> None:
        self.servicebus = servicebus
        self.timeout = timeout
        self._factory = client_factory
        self._client: Any = None
        self._senders: dict[str, Sender] = {}

    def _sender(self, destination: str) -> Sender:
        sender = self._senders.get(destination)
        if sender is None:
            if self._client is None:
                self._client = self._factory()
            kind, colon, entity = destination.partition(":")
            if colon and kind == "topic":
                sender = self._client.get_topic_sender(entity)
            else:
                sender = self._client.get_queue_sender(entity if colon else destination)
            self._senders[destination] = sender
        return sender

    def outgoing(self, message: Outgoing) -> Any:
        from azure.servicebus import ServiceBusMessage

        properties: dict[str | bytes, Any] = {k: v for k, v in message.headers.items()}
        properties[self.servicebus.type_property] = message.type
        return ServiceBusMessage(
            message.body,
            message_id=message.message_id,
            subject=message.type,
            session_id=None,
            partition_key=None,
            content_type="application/json",
            application_properties=properties,
        )

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        from azure.servicebus.exceptions import (
            MessageSizeExceededError,
            MessagingEntityDisabledError,
            MessagingEntityNotFoundError,
            ServiceBusError,
        )

        refused = (
            MessageSizeExceededError,
            MessagingEntityNotFoundError,
            MessagingEntityDisabledError,
        )
        results: list[str | None] = []
        try:
            async with asyncio.timeout(self.timeout):
                for message in messages:  # one by one: a refusal names its message
                    destination = message.destination or message.type
                    try:
                        await self._sender(destination).send_messages(self.outgoing(message))
                    except refused as exc:
                        results.append(f"{destination!r}: {type(exc).__name__}: {exc}")
                        continue
                    results.append(None)
        except TimeoutError:
            raise BrokerUnavailable(f"servicebus: no send within {self.timeout}s") from None
        except (ServiceBusError, OSError) as exc:
            raise BrokerUnavailable(f"servicebus: {scrub(str(exc))}") from None
        return results

    async def close(self) -> None:
        for sender in self._senders.values():
            with contextlib.suppress(Exception):
                await sender.close()
        self._senders = {}
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
        self._client = None


def open_publisher(settings: Settings, broker: Any = None, *, timeout: float = 10.0) -> Publisher:
    """The publisher for ``WORKER_BROKER``; ``broker`` is the running pump's adapter, if any.

    The memory broker exists only inside one process: its publisher needs the pump's
    own broker, so the messages reach the consumers of this process.
    """
    if settings.broker == "memory":
        from worker.brokers.memory import MemoryConsumer

        if not isinstance(broker, MemoryConsumer):
            raise ConfigurationError(
                "WORKER_BROKER=memory: the outbox relay can only run inside `worker run`"
            )
        return MemoryPublisher(broker.broker)
    if settings.broker == "rabbitmq":
        from worker.brokers.rabbitmq import RabbitMQSettings
        from worker.settings import load

        return RabbitMQPublisher(load(RabbitMQSettings), timeout)
    if settings.broker == "kafka":
        from worker.brokers.kafka import load_kafka_settings

        return KafkaPublisher(load_kafka_settings(), timeout)
    from worker.brokers.servicebus import Connector, load_settings

    servicebus = load_settings()
    return ServiceBusPublisher(servicebus, Connector(servicebus), timeout)


def encode_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """Header values as text: what every broker can carry."""
    return {
        str(k): v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        for k, v in headers.items()
    }
