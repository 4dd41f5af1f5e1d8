"""An in-process, at-least-once broker: the embedded default and the test workhorse.

It behaves like RabbitMQ with manual acks, and it can be told to misbehave the
ways real brokers do:

- ``ack``: the message is gone. ``nack``: it comes back (after ``delay``), with
  the delivery count + 1 (unchanged for ``counted=False``). ``dead_letter``: it
  moves to :attr:`MemoryBroker.dead_letters` with the reason.
- A consumer that closes or :meth:`~MemoryConsumer.crash`-es without settling
  gives its unsettled messages back; with ``visibility_timeout`` set, a delivery
  not settled in time is re-offered and its late settlement raises
  :class:`~worker.errors.SettlementLost` (a Service Bus / SQS style lock).
- ``publish(copies=2)`` is a producer retry (the same id twice);
  ``publish(to_all=True)`` hands one copy to every consumer at once;
  ``publish(lose_acks=1)`` drops the first ack, as if the worker died between
  its commit and its ack.

The dedup key is the id given to :meth:`MemoryBroker.publish`, except for a structured
CloudEvent (a ``content-type: application/cloudevents+json`` header, the event as the
body), whose ``source`` + ``id`` key it as on every broker, and whose type and data are
the delivery's, so tests and ``worker publish`` can send what a real producer sends.

Deliveries are pushed to consumers round-robin, at most ``prefetch`` unsettled each.
``ack_many`` (a group's acks) acks several in one call, each recorded as its own ack.
:class:`MemoryPublisher` is the outbox relay's way in, inside ``worker run``.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from worker.brokers import IdentityFunc, load_identity
from worker.brokers.cloudevents import Contents, Event, contents, structured
from worker.brokers.outgoing import Outgoing
from worker.delivery import Delivery, Settler, ack_each
from worker.errors import ConfigurationError, SettlementLost

if TYPE_CHECKING:
    from worker.settings import Settings


@dataclass(slots=True)
class MemoryMessage:
    message_id: str | None
    type: str | None
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    delivery_count: int = 0
    lose_acks: int = 0
    returned: bool = False  # taken back from a consumer that never settled it
    give_backs: int = 0  # uncounted give-backs so far


@dataclass(slots=True)
class DeadLetter:
    message: MemoryMessage
    reason: str


class _Flight:
    """A message handed to a consumer and not yet settled: the settlement handle.

    It carries the delivery made of it: the consumer's inbox holds flights, so what was
    pushed but never taken goes back through the consumer's own handle.
    """

    __slots__ = ("consumer", "delivery", "live", "message", "timer")

    def __init__(self, message: MemoryMessage, consumer: MemoryConsumer) -> None:
        self.message = message
        self.consumer = consumer
        self.live = True
        self.timer: asyncio.TimerHandle | None = None
        kind, body = message.type, message.body
        headers: Mapping[str, Any] = message.headers
        refusal = None
        if headers:  # a structured CloudEvent says so in its content-type header
            read = contents(structured_event(message), Contents(kind, body, headers), "ce-")
            kind, body, headers, refusal = read.type, read.body, read.headers, read.refusal
        self.delivery = Delivery(
            consumer.broker.identity(message),
            kind,
            body,
            headers,
            message.delivery_count,
            consumer,
            self,
            suspect=message.returned,
            give_backs=message.give_backs,
            refusal=refusal,
        )


def structured_event(message: MemoryMessage) -> Event | None:
    """The event of a structured-mode message (its ``content-type`` header says so)."""
    content_type = next(
        (str(value) for name, value in message.headers.items() if name.lower() == "content-type"),
        None,
    )
    return structured(content_type, message.body)


def default_message_id(message: MemoryMessage) -> str | None:
    """The memory broker's dedup key: the id given to :meth:`MemoryBroker.publish`, or a
    structured CloudEvent's ``source`` + ``id``."""
    event = structured_event(message) if message.headers else None
    if event is not None and event.key is not None:
        return event.key
    return message.message_id


