"""Azure Service Bus through azure-servicebus's asyncio client, in PEEK_LOCK mode.

Verb mapping:

- ``ack``: ``complete_message``; refused (``SettlementLost``) when the lock was
  already reported lost by the lock renewer, so a result is never completed on
  a dead lock.
- ``nack(delay)``: ``abandon_message``: the entity re-offers the message at once
  with its delivery count + 1. Service Bus cannot delay an abandon, so a
  ``delay`` is served by holding the (renewed) lock that long, then abandoning;
  never past the lock renewal window, and not at all when renewal is off.
- ``dead_letter(reason)``: ``dead_letter_message(reason=..., error_description=...)``
  into the entity's ``$DeadLetterQueue``.

Any settlement the broker refuses (``MessageLockLostError``, a closed receiver,
a connection error) becomes :class:`~worker.errors.SettlementLost`: the lock
runs out, the message comes back, and the inbox absorbs whatever did commit.
The SDK says ``delivery_count == 0`` on a first delivery; the pump gets + 1.

Receiving runs in a loop of its own: the SDK retries internally and then
raises, and the loop recreates the client and receiver with jittered backoff,
reporting not-ready meanwhile. Sessions are not supported (see docs/servicebus.md).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, Self, cast

from azure.servicebus import (
    ServiceBusMessage,
    ServiceBusReceivedMessage,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus.aio import AutoLockRenewer, ServiceBusClient
from azure.servicebus.amqp import AmqpMessageBodyType
from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    MessageNotFoundError,
    MessageSizeExceededError,
    ServiceBusError,
    SessionLockLostError,
)
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.brokers import DeadLetterInfo, IdentityFunc, OutgoingMessage, load_identity
from worker.delivery import Delivery
from worker.errors import AlreadySettled, BrokerUnavailable, ConfigurationError, SettlementLost
from worker.logs import get_logger
from worker.retry import backoff
from worker.settings import load

if TYPE_CHECKING:
    from azure.servicebus.aio import ServiceBusReceiver

    from worker.settings import Settings

DEAD_LETTER_REASON = b"DeadLetterReason"
DEAD_LETTER_DESCRIPTION = b"DeadLetterErrorDescription"
_REASON_LIMIT = 256
_DESCRIPTION_LIMIT = 4096
_SEND_CHUNK = 100
_LOCK_LOST = (MessageLockLostError, SessionLockLostError, MessageNotFoundError)
_HOLD_MARGIN = 5.0  # a delayed nack abandons this long before lock renewal ends (at most)


class ServiceBusSettings(BaseSettings):
    """``WORKER_SERVICEBUS_*``: where to connect, what to read, how to hold locks."""

    model_config = SettingsConfigDict(env_prefix="WORKER_SERVICEBUS_", extra="ignore")

    connection_string: SecretStr | None = Field(
        None, description="A SAS connection string (or the emulator's). Or set NAMESPACE."
    )
    namespace: str | None = Field(
        None,
        description="Fully qualified namespace (x.servicebus.windows.net), authenticated with "
        "azure-identity's DefaultAzureCredential (pip install idempotent-worker[azure]).",
    )
    queue: str | None = Field(None, description="The queue to consume; or TOPIC + SUBSCRIPTION.")
    topic: str | None = None
    subscription: str | None = None
    prefetch: int | None = Field(
        None, ge=0, description="The SDK's prefetch_count; default: the pump's concurrency."
    )
    receive_batch: int | None = Field(
        None, ge=1, description="Most messages per receive call; default: every free slot."
    )
    receive_wait: float = Field(5.0, gt=0, description="max_wait_time of one receive call, s.")
    max_lock_renewal: float = Field(
        300.0, ge=0, description="Keep renewing a message's lock this long, s; 0 turns renewal off."
    )
    try_timeout: float = Field(
        30.0, gt=0, description="Bounds each SDK attempt, including the link open, s."
    )
    retry_total: int = Field(3, ge=0, description="The SDK's own retries before it raises.")
    reconnect_backoff: float = Field(0.5, gt=0, description="Base of the reconnect backoff, s.")
    reconnect_backoff_max: float = Field(30.0, gt=0, description="Cap of the reconnect backoff, s.")
    type_property: str = Field("type", description="Application property naming the type.")
    type_mapping: dict[str, str] = Field(
        default_factory=dict,
        description='Entity -> type for messages that name none: {"orders": "OrderPlaced"}.',
    )
    entity_max_delivery_count: int = Field(
        10, ge=1, description="The entity's MaxDeliveryCount: warn unless the pump's is below."
    )

    @property
    def entity(self) -> str:
        """The entity path, as it appears in logs and in ``type_mapping`` keys."""
        if self.queue:
            return self.queue
        return f"{self.topic}/{self.subscription}"

    @property
    def operation_bound(self) -> float:
        """Outer bound of one SDK call: every attempt timed out, plus the SDK's retry sleeps.

        The SDK sleeps 0.8 s * 2^n (at most 120 s) between its attempts by default.
        """
        sleeps = sum(min(0.8 * 2.0**n, 120.0) for n in range(self.retry_total))
        return self.try_timeout * (self.retry_total + 1) + sleeps + 1.0

    def check(self) -> Self:
        """Cross-field rules, raised as one line that never echoes the connection string."""
        if (self.connection_string is None) == (self.namespace is None):
            raise ConfigurationError(
                "set exactly one of WORKER_SERVICEBUS_CONNECTION_STRING "
                "and WORKER_SERVICEBUS_NAMESPACE"
            )
        if bool(self.queue) == bool(self.topic):
            raise ConfigurationError(
                "set exactly one of WORKER_SERVICEBUS_QUEUE and WORKER_SERVICEBUS_TOPIC"
            )
        if self.topic and not self.subscription:
            raise ConfigurationError("WORKER_SERVICEBUS_TOPIC needs WORKER_SERVICEBUS_SUBSCRIPTION")
        return self


# -- the slice of the SDK the adapter calls (a fake implements exactly this) ----


class Receiver(Protocol):
    async def __aenter__(self) -> Self: ...

    async def receive_messages(
        self, max_message_count: int | None = 1, max_wait_time: float | None = None
    ) -> list[ServiceBusReceivedMessage]: ...

    async def peek_messages(
        self, max_message_count: int = 1, *, sequence_number: int = 0
    ) -> list[ServiceBusReceivedMessage]: ...

    async def complete_message(self, message: ServiceBusReceivedMessage) -> None: ...

    async def abandon_message(self, message: ServiceBusReceivedMessage) -> None: ...

    async def dead_letter_message(
        self,
        message: ServiceBusReceivedMessage,
        reason: str | None = None,
        error_description: str | None = None,
    ) -> None: ...

    async def renew_message_lock(self, message: ServiceBusReceivedMessage) -> datetime: ...

    async def close(self) -> None: ...


class Sender(Protocol):
    async def send_messages(self, message: Any) -> None: ...

    async def close(self) -> None: ...


class Client(Protocol):
    def get_queue_receiver(self, queue_name: str, **kwargs: Any) -> Receiver: ...

    def get_subscription_receiver(
        self, topic_name: str, subscription_name: str, **kwargs: Any
    ) -> Receiver: ...

    def get_queue_sender(self, queue_name: str, **kwargs: Any) -> Sender: ...

    def get_topic_sender(self, topic_name: str, **kwargs: Any) -> Sender: ...

    async def close(self) -> None: ...


ClientFactory = Callable[[], Client]


class Connector:
    """Makes clients: from a connection string, or a namespace plus one shared credential."""

    def __init__(self, settings: ServiceBusSettings) -> None:
        self._settings = settings
        self._credential: Any = None
        if settings.connection_string is None:
            self._credential = _default_credential()

    def __call__(self) -> Client:
        settings = self._settings
        options: dict[str, Any] = {
            "retry_total": settings.retry_total,
            "try_timeout": settings.try_timeout,
        }
        if settings.connection_string is not None:
            secret = settings.connection_string.get_secret_value()
            return ServiceBusClient.from_connection_string(secret, **options)
        assert settings.namespace is not None
        return ServiceBusClient(settings.namespace, self._credential, **options)

    async def close(self) -> None:
        if self._credential is not None:
            await self._credential.close()


def _default_credential() -> Any:
    try:
        identity = importlib.import_module("azure.identity.aio")
    except ImportError:
        raise ConfigurationError(
            "WORKER_SERVICEBUS_NAMESPACE needs azure-identity: "
            "pip install 'idempotent-worker[azure]'"
        ) from None
    return identity.DefaultAzureCredential()


# -- reading a received message --------------------------------------------------


def default_message_id(message: ServiceBusReceivedMessage) -> str | None:
    """Service Bus ``MessageId``; AMQP allows a uuid or a number there too, so it is str()-ed."""
    message_id = message.message_id
    if message_id is None or message_id == "":
        return None
    return str(message_id)


def _text(value: Any) -> Any:
    """Keys and string values come back from the wire as bytes."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    return value


