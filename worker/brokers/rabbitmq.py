"""RabbitMQ through aio-pika: a robust connection, manual acks, delayed retries, a DLX.

Topology, declared idempotently by the worker and by ``worker publish`` / ``worker dlq``
(``Q`` is ``WORKER_RABBITMQ_QUEUE``)::

    exchange (WORKER_RABBITMQ_EXCHANGE) --binding keys--> Q  (quorum; its DLX is Q.dlx)
    Q.delay.<ms>ms  (quorum, x-message-ttl=<ms>, at-least-once dead-lettering)
        --TTL expiry, default exchange--> Q
    Q.dlx (fanout) --> Q.dlq  (the dead-letter queue, classic: peeking is free)

Verb mapping (every move is a confirmed copy before the original is released):

- ``ack``: ``basic.ack``. ``ack_many`` (batch mode): one ``basic.ack(multiple=True)``
  for the run of the channel's lowest unsettled delivery tags that are all in the
  batch (a multiple-ack covers every unacked tag up to it, other workers' included),
  single acks for the rest.
- ``nack(delay, counted)``: publish a copy to the delay queue whose TTL fits the
  delay, or straight to ``Q`` for an immediate retry, carrying the delivery count
  so far in ``x-worker-deliveries`` (one less when the message is not to blame),
  wait for the publisher confirm, then ack the original.
- ``dead_letter(reason)``: publish a copy to ``Q.dlx`` with ``x-worker-reason`` (the
  exception type and message), wait for the confirm, then ack the original.
- A copy that fails (returned, refused, unconfirmed in time) on a live channel:
  ``basic.nack(requeue=True)`` on the original, then ``SettlementLost``.

Delivery count = ``x-worker-deliveries`` (the worker's own count, carried across its
copies; ignored on a dead letter moved back by an operator tool) + the quorum
queue's ``x-delivery-count`` (returns inside the queue: crashed consumers, lost
connections) + 1. Copy-then-ack is not atomic: a crash between the two leaves the
original to be redelivered next to its copy, and the inbox absorbs whichever runs
second. docs/rabbitmq.md explains the design and the migration from older queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)
from aiormq.exceptions import (
    AMQPError,
    ChannelNotFoundEntity,
    ChannelPreconditionFailed,
    DeliveryError,
)
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.brokers import (
    DEFAULT_SCAN,
    DeadLetterFilter,
    DeadLetterInfo,
    IdentityFunc,
    OutgoingMessage,
    load_identity,
)
from worker.db import redact
from worker.delivery import Delivery
from worker.errors import BrokerUnavailable, ConfigurationError, SettlementLost, WorkerError
from worker.logs import get_logger, scrub
from worker.settings import load

if TYPE_CHECKING:
    from worker.settings import Settings

DELIVERIES_HEADER = "x-worker-deliveries"
REASON_HEADER = "x-worker-reason"
_WORKER_HEADERS = (DELIVERIES_HEADER, REASON_HEADER, "x-worker-queue", "x-worker-dead-lettered-at")
_BROKER_HEADERS = (
    "x-delivery-count",
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
)
_CE_PREFIXES = ("ce-", "ce_", "cloudEvents:", "cloudEvents_")
_MAX_REASON = 2000
_DEFAULT_RETRY_DELAYS = (1.0, 5.0, 30.0, 120.0)
_PUBLISH_BATCH = 256

# What aio-pika/aiormq raise when a settlement can no longer reach the broker
# (channel closed, connection lost, confirm refused); ChannelInvalidStateError
# is a RuntimeError, socket errors are OSErrors.
_LOST = (AMQPError, OSError, RuntimeError, TimeoutError)


class RabbitMQSettings(BaseSettings):
    """``WORKER_RABBITMQ_*``: where to connect and what to declare."""

    model_config = SettingsConfigDict(env_prefix="WORKER_RABBITMQ_", extra="ignore")

    url: str = Field("amqp://guest:guest@127.0.0.1:5672/", description="amqp:// or amqps://")
    queue: str = Field("worker", min_length=1, description="The work queue; names the rest.")
    exchange: str = Field("worker", description="Bound to the work queue; '' binds nothing.")
    exchange_type: Literal["topic", "direct", "fanout", "headers"] = "topic"
    binding_keys: list[str] = Field(["#"], description="JSON list of routing keys to bind.")
    queue_type: Literal["quorum", "classic"] = "quorum"
    retry_delays: list[float] = Field(
        list(_DEFAULT_RETRY_DELAYS), description="JSON list of seconds, one retry queue each."
    )
    content_hash_ids: bool = Field(False, description="No id at all: sha256(type+body). Risky.")
    reconnect_interval: float = Field(2.0, gt=0, description="Seconds between reconnects.")
    connect_timeout: float = Field(10.0, gt=0)
    settle_timeout: float = Field(15.0, gt=0, description="Bound on one ack/publish confirm.")
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True

    @field_validator("url")
    @classmethod
    def _amqp_url(cls, value: str) -> str:
        if not value.startswith(("amqp://", "amqps://")):
            raise ValueError("must start with amqp:// or amqps://")
        return value

    @field_validator("retry_delays")
    @classmethod
    def _ascending(cls, value: list[float]) -> list[float]:
        if any(d <= 0 for d in value) or value != sorted(set(value)):
            raise ValueError("must be positive seconds in ascending order, without repeats")
        return value

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.queue}.dlx"

    @property
    def dead_letter_queue(self) -> str:
        """A classic queue: a peek (get, then give back) keeps its place and counts nothing."""
        return f"{self.queue}.dlq"

    def retry_queue(self, delay: float) -> str:
        """Named by its TTL, so changing the delays declares new queues instead of failing."""
        return f"{self.queue}.delay.{round(delay * 1000)}ms"

    @property
    def legacy_queues(self) -> dict[str, str]:
        """Queues of earlier versions -> where their messages belong now (drained at start).

        ``Q.retry.<ms>ms`` were classic TTL queues, which dead-letter at most once (a
        copy whose TTL ran out while the broker stopped was dropped); ``Q.dead`` was a
        quorum queue, whose every peek raised the delivery count of its messages.
        """
        delays = sorted({*self.retry_delays, *_DEFAULT_RETRY_DELAYS})
        legacy = {f"{self.queue}.retry.{round(d * 1000)}ms": self.queue for d in delays}
        legacy[f"{self.queue}.dead"] = self.dead_letter_queue
        return legacy

    def retry_delay(self, delivery_count: int, requested: float | None) -> float | None:
        """The retry queue's delay for a nack; ``None``: requeue at once."""
        delays = self.retry_delays
        if not delays or (requested is not None and requested <= 0):
            return None
        if requested is None:  # back off further on every failed delivery
            return delays[min(max(delivery_count, 1), len(delays)) - 1]
        return next((d for d in delays if d >= requested), delays[-1])