class MemoryBroker:
    """The queue itself, shared by any number of consumers in one process.

    ``stats`` tallies the queue's events (``published``, ``delivered``,
    ``redelivered``, ``acked``, ``acks_lost``, ``ack_many``, ``nacked``,
    ``nacked_uncounted``, ``dead_lettered``, ``lock_expired``); each consumer keeps
    its own share of them (all but ``published``) in its own ``stats``.
    """

    def __init__(
        self,
        *,
        visibility_timeout: float | None = None,
        redelivery_delay: float = 0.0,
        identity: IdentityFunc = default_message_id,
        queue: str = "memory",
    ) -> None:
        self.queue = queue
        """The queue's name: its consumers' ``destination``."""
        self.visibility_timeout = visibility_timeout
        self.redelivery_delay = redelivery_delay
        self.identity = identity
        self.ready: deque[MemoryMessage] = deque()
        self.dead_letters: list[DeadLetter] = []
        self.stats: Counter[str] = Counter()
        self.history: list[tuple[str, str | None, int]] = []
        """Every settlement as (verb, message id, delivery count): what the broker saw."""
        self.consumers: list[MemoryConsumer] = []
        self._in_flight = 0
        self._delayed = 0
        self._next_consumer = 0
        self._changed = asyncio.Event()

    @classmethod
    def from_settings(cls, settings: Settings) -> MemoryBroker:
        return cls(identity=load_identity(settings.message_id_func, default_message_id))

    def connect(self) -> MemoryConsumer:
        consumer = MemoryConsumer(self)
        self.consumers.append(consumer)
        return consumer

    # -- producing ---------------------------------------------------------------

    def publish(
        self,
        message_id: str | None,
        type: str | None,
        body: bytes | dict[str, Any],
        headers: dict[str, Any] | None = None,
        *,
        copies: int = 1,
        to_all: bool = False,
        lose_acks: int = 0,
        delivered_before: int = 0,
    ) -> None:
        """Enqueue a message; see the module docstring for the failure knobs.
        ``delivered_before``: deliveries it had already (it arrives as a redelivery)."""
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        self.stats["published"] += copies
        for _ in range(copies):
            message = MemoryMessage(
                message_id, type, raw, dict(headers or {}), delivered_before, lose_acks
            )
            if to_all and self.consumers:
                live = [c for c in self.consumers if c.consuming]
                for consumer in live or self.consumers:
                    twin = MemoryMessage(message_id, type, raw, dict(message.headers))
                    self.stats["published"] += 1
                    self._hand_over(twin, consumer)
                self.stats["published"] -= 1
            else:
                self.ready.append(message)
        self._dispatch()

    # -- state ------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def idle(self) -> bool:
        """Nothing ready, nothing unsettled, nothing waiting to come back."""
        return not self.ready and self._in_flight == 0 and self._delayed == 0

    async def wait_idle(self, timeout: float) -> None:  # noqa: ASYNC109 - a bounded test wait
        """Wait (bounded) until every message is settled for good."""
        async with asyncio.timeout(timeout):
            while not self.idle:
                self._changed.clear()
                await self._changed.wait()

    # -- internals --------------------------------------------------------------

    def _dispatch(self) -> None:
        while self.ready:
            consumer = self._pick_consumer()
            if consumer is None:
                return
            self._hand_over(self.ready.popleft(), consumer)

    def _pick_consumer(self) -> MemoryConsumer | None:
        count = len(self.consumers)
        for step in range(count):
            consumer = self.consumers[(self._next_consumer + step) % count]
            if consumer.has_credit:
                self._next_consumer = (self._next_consumer + step + 1) % count
                return consumer
        return None

    def _hand_over(self, message: MemoryMessage, consumer: MemoryConsumer) -> None:
        message.delivery_count += 1
        flight = _Flight(message, consumer)
        self._in_flight += 1
        self._count(consumer, "delivered")
        if message.delivery_count > 1:
            self._count(consumer, "redelivered")
        if self.visibility_timeout is not None:
            loop = asyncio.get_running_loop()
            flight.timer = loop.call_later(self.visibility_timeout, self._expire, flight)
        consumer.accept(flight)

    def _count(self, consumer: MemoryConsumer, event: str) -> None:
        """One event, in the queue's tallies and in the consumer's own."""
        self.stats[event] += 1
        consumer.stats[event] += 1

    def _end(self, flight: _Flight) -> None:
        if not flight.live:
            raise SettlementLost(f"message {flight.message.message_id!r}: lock lost")
        self._changed.set()
        flight.live = False
        if flight.timer is not None:
            flight.timer.cancel()
        self._in_flight -= 1
        flight.consumer.unsettled.discard(flight)

    def _expire(self, flight: _Flight) -> None:
        if flight.live:
            self._count(flight.consumer, "lock_expired")
            self._end(flight)
            flight.message.returned = True
            self._requeue(flight.message, 0.0)

    def _requeue(self, message: MemoryMessage, delay: float) -> None:
        if delay <= 0:
            self.ready.append(message)
            self._dispatch()
            return
        self._delayed += 1

        def back() -> None:
            self._delayed -= 1
            self._changed.set()
            self.ready.append(message)
            self._dispatch()

        asyncio.get_running_loop().call_later(delay, back)

    def _give_back(self, consumer: MemoryConsumer) -> None:
        """A consumer vanished: every message it held unsettled is offered again."""
        for flight in list(consumer.unsettled):
            self._end(flight)
            flight.message.returned = True
            self._requeue(flight.message, 0.0)
        self._dispatch()