def application_properties(message: ServiceBusReceivedMessage) -> dict[str, Any]:
    return {str(_text(k)): _text(v) for k, v in (message.application_properties or {}).items()}


def body_of(message: ServiceBusReceivedMessage) -> bytes:
    """The payload: data sections joined; a str or bytes AMQP value as is."""
    if message.body_type == AmqpMessageBodyType.DATA:
        return b"".join(message.body)
    value = message.body
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return repr(value).encode()  # a sequence or a structured value: the pump rejects it as invalid


class TypeResolver:
    """Message type: an application property, else the subject, else the entity's mapping."""

    def __init__(self, settings: ServiceBusSettings) -> None:
        self._keys = (settings.type_property.encode(), settings.type_property)
        mapping = settings.type_mapping
        candidates = [settings.entity, settings.topic or settings.queue or ""]
        self._fallback = next((mapping[c] for c in candidates if c in mapping), None)

    def __call__(self, message: ServiceBusReceivedMessage) -> str | None:
        properties = message.application_properties or {}
        for key in self._keys:
            value = properties.get(key)
            if value:
                return str(_text(value))
        return message.subject or self._fallback


# -- the consumer ----------------------------------------------------------------


class _Link:
    """One client and its receiver; retired links stay open until their messages settle."""

    __slots__ = ("client", "receiver", "retired", "unsettled")

    def __init__(self, client: Client, receiver: Receiver) -> None:
        self.client = client
        self.receiver = receiver
        self.unsettled = 0
        self.retired = False