# -- message facts ---------------------------------------------------------------


def _header(headers: Mapping[str, Any], name: str) -> str | None:
    value = headers.get(name)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return str(value) if value not in (None, "") else None


def _cloud_event(headers: Mapping[str, Any], attribute: str) -> str | None:
    for prefix in _CE_PREFIXES:
        value = _header(headers, prefix + attribute)
        if value is not None:
            return value
    return None


def message_type(message: AbstractIncomingMessage) -> str | None:
    """The AMQP ``type`` property, else the CloudEvents ``ce-type`` header."""
    return message.type or _cloud_event(message.headers or {}, "type")


def default_message_id(message: AbstractIncomingMessage) -> str | None:
    """CloudEvents source + id when both are present, else the AMQP ``message_id``, else None.

    The CloudEvents pair comes first because aiormq (under aio-pika) stamps a
    random ``message_id`` on every message published without one, so a producer
    retry through aio-pika carries a new id while its ``ce-id`` stays the same.
    """
    headers = message.headers or {}
    ce_id, ce_source = _cloud_event(headers, "id"), _cloud_event(headers, "source")
    if ce_id is not None and ce_source is not None:
        return json.dumps([ce_source, ce_id], separators=(",", ":"))
    return message.message_id or None


def content_hash_id(message: AbstractIncomingMessage) -> str:
    """Two identical messages become one: only for producers that never repeat a payload."""
    digest = hashlib.sha256(f"{message_type(message)}\0".encode() + message.body)
    return f"sha256:{digest.hexdigest()}"


