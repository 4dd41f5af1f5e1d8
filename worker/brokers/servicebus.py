"""Azure Service Bus through azure-servicebus's asyncio client, in PEEK_LOCK mode.

Verb mapping:

- ``ack``: ``complete_message``; refused (``SettlementLost``) when the lock was
  already reported lost by the lock renewer, so a result is never completed on
  a dead lock.
- ``nack(delay)``: ``abandon_message``: the entity re-offers the message at once
  with its delivery count + 1. Service Bus cannot delay an abandon, so a
  ``delay`` is served by holding the (renewed) lock that long, then abandoning;
  never past the lock renewal window, and not at all when renewal is off.
- ``nack(counted=False)`` (the message is not to blame): ``abandon_message`` would
  count, so a copy carrying the count so far in ``x-worker-deliveries`` is sent to
  the queue, confirmed, and only then is the original completed. The same happens
  to fetched messages the pump never took, at shutdown, and to any message still
  unsettled when its lock renewal ends. On a topic subscription a copy would reach
  every subscription, so there it is a (counted) abandon.
- ``dead_letter(reason)``: ``dead_letter_message(reason=..., error_description=...)``
  into the entity's ``$DeadLetterQueue``.

Any settlement the broker refuses (``MessageLockLostError``, a closed receiver,
a connection error) becomes :class:`~worker.errors.SettlementLost`: the lock
runs out, the message comes back, and the inbox absorbs whatever did commit.
The pump's delivery count is the SDK's ``delivery_count`` (0 on a first delivery)
+ 1, + the carried ``x-worker-deliveries`` when the worker's own copy set it: the
copy's enqueued time (the broker's clock) must be within the send's bound of the
``x-worker-copied-at`` stamped on it, so a dead letter an operator moves back later
starts from 1. Receiving compares each message's enqueued and locked-until times
with the local clock and logs a skew the lock checks would trip over.

Receiving runs in a loop of its own: the SDK retries internally and then
raises, and the loop recreates the client and receiver with jittered backoff,
reporting not-ready meanwhile. Sessions are not supported (see docs/servicebus.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
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

from worker.brokers import (
    DEFAULT_SCAN,
    DeadLetterFilter,
    DeadLetterInfo,
    IdentityFunc,
    OutgoingMessage,
    load_identity,
)
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
_MAX_LOCK_DURATION = 300.0  # Service Bus's longest lock duration, s
_SKEW_LOG_EVERY = 60.0  # one clock-skew warning a minute; the counter counts every message
DELIVERIES_PROPERTY = "x-worker-deliveries"  # deliveries spent before an uncounted give-back
COPIED_AT_PROPERTY = "x-worker-copied-at"  # epoch ms (a string) when the worker sent that copy
_WORKER_PROPERTIES = (DELIVERIES_PROPERTY, COPIED_AT_PROPERTY)


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
    clock_skew_tolerance: float = Field(
        30.0,
        gt=0,
        description="Local clock vs the broker's: warn beyond this; a carried count is "
        "honoured only when its copy was enqueued within the send's bound plus this, s.",
    )
    give_back_timeout: float = Field(
        10.0, gt=0, description="Bounds the give-back of fetched, untaken messages at stop, s."
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


def _headers(message: ServiceBusReceivedMessage) -> dict[str, Any]:
    """What a handler sees: the application properties without the worker's own."""
    properties = application_properties(message)
    return {k: v for k, v in properties.items() if k not in _WORKER_PROPERTIES}


def _wall() -> float:
    """The local wall clock, the one the SDK's lock checks use (tests move it)."""
    return time.time()


def _given_back(message: ServiceBusReceivedMessage, spent: int) -> ServiceBusMessage:
    """The copy an uncounted give-back sends: the same message, plus the count so far."""
    properties: dict[str | bytes, Any] = {k: v for k, v in _headers(message).items()}
    properties[DELIVERIES_PROPERTY] = spent
    properties[COPIED_AT_PROPERTY] = str(int(_wall() * 1000))  # an int would overflow AMQP's
    copy = ServiceBusMessage(
        body_of(message),
        application_properties=properties,
        subject=message.subject,
        content_type=message.content_type,
        correlation_id=message.correlation_id,
        to=message.to,
        reply_to=message.reply_to,
        time_to_live=message.time_to_live,
    )
    copy.message_id = message.message_id  # as it was, None included (the SDK invents one)
    return copy


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

    __slots__ = ("client", "receiver", "retired", "sender", "unsettled")

    def __init__(self, client: Client, receiver: Receiver) -> None:
        self.client = client
        self.receiver = receiver
        self.sender: Sender | None = None  # for uncounted give-backs, opened on first use
        self.unsettled = 0
        self.retired = False