class _Lock:
    """The settlement handle: one locked message and the receiver that holds its lock."""

    __slots__ = ("done", "later", "link", "lost", "message", "message_id", "received", "renewer")

    def __init__(
        self, link: _Link, message: ServiceBusReceivedMessage, message_id: str | None
    ) -> None:
        self.link = link
        self.message = message
        self.message_id = message_id
        self.received = time.monotonic()  # when the renewer's max_lock_renewal clock started
        self.lost: str | None = None
        self.done = False
        self.renewer: AutoLockRenewer | None = None
        self.later: asyncio.Task[None] | None = None  # a delayed abandon, while it waits


class ServiceBusConsumer:
    """The pump's :class:`~worker.brokers.Broker` for one queue or subscription."""

    name = "servicebus"

    def __init__(
        self,
        settings: ServiceBusSettings,
        client_factory: ClientFactory,
        *,
        identity: IdentityFunc = default_message_id,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.stats: Counter[str] = Counter()
        self._factory = client_factory
        self._identity = identity
        self._type_of = TypeResolver(settings)
        self._on_close = on_close
        self._log = get_logger(broker="servicebus", entity=settings.entity)
        self._inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        self._link: _Link | None = None
        self._links: set[_Link] = set()
        self._locks: set[_Lock] = set()
        self._credit = asyncio.Event()
        self._limit = 1
        self._loop_task: asyncio.Task[None] | None = None
        self._later: set[asyncio.Task[None]] = set()
        self._renewals_ending: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._closed = False
        self._ready = False

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def unsettled(self) -> int:
        """Messages this consumer holds locks on: handed to the pump or waiting to be."""
        return len(self._locks)

    async def start(self, prefetch: int) -> None:
        """Open the first receiver (failing is a one-line error), then receive in the background."""
        self._limit = prefetch
        try:
            self._link = await self._connect()
        except Exception as exc:
            raise BrokerUnavailable(
                f"Service Bus entity {self.settings.entity}: {_describe(exc)}"
            ) from None
        self._ready = True
        self._loop_task = asyncio.create_task(self._receive_loop(), name="servicebus-receive")

    async def receive(self) -> Delivery:
        return await self._inbox.get()

    async def stop_receiving(self) -> None:
        """Stop the receive loop; messages fetched but not yet taken are abandoned at once."""
        self._stopping = True
        self._ready = False
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        while not self._inbox.empty():
            handle: _Lock = self._inbox.get_nowait()._handle
            await self._give_back(handle)

    async def close(self) -> None:
        """Give back what the pump left unsettled, then close renewer, receivers, clients."""
        if self._closed:
            return
        await self.stop_receiving()
        self._closed = True
        for task in list(self._later):
            task.cancel()  # a delayed abandon: abandon now instead
        await asyncio.gather(*self._later, return_exceptions=True)
        await asyncio.gather(*(self._give_back(h) for h in list(self._locks) if not h.done))
        await asyncio.gather(*self._renewals_ending)
        for link in list(self._links):
            await self._close_link(link)
        if self._on_close is not None:
            await self._on_close()
        self._log.info("servicebus consumer closed", **dict(self.stats))

    # -- receiving ----------------------------------------------------------------

    async def _connect(self) -> _Link:
        settings = self.settings
        client = self._factory()
        options: dict[str, Any] = {
            "receive_mode": ServiceBusReceiveMode.PEEK_LOCK,
            "prefetch_count": self._limit if settings.prefetch is None else settings.prefetch,
        }
        receiver: Receiver
        if settings.queue:
            receiver = client.get_queue_receiver(settings.queue, **options)
        else:
            assert settings.topic and settings.subscription
            receiver = client.get_subscription_receiver(
                settings.topic, settings.subscription, **options
            )
        try:
            # try_timeout bounds each attempt inside the SDK; this bounds the whole open,
            # which can otherwise hang when the broker rejects the $cbs auth link.
            async with asyncio.timeout(settings.operation_bound):
                await receiver.__aenter__()
        except BaseException:
            await _quietly(receiver.close())
            await _quietly(client.close())
            raise
        link = _Link(client, receiver)
        self._links.add(link)
        self._log.info("servicebus receiver open", prefetch=options["prefetch_count"])
        return link

    async def _receive_loop(self) -> None:
        failures = 0
        while not self._stopping:
            try:
                if self._link is None:
                    self._link = await self._connect()
                    self._ready = True
                    self.stats["reconnected"] += 1
                    self._log.info("servicebus reconnected", attempt=failures)
                await self._receive_batch(self._link)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the SDK gave up; so does this receiver, not the loop
                failures += 1
                self._ready = False
                self.stats["receive_failed"] += 1
                if self._link is not None:
                    await self._retire(self._link)
                    self._link = None
                delay = backoff(
                    failures, self.settings.reconnect_backoff, self.settings.reconnect_backoff_max
                )
                self._log.warning(
                    "servicebus receive failed, reconnecting",
                    error=_describe(exc),
                    attempt=failures,
                    retry_in_s=round(delay, 2),
                )
                await asyncio.sleep(delay)

    async def _receive_batch(self, link: _Link) -> None:
        while len(self._locks) >= self._limit:
            self._credit.clear()
            await self._credit.wait()
        want = self._limit - len(self._locks)
        if self.settings.receive_batch is not None:
            want = min(want, self.settings.receive_batch)
        wait = self.settings.receive_wait
        async with asyncio.timeout(wait + self.settings.operation_bound):
            messages = await link.receiver.receive_messages(
                max_message_count=want, max_wait_time=wait
            )
        for message in messages:
            self._accept(link, message)

    def _accept(self, link: _Link, message: ServiceBusReceivedMessage) -> None:
        try:
            message_id = self._identity(message)
        except Exception as exc:  # a deployment's id function must not sink the whole batch
            self.stats["identity_failed"] += 1
            self._log.warning(
                "message id function failed",
                error=_describe(exc),
                broker_message_id=default_message_id(message),
                sequence_number=message.sequence_number,
                delivery_count=(message.delivery_count or 0) + 1,
                outcome="no-message-id",
            )
            message_id = None  # the pump dead-letters it: "no message id"
        handle = _Lock(link, message, message_id)
        link.unsettled += 1
        self._locks.add(handle)
        if self.settings.max_lock_renewal > 0:
            # One renewer per message, so that renewal stops the moment the message is
            # settled or given up on, whatever the settlement's outcome: the SDK's renewer
            # has no way to drop one message, and would otherwise hold a message whose
            # complete failed for up to max_lock_renewal.
            handle.renewer = AutoLockRenewer(
                max_lock_renewal_duration=self.settings.max_lock_renewal,
                on_lock_renew_failure=functools.partial(self._renewal_failed, handle),
            )
            # The renewer only calls renew_message_lock on the receiver it is given.
            handle.renewer.register(cast("ServiceBusReceiver", link.receiver), message)
        count = (message.delivery_count or 0) + 1  # the SDK counts from 0
        delivery = Delivery(
            message_id,
            self._type_of(message),
            body_of(message),
            application_properties(message),
            count,
            self,
            handle,
        )
        self._inbox.put_nowait(delivery)

    async def _renewal_failed(
        self, handle: _Lock, _renewable: Any, error: Exception | None
    ) -> None:
        """The renewer gave up on a lock still in use: whatever the handler does, no complete.

        A delayed nack waiting on that lock holds nothing any more: the entity re-offers
        the message on its own, so the wait ends here and the slot is free again.
        """
        if handle.done:
            return
        handle.lost = (
            _describe(error) if error is not None else "lock expired before it was renewed"
        )
        self.stats["lock_lost"] += 1
        later, handle.later = handle.later, None
        self._log.warning(
            "servicebus lock lost while processing",
            message_id=handle.message_id,
            delivery_count=(handle.message.delivery_count or 0) + 1,
            error=handle.lost,
            retry_delay_dropped=later is not None,
            outcome="lock-lost",
        )
        if later is not None:
            await self._finish(handle)  # first: the cancelled wait then abandons nothing
            later.cancel()

    async def _retire(self, link: _Link) -> None:
        """Stop using a receiver; keep it open while its messages can still be settled."""
        link.retired = True
        if link.unsettled == 0:
            await self._close_link(link)

    async def _close_link(self, link: _Link) -> None:
        self._links.discard(link)
        await _quietly(link.receiver.close())
        await _quietly(link.client.close())

    # -- Settler ------------------------------------------------------------------

    async def ack(self, handle: _Lock) -> None:
        if handle.lost is not None:
            await self._finish(handle)
            raise SettlementLost(f"message {handle.message_id!r}: not completed, {handle.lost}")
        await self._settle(handle, "complete", handle.link.receiver.complete_message)

    async def nack(self, handle: _Lock, delay: float | None, counted: bool = True) -> None:
        hold = self._hold_for(handle, delay) if delay and delay > 0 and not self._closed else 0
        if hold > 0:
            task = asyncio.create_task(self._abandon_later(handle, hold))
            handle.later = task
            self._later.add(task)
            task.add_done_callback(self._later.discard)
            return
        await self._settle(handle, "abandon", handle.link.receiver.abandon_message)

    def _hold_for(self, handle: _Lock, delay: float) -> float:
        """How long a delayed nack may keep the lock: only while the renewer still renews it.

        Past ``max_lock_renewal`` the lock expires unseen and the entity re-offers the
        message while this consumer would still count it against its slots.
        """
        window = self.settings.max_lock_renewal
        left = 0.0  # renewal off, or the lock already lost: abandon at once
        if window > 0 and handle.lost is None:
            left = handle.received + window - min(_HOLD_MARGIN, window / 4) - time.monotonic()
        hold = max(0.0, min(delay, left))
        if hold < delay:
            self.stats["retry_delay_capped"] += 1
            self._log.info(
                "servicebus retry delay cut to the lock renewal window",
                message_id=handle.message_id,
                delivery_count=(handle.message.delivery_count or 0) + 1,
                delay_s=delay,
                held_s=round(hold, 2),
                outcome="retry",
            )
        return hold

    async def dead_letter(self, handle: _Lock, reason: str) -> None:
        count = (handle.message.delivery_count or 0) + 1
        description = f"dead-lettered by the worker on delivery {count}: {reason}"

        async def dead_letter(message: ServiceBusReceivedMessage) -> None:
            await handle.link.receiver.dead_letter_message(
                message,
                reason=reason[:_REASON_LIMIT],
                error_description=description[:_DESCRIPTION_LIMIT],
            )

        await self._settle(handle, "dead-letter", dead_letter)

    async def _abandon_later(self, handle: _Lock, hold: float) -> None:
        try:
            await asyncio.sleep(hold)  # the renewer keeps the lock meanwhile
        finally:
            handle.later = None
            await self._give_back(handle)

    async def _give_back(self, handle: _Lock) -> None:
        """Abandon without a caller to tell: a failure only means the lock runs out instead."""
        if handle.done:
            return
        try:
            await self._settle(handle, "abandon", handle.link.receiver.abandon_message)
            self.stats["given_back"] += 1
        except (SettlementLost, AlreadySettled) as exc:
            self._log.info(
                "servicebus give-back failed, lock will expire",
                message_id=handle.message_id,
                error=str(exc),
            )

    async def _settle(
        self,
        handle: _Lock,
        verb: str,
        operation: Callable[[ServiceBusReceivedMessage], Awaitable[None]],
    ) -> None:
        try:
            async with asyncio.timeout(self.settings.operation_bound):
                await operation(handle.message)
        except MessageAlreadySettled:  # a ValueError, not a ServiceBusError
            raise AlreadySettled(f"message {handle.message_id!r} was already settled") from None
        except _LOCK_LOST as exc:
            self.stats["settlement_lost"] += 1
            raise SettlementLost(
                f"message {handle.message_id!r}: {verb}: lock lost: {_describe(exc)}"
            ) from None
        except (ServiceBusError, ValueError, TimeoutError) as exc:  # ValueError: receiver closed
            self.stats["settlement_lost"] += 1
            raise SettlementLost(
                f"message {handle.message_id!r}: {verb} failed: {_describe(exc)}"
            ) from None
        finally:
            await self._finish(handle)

    async def _finish(self, handle: _Lock) -> None:
        if handle.done:
            return
        handle.done = True
        self._locks.discard(handle)
        self._credit.set()
        if handle.renewer is not None:
            # close() stops renewing at once but waits for the renewer's 1 s tick: not here.
            ending = asyncio.create_task(handle.renewer.close())
            self._renewals_ending.add(ending)
            ending.add_done_callback(self._renewals_ending.discard)
        link = handle.link
        link.unsettled -= 1
        if link.retired and link.unsettled == 0 and link in self._links:
            await self._close_link(link)


# -- operator tools --------------------------------------------------------------


class ServiceBusAdmin:
    """``worker publish`` and ``worker dlq`` for one queue or topic subscription.

    Re-submitting from a subscription's dead-letter queue publishes to the topic,
    so every subscription gets the copy: the others' inboxes drop it only if they
    deduplicate by message id too.
    """

    def __init__(
        self,
        settings: ServiceBusSettings,
        client_factory: ClientFactory,
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self._factory = client_factory
        self._on_close = on_close
        self._client: Client | None = None
        self._type_of = TypeResolver(settings)

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = self._factory()
        return self._client

    def _sender(self) -> Sender:
        settings = self.settings
        if settings.queue:
            return self.client.get_queue_sender(settings.queue)
        assert settings.topic is not None
        return self.client.get_topic_sender(settings.topic)

    def _dead_letter_receiver(self) -> Receiver:
        settings = self.settings
        options: dict[str, Any] = {"sub_queue": ServiceBusSubQueue.DEAD_LETTER}
        if settings.queue:
            return self.client.get_queue_receiver(settings.queue, **options)
        assert settings.topic and settings.subscription
        return self.client.get_subscription_receiver(
            settings.topic, settings.subscription, **options
        )

    def outgoing(self, message: OutgoingMessage) -> ServiceBusMessage:
        properties: dict[str | bytes, Any] = {k: _simple(v) for k, v in message.headers.items()}
        properties[self.settings.type_property] = message.type
        outgoing = ServiceBusMessage(
            message.body,
            message_id=message.message_id,
            subject=message.type,
            content_type="application/json",
            application_properties=properties,
        )
        # The SDK invents a random id when none is given; a line without an id must
        # stay without one (the pump dead-letters it, as on every other broker).
        outgoing.message_id = message.message_id
        return outgoing

    async def publish(self, messages: list[OutgoingMessage]) -> int:
        return await self.send([self.outgoing(m) for m in messages])

    async def send(self, messages: list[ServiceBusMessage]) -> int:
        sender = self._sender()
        try:
            for start in range(0, len(messages), _SEND_CHUNK):
                chunk = messages[start : start + _SEND_CHUNK]
                try:
                    await sender.send_messages(chunk)
                except MessageSizeExceededError:  # the chunk is over the batch limit: one by one
                    for message in chunk:
                        await sender.send_messages(message)
        finally:
            await sender.close()
        return len(messages)

    async def dead_letters(self, limit: int) -> list[DeadLetterInfo]:
        receiver = self._dead_letter_receiver()
        letters: list[DeadLetterInfo] = []
        try:
            await receiver.__aenter__()
            sequence = 0
            while len(letters) < limit:
                page = await receiver.peek_messages(
                    min(100, limit - len(letters)), sequence_number=sequence
                )
                if not page:
                    break
                letters.extend(self._info(message) for message in page)
                sequence = (page[-1].sequence_number or 0) + 1
        finally:
            await receiver.close()
        return letters[:limit]

    def _info(self, message: ServiceBusReceivedMessage) -> DeadLetterInfo:
        reason = message.dead_letter_reason or "unknown"
        if message.dead_letter_error_description:
            reason = f"{reason}: {message.dead_letter_error_description}"
        return DeadLetterInfo(
            default_message_id(message),
            self._type_of(message),
            reason,
            body_of(message),
            application_properties(message),
        )

    async def resubmit(self, limit: int) -> int:
        """Copy each dead letter to the entity, then complete it: a crash in between duplicates."""
        receiver = self._dead_letter_receiver()
        moved = 0
        try:
            await receiver.__aenter__()
            while moved < limit:
                batch = await receiver.receive_messages(
                    min(_SEND_CHUNK, limit - moved), max_wait_time=self.settings.receive_wait
                )
                if not batch:
                    break
                await self.send([_copy(message) for message in batch])
                for message in batch:
                    await receiver.complete_message(message)
                moved += len(batch)
        finally:
            await receiver.close()
        return moved

    async def close(self) -> None:
        if self._client is not None:
            await _quietly(self._client.close())
        if self._on_close is not None:
            await self._on_close()


def _copy(message: ServiceBusReceivedMessage) -> ServiceBusMessage:
    properties: dict[str | bytes, Any] = {
        k: v
        for k, v in application_properties(message).items()
        if k.encode() not in (DEAD_LETTER_REASON, DEAD_LETTER_DESCRIPTION)
    }
    return ServiceBusMessage(
        body_of(message),
        message_id=default_message_id(message),
        subject=message.subject,
        content_type=message.content_type,
        correlation_id=message.correlation_id,
        application_properties=properties,
    )


def _simple(value: Any) -> Any:
    """Application property values must be simple AMQP types."""
    if value is None or isinstance(value, str | bytes | int | float | bool):
        return value
    return json.dumps(value, default=str)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def _quietly(closing: Awaitable[Any]) -> None:
    """Close something that may already be broken; there is nobody to report a failure to."""
    try:
        async with asyncio.timeout(10.0):
            await closing
    except Exception:  # a broken connection fails its own close
        pass


# -- module entry points ---------------------------------------------------------


def load_settings() -> ServiceBusSettings:
    return load(ServiceBusSettings).check()


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


__all__ = [
    "Client",
    "ClientFactory",
    "Connector",
    "Receiver",
    "Sender",
    "ServiceBusAdmin",
    "ServiceBusConsumer",
    "ServiceBusSettings",
    "default_message_id",
    "open_admin",
    "open_broker",
]