class MemoryConsumer(Settler):
    """One connection to a :class:`MemoryBroker`: the pump's :class:`Broker`.

    ``keep_alive`` and ``in_commit`` are the Settler's no-ops: the visibility timeout,
    when set, is the test's lock and runs out as set, and nothing of the memory broker
    commits with the handler's transaction.
    """

    name = "memory"

    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker
        self.destination = broker.queue
        self.stats: Counter[str] = Counter()
        """This consumer's share of the broker's tallies (see :class:`MemoryBroker`)."""
        self.unsettled: set[_Flight] = set()
        self.consuming = False
        self._prefetch = 0
        self._inbox: asyncio.Queue[_Flight] = asyncio.Queue()

    @property
    def ready(self) -> bool:
        return self.consuming

    @property
    def has_credit(self) -> bool:
        return self.consuming and len(self.unsettled) < self._prefetch

    async def start(self, prefetch: int) -> None:
        self._prefetch = prefetch
        self.consuming = True
        self.broker._dispatch()

    async def receive(self) -> Delivery:
        return (await self._inbox.get()).delivery

    async def stop_receiving(self) -> None:
        """Stop new pushes; what was pushed but not yet taken goes back, uncounted."""
        self.consuming = False
        while not self._inbox.empty():
            flight = self._inbox.get_nowait()
            self.broker._end(flight)
            flight.message.delivery_count -= 1
            self.broker._requeue(flight.message, 0.0)
        self.broker._dispatch()

    async def close(self) -> None:
        self.crash()

    def crash(self) -> None:
        """Vanish without settling anything, like a killed process."""
        self.consuming = False
        self._inbox = asyncio.Queue()
        if self in self.broker.consumers:
            self.broker.consumers.remove(self)
        self.broker._give_back(self)

    def accept(self, flight: _Flight) -> None:
        self.unsettled.add(flight)
        self._inbox.put_nowait(flight)

    # -- Settler ----------------------------------------------------------------

    async def ack(self, handle: _Flight) -> None:
        broker = self.broker
        broker._end(handle)
        broker.history.append(("ack", handle.message.message_id, handle.message.delivery_count))
        if handle.message.lose_acks > 0:
            handle.message.lose_acks -= 1
            broker._count(self, "acks_lost")
            broker._requeue(handle.message, broker.visibility_timeout or 0.0)
        else:
            broker._count(self, "acked")
        broker._dispatch()

    async def ack_many(self, handles: Sequence[_Flight]) -> list[_Flight]:
        """One call for a batch's acks; returns the ones lost (their lock had expired)."""
        self.broker._count(self, "ack_many")
        return await ack_each(self.ack, handles)

    async def nack(self, handle: _Flight, delay: float | None, counted: bool = True) -> None:
        broker = self.broker
        broker._end(handle)
        broker.history.append(("nack", handle.message.message_id, handle.message.delivery_count))
        broker._count(self, "nacked")
        handle.message.returned = False  # settled by a consumer: whoever gets it next knows
        if not counted:  # the next hand-over adds one back: the count stays where it is
            handle.message.delivery_count -= 1
            handle.message.give_backs += 1
            broker._count(self, "nacked_uncounted")
        broker._requeue(handle.message, broker.redelivery_delay if delay is None else delay)
        broker._dispatch()

    async def dead_letter(self, handle: _Flight, reason: str) -> None:
        broker = self.broker
        broker._end(handle)
        broker.history.append(
            ("dead-letter", handle.message.message_id, handle.message.delivery_count)
        )
        broker._count(self, "dead_lettered")
        broker.dead_letters.append(DeadLetter(handle.message, reason))
        broker._dispatch()


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


def open_broker(settings: Settings) -> MemoryConsumer:
    """``worker run`` with the memory broker: an empty queue that only this process sees."""
    return MemoryBroker.from_settings(settings).connect()


def open_publisher(consumer: MemoryConsumer) -> MemoryPublisher:
    """The outbox relay's publisher inside ``worker run``: into the pump's own queue."""
    return MemoryPublisher(consumer.broker)


def open_admin(settings: Settings) -> NoReturn:
    raise ConfigurationError(
        "WORKER_BROKER: the memory broker lives inside one process; "
        "publish and dlq need rabbitmq, kafka or servicebus"
    )