class _Lock:
    """The settlement handle: one locked message and the receiver that holds its lock."""

    __slots__ = (
        "count",
        "done",
        "later",
        "link",
        "lost",
        "message",
        "message_id",
        "received",
        "reclaimed",
        "released",
        "renewer",
        "settling",
        "taken",
        "withdraw",
    )

    def __init__(
        self, link: _Link, message: ServiceBusReceivedMessage, message_id: str | None, count: int
    ) -> None:
        self.link = link
        self.message = message
        self.message_id = message_id
        self.count = count  # the pump's delivery count, from 1
        self.received = time.monotonic()  # when the renewer's max_lock_renewal clock started
        self.lost: str | None = None
        self.done = False  # nothing more to do with it (settled, or settling failed)
        self.released = False  # the broker took the settlement
        self.settling = False  # the pump asked for a settlement
        self.reclaimed = False  # given back by this consumer while the pump still held it
        self.taken = False  # handed to the pump; until then this consumer may give it back
        self.renewer: AutoLockRenewer | None = None
        self.later: asyncio.Task[None] | None = None  # a delayed abandon, while it waits
        self.withdraw: asyncio.TimerHandle | None = None  # give back before renewal ends


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
        self._returning: set[asyncio.Task[None]] = set()  # untaken, given back before renewal ends
        self._renewals_ending: set[asyncio.Task[None]] = set()
        self._skew_logged = -_SKEW_LOG_EVERY
        self.clock_skew = 0.0  # the last skew seen (local minus broker, a lower bound), s
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
        delivery = await self._inbox.get()
        handle: _Lock = delivery._handle
        handle.taken = True
        return delivery

    async def stop_receiving(self) -> None:
        """Stop the receive loop; fetched messages the pump never took go back uncounted.

        All of them at once, under one deadline (``give_back_timeout``), because the
        pump's grace period starts only after this returns. Whatever is not back by
        then keeps its lock until it runs out, and comes back counted.
        """
        self._stopping = True
        self._ready = False
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        waiting: list[_Lock] = []
        while not self._inbox.empty():
            handle: _Lock = self._inbox.get_nowait()._handle
            if handle.withdraw is not None:
                handle.withdraw.cancel()
                handle.withdraw = None
            if not handle.done:
                waiting.append(handle)
        if not waiting:
            return
        try:
            async with asyncio.timeout(self.settings.give_back_timeout):
                await self._return_uncounted(waiting)
        except TimeoutError:
            left = [h for h in waiting if not h.released]
            self.stats["give_back_timed_out"] += len(left)
            self._log.warning(
                "servicebus give-back at stop cut short, the rest come back when their locks "
                "run out",
                given_back=len(waiting) - len(left),
                left=len(left),
                timeout_s=self.settings.give_back_timeout,
            )

    async def close(self) -> None:
        """Give back what the pump left unsettled, then close renewer, receivers, clients."""
        if self._closed:
            return
        await self.stop_receiving()
        self._closed = True
        for task in list(self._later):
            task.cancel()  # a delayed abandon: abandon now instead
        await asyncio.gather(*self._later, return_exceptions=True)
        await asyncio.gather(*self._returning, return_exceptions=True)
        # What the pump cancelled after its grace period: counted, as its lock expiry would
        # be (the adapter cannot tell a slow handler from a hung one).
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
        self._check_clock(message, message_id)
        count = self._carried(message, message_id) + (message.delivery_count or 0) + 1
        handle = _Lock(link, message, message_id, count)
        link.unsettled += 1
        self._locks.add(handle)
        window = self.settings.max_lock_renewal
        if window > 0:
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
            # A message still unsettled when renewal ends (the pump paused by a database
            # outage, a delivery parked behind its key) would lose its lock and come
            # back counted.
            handle.withdraw = asyncio.get_running_loop().call_later(
                window - min(_HOLD_MARGIN, window / 4), self._withdraw, handle
            )
        delivery = Delivery(
            message_id,
            self._type_of(message),
            body_of(message),
            _headers(message),
            count,
            self,
            handle,
        )
        self._inbox.put_nowait(delivery)

    def _carried(self, message: ServiceBusReceivedMessage, message_id: str | None) -> int:
        """Deliveries spent before the worker's own uncounted give-back, else 0.

        Honoured only on the copy the worker sent: its enqueued time (the broker's
        clock) lies within one send's bound of the stamp the sender put on it. A dead
        letter moved back by an operator tool, with the properties copied, is enqueued
        later than that and starts from 1 again.
        """
        properties = message.application_properties or {}
        raw = properties.get(DELIVERIES_PROPERTY.encode(), properties.get(DELIVERIES_PROPERTY))
        if raw is None:
            return 0
        stamp = properties.get(COPIED_AT_PROPERTY.encode(), properties.get(COPIED_AT_PROPERTY))
        enqueued = message.enqueued_time_utc
        try:
            carried, copied_at = int(_text(raw)), int(_text(stamp)) / 1000
        except (TypeError, ValueError):
            carried, copied_at = -1, 0.0
        tolerance = self.settings.clock_skew_tolerance
        if carried >= 0 and enqueued is not None:
            lag = enqueued.timestamp() - copied_at
            if -tolerance <= lag <= self.settings.operation_bound + tolerance:
                return carried
        self.stats["carried_count_ignored"] += 1
        self._log.info(
            "servicebus carried delivery count ignored: not the worker's own give-back",
            message_id=message_id,
            carried=_text(raw),
            copied_at=_text(stamp),
            enqueued=enqueued.isoformat() if enqueued is not None else None,
        )
        return 0

    def _check_clock(self, message: ServiceBusReceivedMessage, message_id: str | None) -> None:
        """Compare the broker's timestamps with the local clock, which the SDK's lock checks use.

        A local clock ahead of the broker's makes the SDK refuse settlements on locks
        it believes expired (``locked_until_utc`` already past); one behind makes the
        renewer renew too late. Neither is proven by one message, but each bound is.
        """
        now = _wall()
        tolerance = self.settings.clock_skew_tolerance
        skew = 0.0  # local minus broker, at least: > 0 ahead, < 0 behind
        enqueued = message.enqueued_time_utc
        if enqueued is not None and enqueued.timestamp() - now > tolerance:
            skew = now - enqueued.timestamp()  # enqueued in the local future
        locked = message.locked_until_utc
        if locked is not None:
            left = locked.timestamp() - now
            if left <= 0:
                skew = -left  # the lock looks expired the moment it arrives
            elif left > _MAX_LOCK_DURATION + tolerance:
                skew = min(skew, _MAX_LOCK_DURATION - left)  # longer than any lock can be
        if skew == 0.0:
            return
        self.stats["clock_skew"] += 1
        self.clock_skew = skew
        if time.monotonic() - self._skew_logged < _SKEW_LOG_EVERY:
            return
        self._skew_logged = time.monotonic()
        self._log.warning(
            "servicebus clock skew: the local clock disagrees with the broker's",
            skew_s=round(skew, 1),
            local_clock="ahead" if skew > 0 else "behind",
            message_id=message_id,
            enqueued=enqueued.isoformat() if enqueued is not None else None,
            locked_until=locked.isoformat() if locked is not None else None,
            outcome="clock-skew",
        )

    def _withdraw(self, handle: _Lock) -> None:
        """Renewal is about to end on an unsettled message: give it back uncounted.

        Untaken, it simply leaves the inbox. Taken, the pump still holds it (paused
        by the database, or a handler past the window): the copy goes back, and the
        pump's settlement is then refused as lost, as it would be on the expired
        lock; if the handler had committed, the inbox absorbs the copy.
        """
        handle.withdraw = None
        if handle.done or handle.settling or self._closed:
            return
        if not handle.taken:
            if self._stopping:
                return  # stop_receiving gives it back with the rest
            kept: list[Delivery] = []
            while not self._inbox.empty():  # bounded by the inbox's size; no await in between
                delivery = self._inbox.get_nowait()
                if delivery._handle is not handle:
                    kept.append(delivery)
            for delivery in kept:
                self._inbox.put_nowait(delivery)
        else:
            handle.reclaimed = True
            self.stats["reclaimed"] += 1
            self._log.warning(
                "servicebus lock renewal ending on a delivery the pump still holds: "
                "given back uncounted, its settlement will be refused",
                message_id=handle.message_id,
                delivery_count=handle.count,
                held_s=round(time.monotonic() - handle.received, 1),
                outcome="reclaimed",
            )
        self.stats["withdrawn"] += 1
        task = asyncio.create_task(self._return_quietly([handle]))
        self._returning.add(task)
        task.add_done_callback(self._returning.discard)

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
            delivery_count=handle.count,
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
        if link.sender is not None:
            await _quietly(link.sender.close())
        await _quietly(link.receiver.close())
        await _quietly(link.client.close())

    # -- Settler ------------------------------------------------------------------

    def _refuse_reclaimed(self, handle: _Lock, verb: str) -> None:
        handle.settling = True
        if handle.reclaimed:
            self.stats["settlement_lost"] += 1
            raise SettlementLost(
                f"message {handle.message_id!r}: not {verb}, given back before its lock "
                "renewal ended"
            )

    async def ack(self, handle: _Lock) -> None:
        self._refuse_reclaimed(handle, "completed")
        if handle.lost is not None:
            await self._finish(handle)
            raise SettlementLost(f"message {handle.message_id!r}: not completed, {handle.lost}")
        await self._settle(handle, "complete", handle.link.receiver.complete_message)

    async def nack(self, handle: _Lock, delay: float | None, counted: bool = True) -> None:
        self._refuse_reclaimed(handle, "abandoned")
        hold = self._hold_for(handle, delay) if delay and delay > 0 and not self._closed else 0
        if hold > 0:
            task = asyncio.create_task(self._abandon_later(handle, hold, counted))
            handle.later = task
            self._later.add(task)
            task.add_done_callback(self._later.discard)
            return
        if counted:
            await self._settle(handle, "abandon", handle.link.receiver.abandon_message)
            return
        [error] = await self._return_uncounted([handle])
        if error is not None:
            raise error

    async def _return_uncounted(self, handles: list[_Lock]) -> list[SettlementLost | None]:
        """Give messages back without spending a delivery: copies first, then the originals.

        Each copy carries the deliveries spent so far and is confirmed by the broker
        before its original is completed, so a failure in between leaves a duplicate
        (the inbox drops it), never a loss. What cannot be copied (a topic
        subscription, a lock known lost, a refused send) is abandoned instead, which
        counts. Returns, per handle, the settlement error or None.
        """
        copyable = [h for h in handles if h.lost is None] if self.settings.queue else []
        sent = await self._send_copies(copyable)
        results = await asyncio.gather(
            *(
                self._settle(h, "complete", h.link.receiver.complete_message)
                if h in sent
                else self._settle(h, "abandon", h.link.receiver.abandon_message)
                for h in handles
            ),
            return_exceptions=True,
        )
        errors: list[SettlementLost | None] = []
        for result in results:
            if isinstance(result, SettlementLost | None):
                errors.append(result)
            elif isinstance(result, AlreadySettled):
                errors.append(SettlementLost(str(result)))
            else:
                raise result
        return errors

    async def _send_copies(self, handles: list[_Lock]) -> set[_Lock]:
        """Send each handle's give-back copy and wait for the broker; the confirmed ones."""
        sent: set[_Lock] = set()
        link = self._link if self._link is not None else (handles[0].link if handles else None)
        if link is None:
            return sent
        copies: dict[_Lock, ServiceBusMessage] = {}
        for handle in handles:
            try:
                copies[handle] = _given_back(handle.message, handle.count - 1)
            except ValueError as exc:  # an id the SDK refuses to send (over 128 characters)
                self._copy_failed([handle], exc)
        chunks = [list(copies)[n : n + _SEND_CHUNK] for n in range(0, len(copies), _SEND_CHUNK)]
        for chunk in chunks:
            try:
                async with asyncio.timeout(self.settings.operation_bound):
                    if link.sender is None:
                        assert self.settings.queue is not None
                        link.sender = link.client.get_queue_sender(self.settings.queue)
                    try:
                        await link.sender.send_messages([copies[h] for h in chunk])
                        sent.update(chunk)
                    except MessageSizeExceededError:  # over the batch limit: one by one
                        for handle in chunk:
                            try:
                                await link.sender.send_messages(copies[handle])
                                sent.add(handle)
                            except MessageSizeExceededError as exc:  # this one alone
                                self._copy_failed([handle], exc)
            except (ServiceBusError, ValueError, TimeoutError) as exc:  # ValueError: UTF-8
                self._copy_failed([h for h in chunk if h not in sent], exc)
        self.stats["given_back_uncounted"] += len(sent)
        return sent

    def _copy_failed(self, handles: list[_Lock], exc: Exception) -> None:
        self.stats["give_back_copy_failed"] += len(handles)
        self._log.warning(
            "servicebus uncounted give-back failed to send its copy, abandoning (counted)",
            message_ids=[h.message_id for h in handles],
            error=_describe(exc),
        )

    async def _return_quietly(self, handles: list[_Lock]) -> None:
        for handle, error in zip(handles, await self._return_uncounted(handles), strict=True):
            if error is not None:
                self._log.info(
                    "servicebus give-back failed, lock will expire",
                    message_id=handle.message_id,
                    error=str(error),
                )

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
                delivery_count=handle.count,
                delay_s=delay,
                held_s=round(hold, 2),
                outcome="retry",
            )
        return hold

    async def dead_letter(self, handle: _Lock, reason: str) -> None:
        self._refuse_reclaimed(handle, "dead-lettered")
        description = f"dead-lettered by the worker on delivery {handle.count}: {reason}"

        async def dead_letter(message: ServiceBusReceivedMessage) -> None:
            await handle.link.receiver.dead_letter_message(
                message,
                reason=reason[:_REASON_LIMIT],
                error_description=description[:_DESCRIPTION_LIMIT],
            )

        await self._settle(handle, "dead-letter", dead_letter)

    async def _abandon_later(self, handle: _Lock, hold: float, counted: bool) -> None:
        try:
            await asyncio.sleep(hold)  # the renewer keeps the lock meanwhile
        finally:
            handle.later = None
            if counted:
                await self._give_back(handle)
            elif not handle.done:
                await self._return_quietly([handle])

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
            handle.released = True
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
        if handle.withdraw is not None:
            handle.withdraw.cancel()
            handle.withdraw = None
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
        async with self._translated("publishing"):
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

    async def dead_letters(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> list[DeadLetterInfo]:
        """Peek (no lock, no delivery count) at up to ``scan`` dead letters; keep the matching."""
        receiver = self._dead_letter_receiver()
        letters: list[DeadLetterInfo] = []
        scanned = 0
        try:
            async with self._translated("peeking at dead letters"):
                await receiver.__aenter__()
                sequence = 0
                while len(letters) < limit and scanned < scan:
                    page = await receiver.peek_messages(
                        min(100, scan - scanned), sequence_number=sequence
                    )
                    if not page:
                        break
                    scanned += len(page)
                    found = (self._info(message) for message in page)
                    letters.extend(f for f in found if match is None or match(f))
                    sequence = (page[-1].sequence_number or 0) + 1
        finally:
            await _quietly(receiver.close())
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
            # Service Bus records no dead-letter time: the time the message was enqueued
            message.enqueued_time_utc,
        )

    async def resubmit(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> int:
        """Copy each matching dead letter to the entity, then complete it.

        A crash in between duplicates (the inbox absorbs it). Dead letters that do
        not match stay locked until the scan ends, then are abandoned: they keep
        their sequence numbers (their order), and their delivery count grows by one,
        which nothing acts on in a dead-letter queue.
        """
        receiver = self._dead_letter_receiver()
        moved = scanned = 0
        held: list[ServiceBusReceivedMessage] = []
        try:
            async with self._translated("re-submitting dead letters"):
                await receiver.__aenter__()
                while moved < limit and scanned < scan:
                    wanted = limit - moved if match is None else scan - scanned
                    batch = await receiver.receive_messages(
                        min(_SEND_CHUNK, wanted), max_wait_time=self.settings.receive_wait
                    )
                    if not batch:
                        break
                    scanned += len(batch)
                    chosen: list[ServiceBusReceivedMessage] = []
                    for message in batch:
                        wanted_more = moved + len(chosen) < limit
                        if wanted_more and (match is None or match(self._info(message))):
                            chosen.append(message)
                        else:
                            held.append(message)
                    if chosen:
                        await self.send([_copy(message) for message in chosen])
                        for message in chosen:
                            await receiver.complete_message(message)
                        moved += len(chosen)
        finally:
            for message in held:
                await _quietly(receiver.abandon_message(message))
            await _quietly(receiver.close())
        return moved

    @contextlib.asynccontextmanager
    async def _translated(self, what: str) -> AsyncIterator[None]:
        """Service Bus errors become :class:`BrokerUnavailable`, naming the entity."""
        try:
            yield
        except ServiceBusError as exc:
            entity = self.settings.queue or f"{self.settings.topic}/{self.settings.subscription}"
            raise BrokerUnavailable(f"service bus {entity!r}, {what}: {_describe(exc)}") from None

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
        and k not in _WORKER_PROPERTIES  # a resubmitted dead letter starts from delivery 1
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