def make_identity(settings: RabbitMQSettings, path: str | None = None) -> IdentityFunc:
    if not settings.content_hash_ids:
        return load_identity(path, default_message_id)

    def identity_or_hash(message: AbstractIncomingMessage) -> str | None:
        return default_message_id(message) or content_hash_id(message)

    return load_identity(path, identity_or_hash)


def delivery_count(message: AbstractIncomingMessage) -> int:
    """1 on the first delivery; counts the worker's own retry hops and crashed consumers.

    The carried count is honoured only where the worker's own retry hop set it: a
    dead letter (it carries ``x-worker-reason``) moved back to the work queue by a
    shovel or the management UI starts afresh, as ``worker dlq --resubmit`` does.
    """
    headers = message.headers or {}
    before = 0 if REASON_HEADER in headers else _int(headers.get(DELIVERIES_HEADER))
    returned = headers.get("x-delivery-count")  # quorum queues only
    inside = _int(returned) if returned is not None else int(bool(message.redelivered))
    return before + inside + 1


def _int(value: Any) -> int:
    try:
        return max(int(value), 0)
    except (TypeError, ValueError):
        return 0


def _dead_lettered_at(headers: Mapping[str, Any], death: Mapping[str, Any]) -> datetime | None:
    """When the worker (``x-worker-dead-lettered-at``) or the broker (``x-death``) dead-lettered."""
    stamp = _header(headers, "x-worker-dead-lettered-at")
    if stamp is not None:
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(stamp)
    at = death.get("time")
    return at if isinstance(at, datetime) else None


def _copy(message: AbstractIncomingMessage, **extra: Any) -> aio_pika.Message:
    """A persistent copy without the broker's bookkeeping headers (or ours, unless given)."""
    headers = {
        k: v
        for k, v in (message.headers or {}).items()
        if k not in _BROKER_HEADERS and k not in _WORKER_HEADERS
    }
    headers.update(extra)
    return aio_pika.Message(
        message.body,
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
    )


# -- connection and topology -----------------------------------------------------


