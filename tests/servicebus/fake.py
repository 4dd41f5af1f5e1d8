"""An in-memory Service Bus namespace for exactly the SDK surface the adapter calls.

Faithful where the adapter's correctness depends on it:

- Messages travel as AMQP bytes. A sender turns a ``ServiceBusMessage`` into the
  SDK's own outgoing AMQP message; on delivery the "broker" stamps the header
  (delivery count) and annotations (sequence number, enqueued time, locked-until),
  encodes it with the SDK's encoder and decodes it with the SDK's decoder into a
  real ``ServiceBusReceivedMessage``, whose lock token is the transfer's delivery
  tag, as on the wire. Application properties therefore come back with bytes keys
  and values, ids as str, and ``delivery_count`` is 0 on a first delivery. A send
  encodes each message at once, as the SDK does while batching, so what the SDK
  cannot encode (an int property over 32 bits) fails the send.
- Peek-lock on the real clock: a lock runs out after the entity's lock duration,
  the message becomes available again and the old lock token is dead; abandon
  re-offers at once; reaching MaxDeliveryCount moves the message to the
  dead-letter sub-queue with ``MaxDeliveryCountExceeded``.
- The receiver checks what the SDK's receiver checks, in its order: a closed
  receiver raises ``ValueError``; a settled message ``MessageAlreadySettled``; a
  lock past ``locked_until_utc`` ``MessageLockLostError`` (client side), and so
  does a lock token the entity no longer knows (server side). Renewing returns
  the new expiry and updates ``locked_until_utc``. The SDK's own
  ``AutoLockRenewer`` runs against it unchanged.
- Faults: :meth:`FakeServiceBus.fail` makes the next calls of one operation
  raise (``ServiceBusConnectionError`` by default); :meth:`FakeServiceBus.sever`
  cuts one client off the network for good, its locks left to expire, as a
  killed process would leave them.

Not modelled: sessions, deferral, scheduling, time-to-live, topic filters,
duplicate detection, transactions, and the link's prefetch buffer (locks are
taken when ``receive_messages`` returns; ``prefetch_count`` is recorded only).

The private SDK pieces used here are listed in :data:`SDK_PRIVATE_PIECES`;
``test_fake_fidelity.py`` fails loudly when any of them moves.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Self

from azure.servicebus import (
    ServiceBusMessage,
    ServiceBusReceivedMessage,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus._pyamqp._decode import decode_payload
from azure.servicebus._pyamqp._encode import encode_payload
from azure.servicebus._pyamqp.message import Header, Message
from azure.servicebus._pyamqp.performatives import TransferFrame
from azure.servicebus._pyamqp.types import TYPE, VALUE, AMQPTypes
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.amqp import AmqpAnnotatedMessage
from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    MessagingEntityNotFoundError,
    ServiceBusConnectionError,
)

SDK_VERSION = "7.15.0"
SDK_PRIVATE_PIECES = (
    "azure.servicebus._pyamqp._encode.encode_payload",
    "azure.servicebus._pyamqp._decode.decode_payload",
    "azure.servicebus._pyamqp.message.Header",
    "azure.servicebus._pyamqp.message.Message",
    "azure.servicebus._pyamqp.performatives.TransferFrame",
    "azure.servicebus._pyamqp.types.AMQPTypes",
    "azure.servicebus._transport._pyamqp_transport.PyamqpTransport.to_outgoing_amqp_message",
    "ServiceBusReceivedMessage(message, receive_mode, frame, receiver=, is_peeked_message=)",
    "ServiceBusReceivedMessage._settled / _expiry / _lock_expired / _is_peeked_message",
    "AutoLockRenewer reads receiver._running and message._receiver",
)

SEQUENCE_NUMBER = b"x-opt-sequence-number"
ENQUEUED_TIME = b"x-opt-enqueued-time"
LOCKED_UNTIL = b"x-opt-locked-until"
DEAD_LETTER_REASON = "DeadLetterReason"
DEAD_LETTER_DESCRIPTION = "DeadLetterErrorDescription"
MAX_DELIVERY_COUNT_EXCEEDED = "MaxDeliveryCountExceeded"
DEFAULT_RECEIVE_WAIT = 60.0  # the SDK's DEFAULT_RECEIVE_WAIT_TIME_SECS


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(slots=True)
class Stored:
    """A message at rest in an entity: the sender's AMQP message plus what the broker adds."""

    amqp: Message
    sequence_number: int
    enqueued_ms: int
    deliveries: int = 0  # times locked: the wire's delivery-count on the next delivery
    broker_properties: dict[str, str] = field(default_factory=dict)

    @property
    def message_id(self) -> Any:
        return self.amqp.properties.message_id if self.amqp.properties else None

    def encode(self, locked_until_ms: int | None) -> bytes:
        """The transfer payload as the broker would send it."""
        amqp = self.amqp
        header = amqp.header or Header()
        annotations: dict[Any, Any] = dict(amqp.message_annotations or {})
        annotations[SEQUENCE_NUMBER] = {TYPE: AMQPTypes.long, VALUE: self.sequence_number}
        annotations[ENQUEUED_TIME] = {TYPE: AMQPTypes.timestamp, VALUE: self.enqueued_ms}
        if locked_until_ms is not None:
            annotations[LOCKED_UNTIL] = {TYPE: AMQPTypes.timestamp, VALUE: locked_until_ms}
        properties = dict(amqp.application_properties or {})
        properties.update(self.broker_properties)
        stamped = amqp._replace(
            header=header._replace(delivery_count=self.deliveries),
            message_annotations=annotations,
            application_properties=properties or None,
        )
        return bytes(encode_payload(bytearray(), stamped))


