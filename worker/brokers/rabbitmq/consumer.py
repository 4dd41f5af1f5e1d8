"""The consumer: the pump's :class:`~worker.brokers.Broker` on RabbitMQ, and the Settler
that maps the pump's verbs onto AMQP (manual acks, delayed retries, a DLX).

Verb mapping (every move is a confirmed copy before the original is released):

- ``ack``: ``basic.ack``. ``ack_many`` (batch mode): one ``basic.ack(multiple=True)``
  for the run of the channel's lowest unsettled delivery tags that are all in the
  batch (a multiple-ack covers every unacked tag up to it, other workers' included),
  single acks for the rest.
- ``nack(delay, counted)``: publish a copy to the delay queue whose TTL fits the
  delay, or straight to ``Q`` for an immediate retry, carrying the delivery count
  so far in ``x-worker-deliveries`` (one less when the message is not to blame, and
  then one more ``x-worker-give-backs``), wait for the publisher confirm, then ack
  the original.
- ``dead_letter(reason)``: publish a copy to ``Q.dlx`` with ``x-worker-reason`` (the
  exception type and message), wait for the confirm, then ack the original.
- A copy that fails (returned, refused, unconfirmed in time) on a live channel: the
  original stays held and the copy is tried again with backoff (the topology declared
  again first, in case a queue was deleted); after ``WORKER_RABBITMQ_COPY_HOLD`` it is
  parked instead: a copy to the longest delay queue, then the ack. Never a requeue at
  once, which would loop, and under a ``delivery-limit`` policy let the broker
  dead-letter the message itself, at most once, into the queue that refused it.
  Only while stopping is the original given back with ``basic.nack(requeue=True)``.

Copy-then-ack is not atomic: a crash between the two leaves the original to be
redelivered next to its copy, and the inbox absorbs whichever runs second.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, cast

import aio_pika
from aio_pika.abc import (
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from worker.brokers import IdentityFunc
from worker.brokers.rabbitmq.messages import (
    DELIVERIES_HEADER,
    GIVE_BACKS_HEADER,
    REASON_HEADER,
    copy_message,
    delivery_count,
    give_backs,
    message_contents,
    returned,
)
from worker.brokers.rabbitmq.settings import (
    CONNECTION_LOST,
    RabbitMQSettings,
    connect_args,
    start_failure,
)
from worker.brokers.rabbitmq.topology import (
    at_least_once_accepted,
    declare_topology,
    drain_legacy_queues,
)
from worker.db import redact
from worker.delivery import Delivery
from worker.errors import SettlementLost
from worker.logs import get_logger

_MAX_REASON = 2000
_Callback = Callable[[AbstractIncomingMessage], Awaitable[None]]
_LOST_EVENTS = {"ack": "acks_lost", "nack": "nacks_lost", "dead-letter": "dead_letters_lost"}
_HOLD_FIRST_DELAY = 0.5  # seconds before a refused copy is tried again, doubling
_HOLD_MAX_DELAY = 30.0


class _Handle:
    """The adapter's own handle on one delivery: the AMQP message, its count and uncounted
    give-backs, and the channel generation its delivery tag belongs to (a tag is void once
    that channel is)."""

    __slots__ = ("count", "generation", "give_backs", "message", "tag")

    def __init__(self, message: AbstractIncomingMessage, count: int, generation: int) -> None:
        self.message = message
        self.count = count
        self.give_backs = give_backs(message)
        self.generation = generation
        self.tag = message.delivery_tag or 0


class RabbitMQConsumer:
    """The pump's :class:`~worker.brokers.Broker` and the deliveries' Settler.

    ``stats`` counts what an operator wants to see move (lower_snake_case keys):
    ``connection_lost`` / ``reconnected`` (the connection or the consuming channel
    closed under it, and came back), ``stale_deliveries_dropped`` (received on a lost
    channel: RabbitMQ requeued them with it), ``acks_lost`` / ``nacks_lost`` /
    ``dead_letters_lost`` (settlements that raised SettlementLost), ``copies_refused``
    (a copy the broker refused or left unconfirmed, on a live channel: tried again),
    ``copies_parked`` (held for ``WORKER_RABBITMQ_COPY_HOLD``, then parked in the longest
    delay queue), ``requeued_after_failed_copy`` (only while stopping),
    ``multiple_acks``, ``nacks_delayed`` (copies to a retry queue), ``nacks_immediate``
    (copies straight back to the work queue), ``dead_lettered``, ``returned_unstarted``
    (given back untaken at a stop), ``legacy_messages_moved`` and
    ``message_id_func_failed``.
    """

    name = "rabbitmq"

    def __init__(self, settings: RabbitMQSettings, identity: IdentityFunc) -> None:
        self.settings = settings
        self.identity = identity
        self.destination = settings.queue
        self.stats: Counter[str] = Counter()
        self._log = get_logger(broker=self.name, queue=settings.queue)
        # each delivery next to the adapter's own handle for it, until the pump takes it
        self._buffer: asyncio.Queue[tuple[_Handle, Delivery]] = asyncio.Queue()
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractRobustChannel | None = None
        self._publisher: AbstractRobustChannel | None = None
        self._queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._connected = False
        self._consuming = False
        self._generation = 0
        self._lost_at: float | None = None
        self._exchanges: dict[str, AbstractExchange] = {}
        # Delivery tags of this generation's channel not settled yet, ascending (tags grow
        # with every delivery): a multiple-ack is safe only over a run of the lowest ones.
        # A tag leaves once its settling frame went out, never before.
        self._unsettled: dict[int, None] = {}
        self._strict = True  # Q was declared at-least-once (False: an earlier version's Q)
        self._returning: set[asyncio.Task[None]] = set()  # deliveries that raced the cancel

    @property
    def ready(self) -> bool:
        """Connected and consuming: False while the robust connection reconnects."""
        return self._connected and self._consuming

    @property
    def outages(self) -> int:
        """Connections (or consuming channels) lost so far."""
        return self.stats["connection_lost"]

    @property
    def multiple_acks(self) -> int:
        """``basic.ack(multiple=True)`` frames sent so far."""
        return self.stats["multiple_acks"]

    async def start(self, prefetch: int) -> None:
        settings = self.settings
        try:
            self._connection = connection = await aio_pika.connect_robust(
                settings.url,
                reconnect_interval=settings.reconnect_interval,
                **connect_args(settings),
            )
            self._channel = channel = await connection.channel()
            self._publisher = await connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
            await channel.set_qos(prefetch_count=prefetch)
            strict = await at_least_once_accepted(connection, settings)
            if settings.queue_type == "quorum" and not strict:
                self._log.warning(
                    "work queue declared by an earlier version: the broker's own "
                    "dead-lettering from it stays at most once (docs/rabbitmq.md, "
                    "'Existing work queues')"
                )
            self._queue = await declare_topology(channel, settings, at_least_once=strict)
            self._strict = strict
            drained = await drain_legacy_queues(connection, settings, self._log)
            if drained:
                self.stats["legacy_messages_moved"] += drained
                self._log.info("moved messages out of legacy queues", messages=drained)
            connection.close_callbacks.add(self._on_lost)
            channel.close_callbacks.add(self._on_lost)
            channel.reopen_callbacks.add(self._on_restored)
            connection.reconnect_callbacks.add(self._on_restored)
            # before basic.consume: the first deliveries may arrive before it returns
            self._connected = self._consuming = True
            # aio-pika runs a plain callback without a task per delivery (its tools.create_task)
            # though its annotation asks for an awaitable one
            on_message = cast("_Callback", self._on_message)
            self._consumer_tag = await self._queue.consume(on_message, no_ack=False)
        except CONNECTION_LOST as exc:
            await self.close()
            raise start_failure(settings, exc) from None
        self._log.info(
            "rabbitmq consuming",
            url=redact(settings.url),
            prefetch=prefetch,
            queue_type=settings.queue_type,
            retry_delays=settings.retry_delays,
        )

    async def receive(self) -> Delivery:
        while True:
            handle, delivery = await self._buffer.get()
            if handle.generation == self._generation:
                return delivery
            # delivered on a connection since lost: RabbitMQ has already requeued it
            self.stats["stale_deliveries_dropped"] += 1

    async def stop_receiving(self) -> None:
        """Cancel the consumer; deliveries not yet taken go straight back to the queue."""
        self._consuming = False
        if self._queue is not None and self._consumer_tag is not None:
            with contextlib.suppress(*CONNECTION_LOST):
                async with asyncio.timeout(self.settings.settle_timeout):
                    await self._queue.cancel(self._consumer_tag)
            self._consumer_tag = None
        while not self._buffer.empty():  # taken from the queue, never started: not counted
            handle, _ = self._buffer.get_nowait()
            await self._return_unstarted(handle)
        await asyncio.gather(*self._returning, return_exceptions=True)

    async def close(self) -> None:
        self._consuming = False
        self._connected = False
        if self._connection is not None:
            with contextlib.suppress(*CONNECTION_LOST):
                await self._connection.close()
            self._connection = None

    # -- connection state (aio-pika callbacks) -------------------------------------

    def _on_message(self, message: AbstractIncomingMessage) -> None:
        # Not a coroutine: aio-pika then calls it without a task of its own per delivery.
        count = delivery_count(message)
        handle = _Handle(message, count, self._generation)
        self._unsettled[handle.tag] = None
        if not self._consuming:  # raced with basic.cancel: give it straight back, uncounted
            task = asyncio.get_running_loop().create_task(self._return_unstarted(handle))
            self._returning.add(task)
            task.add_done_callback(self._returning.discard)
            return
        try:
            message_id = self.identity(message)
        except Exception:  # a deployment's WORKER_MESSAGE_ID_FUNC: the pump dead-letters None
            self.stats["message_id_func_failed"] += 1
            self._log.exception("message id function failed", delivery_count=count)
            message_id = None
        contents = message_contents(message)  # a structured CloudEvent's type, data, headers
        delivery = Delivery(
            message_id,
            contents.type,
            contents.body,
            contents.headers,
            count,
            self,
            handle,
            suspect=returned(message),
            refusal=contents.refusal,
            give_backs=handle.give_backs,
        )
        self._buffer.put_nowait((handle, delivery))

    def _on_lost(self, _sender: Any, exc: BaseException | None = None) -> None:
        if not self._connected:
            return
        self._connected = False
        self.stats["connection_lost"] += 1
        self._generation += 1  # every unsettled delivery tag is void from here on
        self._unsettled.clear()  # the channel that numbered them is gone
        self._lost_at = time.monotonic()
        while not self._buffer.empty():
            self._buffer.get_nowait()
            self.stats["stale_deliveries_dropped"] += 1
        if self._consuming:
            self._log.warning("rabbitmq connection lost, reconnecting", error=exc)

    def _on_restored(self, _sender: Any, *_: Any) -> None:
        if self._connected or self._connection is None or self._connection.is_closed:
            return
        self._connected = True
        self.stats["reconnected"] += 1
        outage = time.monotonic() - self._lost_at if self._lost_at else 0.0
        self._log.info("rabbitmq reconnected", outage_s=round(outage, 2))

    # -- Settler ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _settling(
        self, handle: _Handle, verb: str, give_back: bool = False, deliveries: int = 1
    ) -> AsyncIterator[None]:
        """Bound one settlement step in time and translate vendor errors to SettlementLost.

        ``give_back``: the step is the copy's publish, and the original is still held
        on a live channel, where nothing would ever return it: requeue it first.
        ``deliveries``: how many the step settles (a multiple-ack: its whole run).
        """
        if handle.generation != self._generation:
            self.stats[_LOST_EVENTS[verb]] += deliveries
            raise SettlementLost(f"{verb} {handle.message.message_id!r}: its connection was lost")
        try:
            async with asyncio.timeout(self.settings.settle_timeout):
                yield
        except CONNECTION_LOST as exc:
            self.stats[_LOST_EVENTS[verb]] += deliveries
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
        except CONNECTION_LOST:
            return False  # the channel is gone after all, and so is the delivery
        self._settled(handle)
        self.stats["requeued_after_failed_copy"] += 1
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
                async with self._settling(top, "ack", deliveries=len(run)):
                    await top.message.ack(multiple=True)
            except SettlementLost:
                lost.extend(run)
            else:
                self.stats["multiple_acks"] += 1
                for handle in run:
                    self._settled(handle)
        else:
            run = []
        covered = {id(h) for h in run}
        lost.extend(await self._ack_each([h for h in handles if id(h) not in covered]))
        return lost

    async def _ack_each(self, handles: Sequence[_Handle]) -> list[_Handle]:
        """Single acks for what a multiple-ack could not cover, bounded together (one
        timeout, not one per delivery); once the channel fails, the rest are lost too."""
        live = [h for h in handles if h.generation == self._generation]
        lost = [h for h in handles if h.generation != self._generation]
        sent = 0
        try:
            async with asyncio.timeout(self.settings.settle_timeout):
                for handle in live:
                    await handle.message.ack()
                    self._settled(handle)
                    sent += 1
        except CONNECTION_LOST:
            lost.extend(live[sent:])
        self.stats["acks_lost"] += len(lost)
        return lost

    def keep_alive(self, handle: _Handle, seconds: float) -> None:
        """Nothing to extend: an unacked delivery stays ours while the channel lives."""

    async def in_commit(self, session: Any, handles: Sequence[_Handle]) -> None:
        """Nothing of RabbitMQ's commits with the handler's transaction."""

    async def nack(self, handle: _Handle, delay: float | None, counted: bool = True) -> None:
        # Always a confirmed copy, never ``basic.nack(requeue=True)``: the copy carries
        # the count (and keeps it where it is when the message is not to blame), works
        # the same on classic queues, and does not depend on whether a RabbitMQ version
        # counts nacks (4.3 reportedly stopped).
        level = await self._give_back_copy(handle, delay, counted, handle.give_backs + 1)
        self.stats["nacks_immediate" if level is None else "nacks_delayed"] += 1

    async def _return_unstarted(self, handle: _Handle) -> None:
        """Taken from the queue, never started: back at once, its give-backs as they were
        (a lost settlement needs nothing: RabbitMQ requeues what a lost channel held)."""
        with contextlib.suppress(SettlementLost):
            await self._give_back_copy(handle, 0.0, False, handle.give_backs)
            self.stats["nacks_immediate"] += 1
            self.stats["returned_unstarted"] += 1

    async def _give_back_copy(
        self, handle: _Handle, delay: float | None, counted: bool, uncounted_give_backs: int
    ) -> float | None:
        level = self.settings.retry_delay(handle.count, delay)
        target = self.settings.queue if level is None else self.settings.retry_queue(level)
        carried = {DELIVERIES_HEADER: handle.count if counted else handle.count - 1}
        carried[GIVE_BACKS_HEADER] = handle.give_backs if counted else uncounted_give_backs
        copy = copy_message(handle.message, **carried)
        park = None if level == self._longest_delay else copy
        await self._copy_then_ack(handle, "nack", copy, "", target, park)
        return level

    async def dead_letter(self, handle: _Handle, reason: str) -> None:
        copy = copy_message(
            handle.message,
            **{
                REASON_HEADER: reason[:_MAX_REASON],
                DELIVERIES_HEADER: handle.count,
                "x-worker-queue": self.settings.queue,
                "x-worker-dead-lettered-at": datetime.now(UTC).isoformat(),
            },
        )
        # Parked, it comes back counted: judged again, or past the delivery limit at once.
        park = copy_message(
            handle.message,
            **{DELIVERIES_HEADER: handle.count, GIVE_BACKS_HEADER: handle.give_backs},
        )
        await self._copy_then_ack(
            handle,
            "dead-letter",
            copy,
            self.settings.dead_letter_exchange,
            self.settings.queue,
            park,
        )
        self.stats["dead_lettered"] += 1

    @property
    def _longest_delay(self) -> float | None:
        return self.settings.retry_delays[-1] if self.settings.retry_delays else None

    async def _copy_then_ack(
        self,
        handle: _Handle,
        verb: str,
        copy: aio_pika.Message,
        exchange: str,
        routing_key: str,
        park: aio_pika.Message | None = None,
    ) -> None:
        """Publish the copy (confirmed), then ack the original; each step bounded on its own.

        ``park``: what goes to the longest delay queue instead once the copy has been
        refused for ``WORKER_RABBITMQ_COPY_HOLD`` (None: nothing to park in).
        """
        if not self._consuming:  # stopping: nothing to hold for, the original goes back
            async with self._settling(handle, verb, give_back=True):
                await self._publish(copy, exchange, routing_key)
        else:
            await self._copy_held(handle, verb, (copy, exchange, routing_key), park)
        async with self._settling(handle, verb):
            await handle.message.ack()
        self._settled(handle)

    async def _copy_held(
        self,
        handle: _Handle,
        verb: str,
        publish: tuple[aio_pika.Message, str, str],
        park: aio_pika.Message | None,
    ) -> None:
        """Publish a copy while the original stays held; a refusal on a live channel is tried
        again with jittered backoff, and parked once WORKER_RABBITMQ_COPY_HOLD has passed.

        RabbitMQ keeps a delivery held on a live channel for as long as it lives: the
        message can be neither lost nor redelivered meanwhile, and it costs one slot.
        """
        held_since = time.monotonic()
        delay = _HOLD_FIRST_DELAY
        parked = False
        while (error := await self._try_publish(handle, verb, *publish)) is not None:
            self.stats["copies_refused"] += 1
            if not self._consuming:  # the worker is stopping: give the original back now
                self.stats[_LOST_EVENTS[verb]] += 1
                requeued = await self._give_back(handle)
                note = "; the original was requeued" if requeued else ""
                raise SettlementLost(f"{verb} {handle.message.message_id!r}: {error!r}{note}")
            held = time.monotonic() - held_since
            if park is not None and not parked and held >= self.settings.copy_hold:
                assert self._longest_delay is not None
                publish = (park, "", self.settings.retry_queue(self._longest_delay))
                parked = True
                self._log.warning(
                    "copy refused for too long, parking the message in the longest delay queue",
                    message_id=handle.message.message_id,
                    verb=verb,
                    target=publish[2],
                    held_s=round(held, 1),
                    error=error,
                )
            elif delay == _HOLD_FIRST_DELAY:  # once per hold, not once per try
                self._log.warning(
                    "copy refused, holding the message and trying again",
                    message_id=handle.message.message_id,
                    verb=verb,
                    target=publish[2],
                    error=error,
                )
            await self._repair_topology()
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2.0, _HOLD_MAX_DELAY)
        if parked:
            self.stats["copies_parked"] += 1

    async def _try_publish(
        self, handle: _Handle, verb: str, message: aio_pika.Message, exchange: str, key: str
    ) -> BaseException | None:
        """One confirmed publish: None, or why the broker refused it on a live channel.

        Raises ``SettlementLost`` once the original's channel is gone: the broker then
        requeues the original itself.
        """
        error: BaseException | None = None
        if handle.generation == self._generation:
            try:
                async with asyncio.timeout(self.settings.settle_timeout):
                    await self._publish(message, exchange, key)
            except CONNECTION_LOST as exc:
                error = exc
            if error is None or (
                handle.generation == self._generation
                and self._connection is not None
                and not self._connection.is_closed
            ):
                return error
        self.stats[_LOST_EVENTS[verb]] += 1
        raise SettlementLost(
            f"{verb} {handle.message.message_id!r}: its connection was lost ({error!r})"
        )

    async def _repair_topology(self) -> None:
        """Declare the topology again (a returned copy means a queue was deleted), on a
        channel of its own; best effort, the next try says whether it helped."""
        if self._connection is None or self._connection.is_closed:
            return
        with contextlib.suppress(*CONNECTION_LOST):
            channel = await self._connection.channel()
            try:
                await declare_topology(channel, self.settings, at_least_once=self._strict)
            finally:
                with contextlib.suppress(*CONNECTION_LOST):
                    await channel.close()

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