def ssl_context(settings: RabbitMQSettings) -> ssl.SSLContext | None:
    """The TLS context for amqps:// URLs, from the WORKER_RABBITMQ_TLS_* settings."""
    if not settings.url.startswith("amqps://"):
        if settings.tls_ca_file or settings.tls_cert_file or settings.tls_key_file:
            raise ConfigurationError(
                "WORKER_RABBITMQ_TLS_*: set, but WORKER_RABBITMQ_URL is not amqps://"
            )
        return None
    try:
        context = ssl.create_default_context(cafile=settings.tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(f"WORKER_RABBITMQ_TLS_CA_FILE: {exc}") from None
    if settings.tls_cert_file:
        try:
            context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(f"WORKER_RABBITMQ_TLS_CERT_FILE/KEY_FILE: {exc}") from None
    elif settings.tls_key_file:
        raise ConfigurationError(
            "WORKER_RABBITMQ_TLS_KEY_FILE: set without WORKER_RABBITMQ_TLS_CERT_FILE"
        )
    if not settings.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _connect_args(settings: RabbitMQSettings) -> dict[str, Any]:
    return {
        "ssl_context": ssl_context(settings),
        "timeout": settings.connect_timeout,
        "client_properties": {"connection_name": f"worker {settings.queue} pid {os.getpid()}"},
    }


def _start_failure(settings: RabbitMQSettings, exc: BaseException) -> WorkerError:
    if isinstance(exc, ChannelPreconditionFailed):  # a queue exists with other arguments
        return ConfigurationError(
            f"WORKER_RABBITMQ_QUEUE={settings.queue!r}: {exc}; the existing queues were declared "
            "with other settings (queue type, retry delays): pick a new queue name or delete them"
        )
    return BrokerUnavailable(f"{redact(settings.url)}: {scrub(str(exc))}")


async def declare_topology(channel: AbstractChannel, settings: RabbitMQSettings) -> AbstractQueue:
    """Declare (idempotently) everything the worker uses; returns the work queue."""
    dlx = await channel.declare_exchange(
        settings.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
    )
    dead = await channel.declare_queue(
        settings.dead_letter_queue, durable=True, arguments={"x-queue-type": "classic"}
    )
    await dead.bind(dlx, routing_key="")
    work = await channel.declare_queue(
        settings.queue,
        durable=True,
        arguments={
            "x-queue-type": settings.queue_type,
            # where the broker itself dead-letters (a delivery-limit policy, a message TTL)
            "x-dead-letter-exchange": settings.dead_letter_exchange,
        },
    )
    if settings.exchange:
        exchange = await channel.declare_exchange(
            settings.exchange, aio_pika.ExchangeType(settings.exchange_type), durable=True
        )
        for key in settings.binding_keys:
            await work.bind(exchange, routing_key=key)
    for delay in settings.retry_delays:
        await channel.declare_queue(
            settings.retry_queue(delay),
            durable=True,
            arguments={
                # quorum + at-least-once: an expired copy leaves only once the work queue
                # confirmed it, even across a broker restart (RabbitMQ 3.10 and later)
                "x-queue-type": "quorum",
                "x-message-ttl": round(delay * 1000),
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
                # the default exchange routes by queue name: back to this worker's
                # queue only, never to other queues bound to the shared exchange
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": settings.queue,
            },
        )
    return work


async def drain_legacy_queues(connection: AbstractConnection, settings: RabbitMQSettings) -> int:
    """Move what earlier versions' queues still hold to where it belongs now, then delete them.

    Each message is copied (confirmed) before the original is acked, so a crash in
    between leaves a duplicate for the inbox, never a loss; replicas draining at the
    same time share the messages, since a ``basic.get`` hands each to one of them.
    """
    moved = 0
    for legacy, target in settings.legacy_queues.items():
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        try:
            try:
                queue = await channel.declare_queue(legacy, passive=True)
            except ChannelNotFoundEntity:
                continue  # never existed, or drained already
            if legacy.endswith(".dead"):  # stop the fanout from filling it while it drains
                await queue.unbind(settings.dead_letter_exchange, "")
            # Quorum queues refuse ``if_empty``: drain, look again, delete once it reads
            # empty (a count can lag the acks by a moment); nothing routes to an old queue
            # any more (the dead-letter one was unbound above). Bounded: a queue that old
            # workers still feed is drained again at the next start.
            for _ in range(5):
                while (message := await queue.get(no_ack=False, fail=False)) is not None:
                    await channel.default_exchange.publish(_moved(message), target, mandatory=True)
                    await message.ack()
                    moved += 1
                again = await channel.declare_queue(legacy, passive=True)
                if again.declaration_result.message_count == 0:
                    await again.delete(if_unused=False, if_empty=False)
                    break
                await asyncio.sleep(0.2)
        finally:
            with contextlib.suppress(*_LOST):
                await channel.close()
    return moved


def _moved(message: AbstractIncomingMessage) -> aio_pika.Message:
    """A copy that keeps the worker's headers (its count, its dead-letter reason)."""
    ours = {k: v for k, v in (message.headers or {}).items() if k in _WORKER_HEADERS}
    return _copy(message, **ours)


async def delete_topology(channel: AbstractChannel, settings: RabbitMQSettings) -> None:
    """Remove what :func:`declare_topology` made, messages included (tests, benchmarks)."""
    names = [settings.queue, settings.dead_letter_queue, *settings.legacy_queues]
    names += [settings.retry_queue(delay) for delay in settings.retry_delays]
    for name in names:
        await channel.queue_delete(name, if_unused=False, if_empty=False)
    for exchange in (settings.exchange, settings.dead_letter_exchange):
        if exchange:  # "" is the default exchange, which cannot be deleted
            await channel.exchange_delete(exchange)


# -- the consumer ------------------------------------------------------------------


class _Handle:
    __slots__ = ("count", "generation", "message", "tag")

    def __init__(self, message: AbstractIncomingMessage, count: int, generation: int) -> None:
        self.message = message
        self.count = count
        self.generation = generation
        self.tag = message.delivery_tag or 0


class RabbitMQBroker:
    """The pump's :class:`~worker.brokers.Broker` and the deliveries' Settler."""

    name = "rabbitmq"

    def __init__(self, settings: RabbitMQSettings, identity: IdentityFunc) -> None:
        self.settings = settings
        self.identity = identity
        self._log = get_logger(broker=self.name, queue=settings.queue)
        self._buffer: asyncio.Queue[Delivery] = asyncio.Queue()
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractRobustChannel | None = None
        self._publisher: AbstractRobustChannel | None = None
        self._queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._connected = False
        self._consuming = False
        self._generation = 0
        self._lost_at: float | None = None
        self.outages = 0
        self._exchanges: dict[str, AbstractExchange] = {}
        # Delivery tags of this generation's channel not settled yet, ascending (tags grow
        # with every delivery): a multiple-ack is safe only over a run of the lowest ones.
        # A tag leaves once its settling frame went out, never before.
        self._unsettled: dict[int, None] = {}
        self.multiple_acks = 0

    @property
    def ready(self) -> bool:
        """Connected and consuming: False while the robust connection reconnects."""
        return self._connected and self._consuming

    async def start(self, prefetch: int) -> None:
        settings = self.settings
        try:
            self._connection = connection = await aio_pika.connect_robust(
                settings.url,
                reconnect_interval=settings.reconnect_interval,
                **_connect_args(settings),
            )
            self._channel = channel = await connection.channel()
            self._publisher = await connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
            await channel.set_qos(prefetch_count=prefetch)
            self._queue = await declare_topology(channel, settings)
            drained = await drain_legacy_queues(connection, settings)
            if drained:
                self._log.info("moved messages out of legacy queues", messages=drained)
            connection.close_callbacks.add(self._on_lost)
            channel.close_callbacks.add(self._on_lost)
            channel.reopen_callbacks.add(self._on_restored)
            connection.reconnect_callbacks.add(self._on_restored)
            # before basic.consume: the first deliveries may arrive before it returns
            self._connected = self._consuming = True
            self._consumer_tag = await self._queue.consume(self._on_message, no_ack=False)
        except _LOST as exc:
            await self.close()
            raise _start_failure(settings, exc) from None
        self._log.info(
            "rabbitmq consuming",
            url=redact(settings.url),
            prefetch=prefetch,
            queue_type=settings.queue_type,
            retry_delays=settings.retry_delays,
        )

    async def receive(self) -> Delivery:
        while True:
            delivery = await self._buffer.get()
            if delivery._handle.generation == self._generation:
                return delivery
            # delivered on a connection since lost: RabbitMQ has already requeued it

    async def stop_receiving(self) -> None:
        """Cancel the consumer; deliveries not yet taken go straight back to the queue."""
        self._consuming = False
        if self._queue is not None and self._consumer_tag is not None:
            with contextlib.suppress(*_LOST):
                async with asyncio.timeout(self.settings.settle_timeout):
                    await self._queue.cancel(self._consumer_tag)
            self._consumer_tag = None
        while not self._buffer.empty():  # taken from the queue, never started: not counted
            handle: _Handle = self._buffer.get_nowait()._handle
            with contextlib.suppress(SettlementLost):
                await self.nack(handle, 0.0, counted=False)

    async def close(self) -> None:
        self._consuming = False
        self._connected = False
        if self._connection is not None:
            with contextlib.suppress(*_LOST):
                await self._connection.close()
            self._connection = None

    # -- connection state (aio-pika callbacks) -------------------------------------

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        count = delivery_count(message)
        handle = _Handle(message, count, self._generation)
        self._unsettled[handle.tag] = None
        if not self._consuming:  # raced with basic.cancel: give it straight back, uncounted
            with contextlib.suppress(SettlementLost):
                await self.nack(handle, 0.0, counted=False)
            return
        try:
            message_id = self.identity(message)
        except Exception:  # a deployment's WORKER_MESSAGE_ID_FUNC: the pump dead-letters None
            self._log.exception("message id function failed", delivery_count=count)
            message_id = None
        self._buffer.put_nowait(
            Delivery(
                message_id,
                message_type(message),
                message.body,
                message.headers or {},
                count,
                self,
                handle,
            )
        )

    def _on_lost(self, _sender: Any, exc: BaseException | None = None) -> None:
        if not self._connected:
            return
        self._connected = False
        self.outages += 1
        self._generation += 1  # every unsettled delivery tag is void from here on
        self._unsettled.clear()  # the channel that numbered them is gone
        self._lost_at = time.monotonic()
        while not self._buffer.empty():
            self._buffer.get_nowait()
        if self._consuming:
            self._log.warning("rabbitmq connection lost, reconnecting", error=exc)

    def _on_restored(self, _sender: Any, *_: Any) -> None:
        if self._connected or self._connection is None or self._connection.is_closed:
            return
        self._connected = True
        outage = time.monotonic() - self._lost_at if self._lost_at else 0.0
        self._log.info("rabbitmq reconnected", outage_s=round(outage, 2))

    # -- Settler ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _settling(
        self, handle: _Handle, verb: str, give_back: bool = False
    ) -> AsyncIterator[None]:
        """Bound one settlement step in time and translate vendor errors to SettlementLost.

        ``give_back``: the step is the copy's publish, and the original is still held
        on a live channel, where nothing would ever return it: requeue it first.
        """
        if handle.generation != self._generation:
            raise SettlementLost(f"{verb} {handle.message.message_id!r}: its connection was lost")
        try:
            async with asyncio.timeout(self.settings.settle_timeout):
                yield
        except _LOST as exc:
            requeued = give_back and await self._give_back(handle)
            note = "; the original was requeued" if requeued else ""
            raise SettlementLost(f"{verb} {handle.message.message_id!r}: {exc!r}{note}") from exc

    async def _give_back(self, handle: _Handle) -> bool:
        """Best effort ``basic.nack(requeue=True)``, so RabbitMQ really redelivers."""
        if handle.generation != self._generation:
            return False  # a void tag: the broker requeued it with the lost channel
        try:
            async with asyncio.timeout(self.settings.settle_timeout):
                await handle.message.nack(requeue=True)
        except _LOST:
            return False  # the channel is gone after all, and so is the delivery
        self._settled(handle)
        return True

    def _settled(self, handle: _Handle) -> None:
        if handle.generation == self._generation:
            self._unsettled.pop(handle.tag, None)

    async def ack(self, handle: _Handle) -> None:
        async with self._settling(handle, "ack"):
            await handle.message.ack()
        self._settled(handle)

    async def ack_many(self, handles: Sequence[_Handle]) -> list[_Handle]:
        """Ack a batch; returns the handles whose ack was lost.

        ``basic.ack(multiple=True)`` on tag T acks every unacked tag <= T on the channel,
        whoever holds it. It is sent only for the run of the lowest unsettled tags that
        are all in ``handles`` (two or more); a tag still running, being nacked or
        dead-lettered elsewhere ends the run, and the rest are acked one by one.
        """
        ours = {h.tag: h for h in handles if h.generation == self._generation}
        run: list[_Handle] = []
        for tag in self._unsettled:  # ascending; stops at the first tag that is not ours
            if tag not in ours:
                break
            run.append(ours[tag])
        lost: list[_Handle] = []
        if len(run) > 1:
            top = run[-1]
            try:
                async with self._settling(top, "ack"):
                    await top.message.ack(multiple=True)
            except SettlementLost:
                lost.extend(run)
            else:
                self.multiple_acks += 1
                for handle in run:
                    self._settled(handle)
        else:
            run = []
        covered = {id(h) for h in run}
        for handle in handles:
            if id(handle) not in covered:
                try:
                    await self.ack(handle)
                except SettlementLost:
                    lost.append(handle)
        return lost

    async def nack(self, handle: _Handle, delay: float | None, counted: bool = True) -> None:
        # Always a confirmed copy, never ``basic.nack(requeue=True)``: the copy carries
        # the count (and keeps it where it is when the message is not to blame), works
        # the same on classic queues, and does not depend on whether a RabbitMQ version
        # counts nacks (4.3 reportedly stopped).
        level = self.settings.retry_delay(handle.count, delay)
        target = self.settings.queue if level is None else self.settings.retry_queue(level)
        carried = handle.count if counted else handle.count - 1
        copy = _copy(handle.message, **{DELIVERIES_HEADER: carried})
        await self._copy_then_ack(handle, "nack", copy, "", target)

    async def dead_letter(self, handle: _Handle, reason: str) -> None:
        copy = _copy(
            handle.message,
            **{
                REASON_HEADER: reason[:_MAX_REASON],
                DELIVERIES_HEADER: handle.count,
                "x-worker-queue": self.settings.queue,
                "x-worker-dead-lettered-at": datetime.now(UTC).isoformat(),
            },
        )
        await self._copy_then_ack(
            handle, "dead-letter", copy, self.settings.dead_letter_exchange, self.settings.queue
        )

    async def _copy_then_ack(
        self,
        handle: _Handle,
        verb: str,
        copy: aio_pika.Message,
        exchange: str,
        routing_key: str,
    ) -> None:
        """Publish the copy (confirmed), then ack the original; each step bounded on its own."""
        async with self._settling(handle, verb, give_back=True):
            await self._publish(copy, exchange, routing_key)
        async with self._settling(handle, verb):
            await handle.message.ack()
        self._settled(handle)

    async def _publish(self, message: aio_pika.Message, exchange: str, routing_key: str) -> None:
        assert self._publisher is not None
        # Publishing on a robust channel waits out a reconnect; the ack after it
        # then fails on the old channel and the original comes back anyway.
        target = self._exchanges.get(exchange)
        if target is None:
            target = self._exchanges[exchange] = (
                await self._publisher.get_exchange(exchange, ensure=False)
                if exchange
                else self._publisher.default_exchange
            )
        await target.publish(message, routing_key, mandatory=True)