@dataclass(slots=True, eq=False)
class Lock:
    token: uuid.UUID
    stored: Stored
    receiver: FakeReceiver
    until: float  # epoch seconds, the clock the SDK's locked_until_utc compares with
    timer: asyncio.TimerHandle | None = None

    @property
    def until_ms(self) -> int:
        return int(self.until * 1000)


@dataclass(slots=True)
class Fault:
    operation: str
    error: Callable[[], Exception] | None  # None: the call never returns
    times: int


class Entity:
    """A queue, a subscription, or a dead-letter sub-queue."""

    def __init__(
        self,
        path: str,
        *,
        lock_duration: float,
        max_delivery_count: int | None,
        dead_letter: Entity | None,
    ) -> None:
        self.path = path
        self.lock_duration = lock_duration
        self.max_delivery_count = max_delivery_count
        self.dead_letter = dead_letter
        self.stats: Counter[str] = Counter()
        self.locks: dict[uuid.UUID, Lock] = {}
        self._available: list[tuple[int, Stored]] = []
        self._sequence = itertools.count(1)
        self._wake = asyncio.Event()

    # -- what tests look at ------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._available)

    @property
    def locked(self) -> int:
        return len(self.locks)

    @property
    def count(self) -> int:
        """Messages in the entity: available plus locked (what the portal calls active)."""
        return self.active + self.locked

    def messages(self) -> list[Stored]:
        stored = [s for _, s in self._available] + [lock.stored for lock in self.locks.values()]
        return sorted(stored, key=lambda s: s.sequence_number)

    # -- broker side -------------------------------------------------------------

    def enqueue(self, amqp: Message) -> Stored:
        stored = Stored(amqp, next(self._sequence), _now_ms())
        self._offer(stored)
        self.stats["enqueued"] += 1
        return stored

    def _offer(self, stored: Stored) -> None:
        heapq.heappush(self._available, (stored.sequence_number, stored))
        self.wake()

    def wake(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def wait(self, seconds: float) -> None:
        """Until something is offered, or ``seconds`` pass."""
        wake = self._wake
        try:
            async with asyncio.timeout(seconds):
                await wake.wait()
        except TimeoutError:
            pass

    def take(self, count: int, receiver: FakeReceiver) -> list[Lock]:
        locks: list[Lock] = []
        loop = asyncio.get_running_loop()
        while self._available and len(locks) < count:
            _, stored = heapq.heappop(self._available)
            lock = Lock(uuid.uuid4(), stored, receiver, time.time() + self.lock_duration)
            lock.timer = loop.call_later(self.lock_duration, self._expire, lock)
            self.locks[lock.token] = lock
            locks.append(lock)
            self.stats["delivered"] += 1
            if stored.deliveries:
                self.stats["redelivered"] += 1
        return locks

    def remove(self, count: int) -> list[Stored]:
        """RECEIVE_AND_DELETE: gone as it is handed out."""
        taken: list[Stored] = []
        while self._available and len(taken) < count:
            taken.append(heapq.heappop(self._available)[1])
        return taken

    def _live(self, token: uuid.UUID | str | None) -> Lock:
        lock = self.locks.get(token) if isinstance(token, uuid.UUID) else None
        if lock is not None and lock.until <= time.time():
            self._expire(lock)  # the timer is a hair late; the clock is the truth
            lock = None
        if lock is None:
            raise MessageLockLostError(
                message="The lock supplied is invalid. Either the lock expired, or the message "
                "has already been removed from the queue."
            )
        return lock

    def _unlock(self, lock: Lock) -> None:
        del self.locks[lock.token]
        if lock.timer is not None:
            lock.timer.cancel()

    def _expire(self, lock: Lock) -> None:
        if self.locks.get(lock.token) is lock:
            self._unlock(lock)
            self.stats["lock_expired"] += 1
            self._release(lock.stored)

    def _release(self, stored: Stored) -> None:
        """A delivery ended unsettled (abandon, expiry): again, unless deliveries ran out."""
        stored.deliveries += 1
        limit = self.max_delivery_count
        if limit is not None and stored.deliveries >= limit:
            description = f"Message could not be consumed after {limit} delivery attempts."
            self._to_dead_letter(stored, MAX_DELIVERY_COUNT_EXCEEDED, description)
            self.stats["max_delivery_count_exceeded"] += 1
        else:
            self._offer(stored)

    def _to_dead_letter(self, stored: Stored, reason: str | None, description: str | None) -> None:
        assert self.dead_letter is not None, f"{self.path} has no dead-letter sub-queue"
        if reason is not None:
            stored.broker_properties[DEAD_LETTER_REASON] = reason
        if description is not None:
            stored.broker_properties[DEAD_LETTER_DESCRIPTION] = description
        self.dead_letter._offer(stored)  # keeps its sequence number, as Service Bus does
        self.stats["dead_lettered"] += 1

    def settle(
        self,
        token: uuid.UUID | str | None,
        operation: str,
        reason: str | None = None,
        description: str | None = None,
    ) -> None:
        lock = self._live(token)
        self._unlock(lock)
        self.stats[operation] += 1
        if operation == "complete":
            return
        if operation == "abandon":
            self._release(lock.stored)
        else:
            self._to_dead_letter(lock.stored, reason, description)

    def renew(self, token: uuid.UUID | str | None) -> datetime:
        lock = self._live(token)
        if lock.timer is not None:
            lock.timer.cancel()
        lock.until = time.time() + self.lock_duration
        lock.timer = asyncio.get_running_loop().call_later(self.lock_duration, self._expire, lock)
        self.stats["renewed"] += 1
        return datetime.fromtimestamp(lock.until_ms / 1000, tz=UTC)


class FakeServiceBus:
    """One namespace: queues, topics with subscriptions, fault injection, and clients."""

    def __init__(self) -> None:
        self.entities: dict[str, Entity] = {}
        self.topics: dict[str, list[Entity]] = {}
        self.faults: list[Fault] = []
        self.clients: list[FakeClient] = []
        self.receivers: list[FakeReceiver] = []
        self.latency = 0.0

    def _create(self, path: str, lock_duration: float, max_delivery_count: int) -> Entity:
        dead_letter = Entity(
            f"{path}/$DeadLetterQueue",
            lock_duration=lock_duration,
            max_delivery_count=None,
            dead_letter=None,
        )
        entity = Entity(
            path,
            lock_duration=lock_duration,
            max_delivery_count=max_delivery_count,
            dead_letter=dead_letter,
        )
        self.entities[path] = entity
        self.entities[dead_letter.path] = dead_letter
        return entity

    def create_queue(
        self, name: str, *, lock_duration: float = 60.0, max_delivery_count: int = 10
    ) -> Entity:
        return self._create(name, lock_duration, max_delivery_count)

    def create_subscription(
        self,
        topic: str,
        name: str,
        *,
        lock_duration: float = 60.0,
        max_delivery_count: int = 10,
    ) -> Entity:
        entity = self._create(f"{topic}/Subscriptions/{name}", lock_duration, max_delivery_count)
        self.topics.setdefault(topic, []).append(entity)
        return entity

    def entity(self, path: str) -> Entity:
        try:
            return self.entities[path]
        except KeyError:
            raise MessagingEntityNotFoundError(
                message=f"The messaging entity '{path}' could not be found."
            ) from None

    def client(self) -> FakeClient:
        """A new client: pass ``bus.client`` wherever a client factory is wanted."""
        client = FakeClient(self)
        self.clients.append(client)
        return client

    def fail(
        self,
        operation: str,
        error: Callable[[], Exception] | None = None,
        *,
        times: int = 1,
    ) -> None:
        """The next ``times`` calls of ``operation`` raise ``error()``.

        Operations: open, receive, peek, complete, abandon, dead-letter, renew, send.
        """
        make = error or (lambda: ServiceBusConnectionError(message=f"{operation}: injected fault"))
        self.faults.append(Fault(operation, make, times))

    def hang(self, operation: str, *, times: int = 1) -> None:
        """The next ``times`` calls of ``operation`` never return (a link open that hangs)."""
        self.faults.append(Fault(operation, None, times))

    def sever(self, client: FakeClient) -> None:
        """Cut one client off for good, like a killed process: its locks run out on their own."""
        client.severed = True
        for entity in self.entities.values():
            entity.wake()

    async def network(self, client: FakeClient, operation: str) -> None:
        """One round trip: latency, then whatever fault is due."""
        await asyncio.sleep(self.latency)
        if client.severed:
            raise ServiceBusConnectionError(message=f"{operation}: connection lost")
        for fault in self.faults:
            if fault.operation == operation and fault.times > 0:
                fault.times -= 1
                if fault.error is None:
                    await asyncio.Event().wait()  # until cancelled
                    raise AssertionError("unreachable")
                raise fault.error()

    @property
    def idle(self) -> bool:
        """Nothing available and nothing locked in any non-dead-letter entity."""
        return all(e.count == 0 for e in self.entities.values() if e.dead_letter is not None)


class FakeClient:
    """``azure.servicebus.aio.ServiceBusClient``: hands out receivers and senders."""

    def __init__(self, bus: FakeServiceBus) -> None:
        self.bus = bus
        self.severed = False
        self.closed = False
        self._handlers: list[FakeReceiver | FakeSender] = []

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _receiver(self, path: str, kwargs: dict[str, Any]) -> FakeReceiver:
        if kwargs.get("session_id") is not None or kwargs.get("auto_lock_renewer") is not None:
            raise TypeError("the fake models neither sessions nor a receiver-owned lock renewer")
        sub_queue = kwargs.get("sub_queue")
        if (
            sub_queue is not None
            and ServiceBusSubQueue(sub_queue) == ServiceBusSubQueue.DEAD_LETTER
        ):
            path = f"{path}/$DeadLetterQueue"
        receiver = FakeReceiver(
            self,
            path,
            receive_mode=ServiceBusReceiveMode(
                kwargs.get("receive_mode", ServiceBusReceiveMode.PEEK_LOCK)
            ),
            prefetch_count=int(kwargs.get("prefetch_count", 0)),
            max_wait_time=kwargs.get("max_wait_time"),
        )
        self._handlers.append(receiver)
        self.bus.receivers.append(receiver)
        return receiver

    def get_queue_receiver(self, queue_name: str, **kwargs: Any) -> FakeReceiver:
        return self._receiver(queue_name, kwargs)

    def get_subscription_receiver(
        self, topic_name: str, subscription_name: str, **kwargs: Any
    ) -> FakeReceiver:
        return self._receiver(f"{topic_name}/Subscriptions/{subscription_name}", kwargs)

    def get_queue_sender(self, queue_name: str, **kwargs: Any) -> FakeSender:
        sender = FakeSender(self, lambda: [self.bus.entity(queue_name)])
        self._handlers.append(sender)
        return sender

    def get_topic_sender(self, topic_name: str, **kwargs: Any) -> FakeSender:
        def targets() -> list[Entity]:
            if topic_name not in self.bus.topics:
                raise MessagingEntityNotFoundError(message=f"topic '{topic_name}' not found")
            return self.bus.topics[topic_name]

        sender = FakeSender(self, targets)
        self._handlers.append(sender)
        return sender

    async def close(self) -> None:
        self.closed = True
        for handler in self._handlers:
            await handler.close()


class FakeReceiver:
    """``azure.servicebus.aio.ServiceBusReceiver`` for one entity, without sessions."""

    def __init__(
        self,
        client: FakeClient,
        path: str,
        *,
        receive_mode: ServiceBusReceiveMode,
        prefetch_count: int,
        max_wait_time: float | None,
    ) -> None:
        self._client = client
        self.path = path
        self._receive_mode = receive_mode
        self.prefetch_count = prefetch_count
        self._max_wait_time = max_wait_time
        self._running = False  # the SDK's attribute: AutoLockRenewer reads it
        self._shutdown = False
        self.session = None  # ServiceBusReceivedMessage reads it to tell session locks apart
        self._delivery_ids = itertools.count()

    @property
    def entity(self) -> Entity:
        return self._client.bus.entity(self.path)

    async def __aenter__(self) -> Self:
        await self._open()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        # Handed-out messages keep their locks until they run out (only the link's
        # prefetch buffer is released on close, and the fake has none).
        self._shutdown = True
        self._running = False

    def _check_live(self) -> None:
        if self._shutdown:
            raise ValueError(
                "The handler has already been shutdown. Please use ServiceBusClient to create "
                "a new instance."
            )

    def _check_message_alive(self, message: ServiceBusReceivedMessage, action: str) -> None:
        if message._is_peeked_message:
            raise ValueError(f"The operation {action} is not supported for peeked messages.")
        if self._receive_mode == ServiceBusReceiveMode.RECEIVE_AND_DELETE:
            raise ValueError(f"The operation {action} is not supported in 'RECEIVE_AND_DELETE'.")
        if message._settled:
            raise MessageAlreadySettled(action=action)
        if not self._running:
            raise ValueError(
                f"Failed to {action} the message as the handler has already been shutdown."
            )

    async def _open(self) -> None:
        self._check_live()
        if not self._running:
            await self._client.bus.network(self._client, "open")
            self.entity  # noqa: B018 - an unknown entity fails the open, as on the wire
            self._running = True

    def _message(self, payload: bytes, **kwargs: Any) -> ServiceBusReceivedMessage:
        return ServiceBusReceivedMessage(
            decode_payload(memoryview(payload)),
            receive_mode=self._receive_mode,
            receiver=self,
            **kwargs,
        )

    async def receive_messages(
        self, max_message_count: int | None = 1, max_wait_time: float | None = None
    ) -> list[ServiceBusReceivedMessage]:
        self._check_live()
        if max_wait_time is not None and max_wait_time <= 0:
            raise ValueError("The max_wait_time must be greater than 0.")
        if max_message_count is not None and max_message_count <= 0:
            raise ValueError("The max_message_count must be greater than 0")
        await self._open()
        await self._client.bus.network(self._client, "receive")
        count = self.prefetch_count if max_message_count is None else max_message_count
        if count == 0:
            return []
        wait = max_wait_time or self._max_wait_time or DEFAULT_RECEIVE_WAIT
        deadline = time.monotonic() + wait
        entity = self.entity
        while True:
            if self._client.severed:
                raise ServiceBusConnectionError(message="receive: connection lost")
            self._check_live()
            if self._receive_mode == ServiceBusReceiveMode.RECEIVE_AND_DELETE:
                return [self._message(s.encode(None)) for s in entity.remove(count)]
            locks = entity.take(count, self)
            if locks:
                return [self._locked(lock) for lock in locks]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            await entity.wait(remaining)

    def _locked(self, lock: Lock) -> ServiceBusReceivedMessage:
        frame = TransferFrame(
            handle=0, delivery_id=next(self._delivery_ids), delivery_tag=lock.token.bytes_le
        )
        return self._message(lock.stored.encode(lock.until_ms), frame=frame)

    async def peek_messages(
        self,
        max_message_count: int = 1,
        *,
        sequence_number: int = 0,
        timeout: float | None = None,  # noqa: ASYNC109 - the SDK's signature
    ) -> list[ServiceBusReceivedMessage]:
        self._check_live()
        await self._open()
        await self._client.bus.network(self._client, "peek")
        entity = self.entity
        locked_until = {id(lock.stored): lock.until_ms for lock in entity.locks.values()}
        found = [s for s in entity.messages() if s.sequence_number >= sequence_number]
        return [
            self._message(s.encode(locked_until.get(id(s))), is_peeked_message=True)
            for s in found[:max_message_count]
        ]

    async def _settle(
        self,
        message: ServiceBusReceivedMessage,
        operation: str,
        reason: str | None = None,
        description: str | None = None,
    ) -> None:
        # The same checks, in the same order, as ServiceBusReceiver._settle_message_with_retry.
        self._check_live()
        if not isinstance(message, ServiceBusReceivedMessage):
            raise TypeError("Parameter 'message' must be of type ServiceBusReceivedMessage")
        self._check_message_alive(message, operation)
        if message._lock_expired:
            raise MessageLockLostError(
                message="The lock on the message lock has expired.", error=message.auto_renew_error
            )
        await self._client.bus.network(self._client, operation)
        self.entity.settle(message.lock_token, operation, reason, description)
        message._settled = True

    async def complete_message(self, message: ServiceBusReceivedMessage) -> None:
        await self._settle(message, "complete")

    async def abandon_message(self, message: ServiceBusReceivedMessage) -> None:
        await self._settle(message, "abandon")

    async def dead_letter_message(
        self,
        message: ServiceBusReceivedMessage,
        reason: str | None = None,
        error_description: str | None = None,
    ) -> None:
        await self._settle(message, "dead-letter", reason, error_description)

    async def renew_message_lock(
        self,
        message: ServiceBusReceivedMessage,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the SDK's signature
    ) -> datetime:
        self._check_live()
        self._check_message_alive(message, "renew")
        token = message.lock_token
        if not token:
            raise ValueError("Unable to renew lock - no lock token found.")
        await self._client.bus.network(self._client, "renew")
        expiry = self.entity.renew(token)
        message._expiry = expiry
        return expiry


class FakeSender:
    """``azure.servicebus.aio.ServiceBusSender``: encodes with the SDK, enqueues everywhere."""

    def __init__(self, client: FakeClient, targets: Callable[[], list[Entity]]) -> None:
        self._client = client
        self._targets = targets
        self._shutdown = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._shutdown = True

    async def send_messages(
        self,
        message: Any,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the SDK's signature
    ) -> None:
        if self._shutdown:
            raise ValueError("The handler has already been shutdown.")
        batch = message if isinstance(message, list) else [message]
        outgoing = []
        for item in batch:
            if isinstance(item, ServiceBusMessage):
                item = item.raw_amqp_message
            if not isinstance(item, AmqpAnnotatedMessage):
                raise TypeError(f"cannot send {type(item).__name__}")
            amqp = PyamqpTransport.to_outgoing_amqp_message(item)
            # The SDK encodes as it batches, before the wire: what it cannot encode (an
            # int property over 32 bits) fails the send here, not a later receive.
            encode_payload(bytearray(), amqp)
            outgoing.append(amqp)
        await self._client.bus.network(self._client, "send")
        targets = self._targets()
        for amqp in outgoing:  # all or nothing, like one batch on the wire
            for entity in targets:
                entity.enqueue(amqp)
