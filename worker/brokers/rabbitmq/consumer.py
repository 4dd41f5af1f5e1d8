"""The consumer: the pump's :class:`~worker.brokers.Broker` on RabbitMQ, and the Settler
that maps the pump's verbs onto AMQP (manual acks, delayed retries, a DLX).

Verb mapping (every move is a confirmed copy before the original is released):

- ``ack``: ``basic.ack``. ``ack_many`` (a group's acks): one ``basic.ack(multiple=True)``
  for the run of the channel's lowest unsettled delivery tags that are all in the
  batch (a multiple-ack covers every unacked tag up to it, other workers' included),
  single acks for the rest.
- ``nack(delay, counted)`` and ``dead_letter(reason)``: a confirmed copy to a delay
  queue, back to ``Q``, or to ``Q.dlx``, then the ack of the original; a copy the broker
  refuses is held, tried again and parked (:mod:`~worker.brokers.rabbitmq.giveback`).
- ``keep_alive`` and ``in_commit``: the Settler's no-ops (an unacked delivery stays
  ours while its channel lives; nothing of RabbitMQ's commits with the handler's
  transaction).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import aio_pika
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from worker.brokers import IdentityFunc
from worker.brokers.rabbitmq.giveback import GiveBacks, Handle
from worker.brokers.rabbitmq.messages import delivery_count, message_contents, returned
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
from worker.delivery import Delivery, Settler
from worker.errors import SettlementLost
from worker.logs import get_logger

_Callback = Callable[[AbstractIncomingMessage], Awaitable[None]]


class RabbitMQConsumer(Settler):
    """The pump's :class:`~worker.brokers.Broker` and the deliveries' Settler.

    ``stats`` counts what an operator wants to see move (lower_snake_case keys):
    ``connection_lost`` / ``reconnected`` (the connection or the consuming channel
    closed under it, and came back), ``stale_deliveries_dropped`` (received on a lost
    channel: RabbitMQ requeued them with it), ``acks_lost`` / ``nacks_lost`` /
    ``dead_letters_lost`` (settlements that raised SettlementLost), ``copies_refused``
    (a copy the broker refused or left unconfirmed, on a live channel: tried again),
    ``copies_parked`` (held for ``WORKER_RABBITMQ_COPY_HOLD``, then parked in the longest
    delay queue, or the work queue without delay queues), ``requeued_after_failed_copy``
    (while stopping, or after a fault of the worker's own in the copy),
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
        self._buffer: asyncio.Queue[tuple[Handle, Delivery]] = asyncio.Queue()
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractRobustChannel | None = None
        self._publisher: AbstractRobustChannel | None = None
        self._queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._connected = False
        self._consuming = False
        self._generation = 0
        self._lost_at: float | None = None
        # Delivery tags of this generation's channel not settled yet, ascending (tags grow
        # with every delivery): a multiple-ack is safe only over a run of the lowest ones.
        # A tag leaves once its settling frame went out, never before.
        self._unsettled: dict[int, None] = {}
        self._strict = True  # Q was declared at-least-once (False: an earlier version's Q)
        self._returning: set[asyncio.Task[None]] = set()  # deliveries that raced the cancel
        self._give_backs = GiveBacks(settings, self.stats, self._log, self)

    @property
    def ready(self) -> bool:
        """Connected and consuming: False while the robust connection reconnects."""
        return self._connected and self._consuming

    # -- what the give-backs read (giveback.Channels) ---------------------------------

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def consuming(self) -> bool:
        return self._consuming

    @property
    def connection(self) -> AbstractRobustConnection | None:
        return self._connection

    @property
    def publisher(self) -> AbstractRobustChannel | None:
        return self._publisher

    @property
    def strict(self) -> bool:
        return self._strict

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
            await self._give_backs.return_unstarted(handle)
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
        handle = Handle(message, count, self._generation)
        self._unsettled[handle.tag] = None
        if not self._consuming:  # raced with basic.cancel: give it straight back, uncounted
            task = asyncio.get_running_loop().create_task(self._give_backs.return_unstarted(handle))
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

    def settled(self, handle: Handle) -> None:
        """The handle's settling frame went out: its tag leaves the unsettled run."""
        if handle.generation == self._generation:
            self._unsettled.pop(handle.tag, None)

    async def ack(self, handle: Handle) -> None:
        async with self._give_backs.settling(handle, "ack"):
            await handle.message.ack()
        self.settled(handle)

    async def ack_many(self, handles: Sequence[Handle]) -> list[Handle]:
        """Ack a batch; returns the handles whose ack was lost.

        ``basic.ack(multiple=True)`` on tag T acks every unacked tag <= T on the channel,
        whoever holds it. It is sent only for the run of the lowest unsettled tags that
        are all in ``handles`` (two or more); a tag still running, being nacked or
        dead-lettered elsewhere ends the run, and the rest are acked one by one.
        """
        ours = {h.tag: h for h in handles if h.generation == self._generation}
        run: list[Handle] = []
        for tag in self._unsettled:  # ascending; stops at the first tag that is not ours
            if tag not in ours:
                break
            run.append(ours[tag])
        lost: list[Handle] = []
        if len(run) > 1:
            top = run[-1]
            try:
                async with self._give_backs.settling(top, "ack", deliveries=len(run)):
                    await top.message.ack(multiple=True)
            except SettlementLost:
                lost.extend(run)
            else:
                self.stats["multiple_acks"] += 1
                for handle in run:
                    self.settled(handle)
        else:
            run = []
        covered = {id(h) for h in run}
        lost.extend(await self._ack_each([h for h in handles if id(h) not in covered]))
        return lost

    async def _ack_each(self, handles: Sequence[Handle]) -> list[Handle]:
        """Single acks for what a multiple-ack could not cover, bounded together (one
        timeout, not one per delivery); once the channel fails, the rest are lost too."""
        live = [h for h in handles if h.generation == self._generation]
        lost = [h for h in handles if h.generation != self._generation]
        sent = 0
        try:
            async with asyncio.timeout(self.settings.settle_timeout):
                for handle in live:
                    await handle.message.ack()
                    self.settled(handle)
                    sent += 1
        except CONNECTION_LOST:
            lost.extend(live[sent:])
        self.stats["acks_lost"] += len(lost)
        return lost

    async def nack(self, handle: Handle, delay: float | None, counted: bool = True) -> None:
        await self._give_backs.nack(handle, delay, counted)

    async def dead_letter(self, handle: Handle, reason: str) -> None:
        await self._give_backs.dead_letter(handle, reason)