# -- operator tools ----------------------------------------------------------------


class RabbitMQAdmin:
    """``worker publish`` and ``worker dlq``: short-lived, plain (not robust) connection."""

    def __init__(self, settings: RabbitMQSettings, identity: IdentityFunc) -> None:
        self.settings = settings
        self.identity = identity
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None

    async def _open(self) -> AbstractChannel:
        if self._channel is None:
            try:
                self._connection = await aio_pika.connect(
                    self.settings.url, **_connect_args(self.settings)
                )
                self._channel = await self._connection.channel(on_return_raises=True)
                await declare_topology(self._channel, self.settings)
            except _LOST as exc:
                await self.close()
                raise _start_failure(self.settings, exc) from None
        return self._channel

    async def publish(self, messages: list[OutgoingMessage]) -> int:
        """Publish to the exchange with the type as routing key, in confirmed batches."""
        channel = await self._open()
        settings = self.settings
        if settings.exchange:
            exchange = await channel.get_exchange(settings.exchange, ensure=False)
        else:
            exchange = channel.default_exchange

        async def send(item: OutgoingMessage) -> None:
            message = aio_pika.Message(
                item.body,
                headers=dict(item.headers),
                message_id=item.message_id,
                type=item.type,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            key = item.type if settings.exchange else settings.queue
            try:
                await exchange.publish(message, key)
            except DeliveryError:  # returned: unroutable
                raise ConfigurationError(
                    f"WORKER_RABBITMQ_BINDING_KEYS={settings.binding_keys}: routing key {key!r} "
                    f"(message {item.message_id!r}) reaches no queue"
                ) from None

        confirmed = 0
        for start in range(0, len(messages), _PUBLISH_BATCH):
            batch = messages[start : start + _PUBLISH_BATCH]
            try:
                await asyncio.gather(*(send(m) for m in batch))
            except _LOST as exc:  # the connection went away (a broker restart, say)
                raise BrokerUnavailable(
                    f"publishing to {settings.exchange or settings.queue!r}: {scrub(str(exc))} "
                    f"({confirmed} confirmed before)"
                ) from None
            confirmed += len(batch)
        return confirmed

    async def dead_letters(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> list[DeadLetterInfo]:
        """Peek: take up to ``scan`` unacked, keep the matching ones, then give them all back.

        The dead-letter queue is a classic queue: a message taken unacked and given
        back by closing the channel returns to its place, and nothing counts it.
        """
        letters: list[DeadLetterInfo] = []
        async with self._scanning() as dead:
            for _ in range(scan):
                if len(letters) >= limit:
                    break
                message = await dead.get(no_ack=False, fail=False)
                if message is None:
                    break
                letter = self._describe(message)
                if match is None or match(letter):
                    letters.append(letter)
        return letters

    async def resubmit(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> int:
        """Move matching dead letters to the work queue with a fresh delivery count.

        Each is taken unacked, copied (publisher-confirmed), then acked; the others
        stay unacked until the scan ends and return to their places, in order.
        """
        channel = await self._open()
        moved = 0
        async with self._scanning() as dead:
            for _ in range(scan):
                if moved >= limit:
                    break
                message = await dead.get(no_ack=False, fail=False)
                if message is None:
                    break
                if match is not None and not match(self._describe(message)):
                    continue
                resubmits = _int((message.headers or {}).get("x-worker-resubmitted")) + 1
                copy = _copy(message, **{"x-worker-resubmitted": resubmits})
                try:
                    await channel.default_exchange.publish(copy, self.settings.queue)
                    await message.ack()
                except _LOST as exc:
                    raise BrokerUnavailable(
                        f"re-submitting to {self.settings.queue!r}: {scrub(str(exc))} "
                        f"({moved} moved before)"
                    ) from None
                moved += 1
        return moved

    @contextlib.asynccontextmanager
    async def _scanning(self) -> AsyncIterator[AbstractQueue]:
        """The dead-letter queue on a channel of its own: closing it gives back what was taken."""
        await self._open()
        assert self._connection is not None
        scan = None
        try:
            scan = await self._connection.channel(publisher_confirms=False)
            yield await scan.get_queue(self.settings.dead_letter_queue, ensure=False)
        except _LOST as exc:
            raise BrokerUnavailable(
                f"reading {self.settings.dead_letter_queue!r}: {scrub(str(exc))}"
            ) from None
        finally:
            if scan is not None:
                with contextlib.suppress(*_LOST):
                    await scan.close()  # unacked messages return to the queue

    def _describe(self, message: AbstractIncomingMessage) -> DeadLetterInfo:
        headers = dict(message.headers or {})
        reason = _header(headers, REASON_HEADER)
        deaths = headers.get("x-death")
        first = deaths[0] if isinstance(deaths, list) and deaths else None
        first = first if isinstance(first, dict) else {}
        if reason is None:  # dead-lettered by the broker itself (a policy, a TTL)
            reason = f"broker: {_header(first, 'reason') or 'unknown'} in {_header(first, 'queue')}"
        return DeadLetterInfo(
            self.identity(message),
            message_type(message),
            reason,
            message.body,
            headers,
            _dead_lettered_at(headers, first) or message.timestamp,
        )

    async def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(*_LOST):
                await self._connection.close()
        self._connection = self._channel = None


def open_broker(settings: Settings) -> RabbitMQBroker:
    rabbit = load(RabbitMQSettings)
    ssl_context(rabbit)  # a bad TLS setting fails at start, as one line
    return RabbitMQBroker(rabbit, make_identity(rabbit, settings.message_id_func))


def open_admin(settings: Settings) -> RabbitMQAdmin:
    rabbit = load(RabbitMQSettings)
    return RabbitMQAdmin(rabbit, make_identity(rabbit, settings.message_id_func))
