"""Copy-then-ack: how a RabbitMQ message leaves the work queue other than by an ack.

Every move is a confirmed copy before the original is released (rule 12):

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
  parked instead: a copy to the longest delay queue (none: to ``Q`` itself, so it comes
  back at once and is held again, one cycle per hold), then the ack. Never a requeue at
  once, which would loop, and under a ``delivery-limit`` policy let the broker
  dead-letter the message itself, at most once, into the queue that refused it.
  Only while stopping, or after a fault of the worker's own in the copy, is the
  original given back with ``basic.nack(requeue=True)``.

Copy-then-ack is not atomic: a crash between the two leaves the original to be
redelivered next to its copy, and the inbox absorbs whichever runs second.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from worker.brokers.rabbitmq.messages import (
    DELIVERIES_HEADER,
    GIVE_BACKS_HEADER,
    REASON_HEADER,
    copy_message,
    give_backs,
)
from worker.brokers.rabbitmq.settings import CONNECTION_LOST, RabbitMQSettings
from worker.brokers.rabbitmq.topology import declare_topology
from worker.errors import SettlementLost

if TYPE_CHECKING:
    import aio_pika
    from aio_pika.abc import (
        AbstractExchange,
        AbstractIncomingMessage,
        AbstractRobustChannel,
        AbstractRobustConnection,
    )

_MAX_REASON = 2000
_LOST_EVENTS = {"ack": "acks_lost", "nack": "nacks_lost", "dead-letter": "dead_letters_lost"}
_HOLD_FIRST_DELAY = 0.5  # seconds before a refused copy is tried again, doubling
_HOLD_MAX_DELAY = 30.0


class Handle:
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


class Channels(Protocol):
    """What the copies read of the consumer's connection (its state, kept there)."""

    @property
    def generation(self) -> int:
        """The current channel's generation: a handle of another one has a void tag."""
        ...

    @property
    def consuming(self) -> bool:
        """False once the worker is stopping: nothing is held for a copy any more."""
        ...

    @property
    def connection(self) -> AbstractRobustConnection | None: ...

    @property
    def publisher(self) -> AbstractRobustChannel | None:
        """The channel with publisher confirms the copies go out on."""
        ...

    @property
    def strict(self) -> bool:
        """The work queue was declared at-least-once (False: an earlier version's)."""
        ...

    def settled(self, handle: Handle) -> None:
        """The handle's settling frame went out."""
        ...


class GiveBacks:
    """Copies, holds, parks and requeues for one consumer; counts into its ``stats``."""

    def __init__(
        self, settings: RabbitMQSettings, stats: Counter[str], log: Any, channels: Channels
    ) -> None:
        self.settings = settings
        self.stats = stats
        self._log = log
        self._channels = channels
        self._exchanges: dict[str, AbstractExchange] = {}

    @contextlib.asynccontextmanager
    async def settling(
        self, handle: Handle, verb: str, give_back: bool = False, deliveries: int = 1
    ) -> AsyncIterator[None]:
        """Bound one settlement step in time and translate vendor errors to SettlementLost.

        ``give_back``: the step is the copy's publish, and the original is still held
        on a live channel, where nothing would ever return it: requeue it first.
        ``deliveries``: how many the step settles (a multiple-ack: its whole run).
        """
        if handle.generation != self._channels.generation:
            self.stats[_LOST_EVENTS[verb]] += deliveries
            raise SettlementLost(f"{verb} {handle.message.message_id!r}: its connection was lost")
        try:
            async with asyncio.timeout(self.settings.settle_timeout):
                yield
        except CONNECTION_LOST as exc:
            self.stats[_LOST_EVENTS[verb]] += deliveries
            requeued = give_back and await self.requeue(handle)
            note = "; the original was requeued" if requeued else ""
            raise SettlementLost(f"{verb} {handle.message.message_id!r}: {exc!r}{note}") from exc

    async def requeue(self, handle: Handle) -> bool:
        """Best effort ``basic.nack(requeue=True)``, so RabbitMQ really redelivers."""
        if handle.generation != self._channels.generation:
            return False  # a void tag: the broker requeued it with the lost channel
        try:
            async with asyncio.timeout(self.settings.settle_timeout):
                await handle.message.nack(requeue=True)
        except CONNECTION_LOST:
            return False  # the channel is gone after all, and so is the delivery
        self._channels.settled(handle)
        self.stats["requeued_after_failed_copy"] += 1
        return True

    async def nack(self, handle: Handle, delay: float | None, counted: bool) -> None:
        # Always a confirmed copy, never ``basic.nack(requeue=True)``: the copy carries
        # the count (and keeps it where it is when the message is not to blame), works
        # the same on classic queues, and does not depend on whether a RabbitMQ version
        # counts nacks (4.3 reportedly stopped).
        level = await self._give_back_copy(handle, delay, counted, handle.give_backs + 1)
        self.stats["nacks_immediate" if level is None else "nacks_delayed"] += 1

    async def return_unstarted(self, handle: Handle) -> None:
        """Taken from the queue, never started: back at once, its give-backs as they were
        (a lost settlement needs nothing: RabbitMQ requeues what a lost channel held)."""
        with contextlib.suppress(SettlementLost):
            await self._give_back_copy(handle, 0.0, False, handle.give_backs)
            self.stats["nacks_immediate"] += 1
            self.stats["returned_unstarted"] += 1

    async def _give_back_copy(
        self, handle: Handle, delay: float | None, counted: bool, uncounted_give_backs: int
    ) -> float | None:
        level = self.settings.retry_delay(handle.count, delay)
        target = self.settings.queue if level is None else self.settings.retry_queue(level)
        carried = {DELIVERIES_HEADER: handle.count if counted else handle.count - 1}
        carried[GIVE_BACKS_HEADER] = handle.give_backs if counted else uncounted_give_backs
        copy = copy_message(handle.message, **carried)
        park = None if level == self._longest_delay else copy
        await self._copy_then_ack(handle, "nack", copy, "", target, park)
        return level

    async def dead_letter(self, handle: Handle, reason: str) -> None:
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

    @property
    def _park_queue(self) -> str:
        """Where a copy refused for too long goes: the longest delay queue, or without
        delay queues (``WORKER_RABBITMQ_RETRY_DELAYS=[]``) the work queue itself; either
        way a confirmed copy and the original's ack, never a requeue."""
        longest = self._longest_delay
        return self.settings.queue if longest is None else self.settings.retry_queue(longest)

    async def _copy_then_ack(
        self,
        handle: Handle,
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
        try:
            if not self._channels.consuming:  # stopping: nothing to hold for, it goes back
                async with self.settling(handle, verb, give_back=True):
                    await self.publish(copy, exchange, routing_key)
            else:
                await self._copy_held(handle, verb, (copy, exchange, routing_key), park)
        except SettlementLost:
            raise
        except Exception:
            # Not the broker's answer but a fault of ours: an original left unacked on its
            # live channel would never come back, and its slot with it. Requeued, it does
            # come back, as the settlement's failure log says.
            await self.requeue(handle)
            raise
        async with self.settling(handle, verb):
            await handle.message.ack()
        self._channels.settled(handle)

    async def _copy_held(
        self,
        handle: Handle,
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
            if not self._channels.consuming:  # the worker is stopping: give it back now
                self.stats[_LOST_EVENTS[verb]] += 1
                requeued = await self.requeue(handle)
                note = "; the original was requeued" if requeued else ""
                raise SettlementLost(f"{verb} {handle.message.message_id!r}: {error!r}{note}")
            held = time.monotonic() - held_since
            if park is not None and not parked and held >= self.settings.copy_hold:
                publish = (park, "", self._park_queue)
                parked = True
                self._log.warning(
                    "copy refused for too long, parking the message",
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
                    target=publish[1] or publish[2],
                    error=error,
                )
            await self._repair_topology()
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2.0, _HOLD_MAX_DELAY)
        if parked:
            self.stats["copies_parked"] += 1

    async def _try_publish(
        self, handle: Handle, verb: str, message: aio_pika.Message, exchange: str, key: str
    ) -> BaseException | None:
        """One confirmed publish: None, or why the broker refused it on a live channel.

        Raises ``SettlementLost`` once the original's channel is gone: the broker then
        requeues the original itself.
        """
        channels = self._channels
        error: BaseException | None = None
        if handle.generation == channels.generation:
            try:
                async with asyncio.timeout(self.settings.settle_timeout):
                    await self.publish(message, exchange, key)
            except CONNECTION_LOST as exc:
                error = exc
            if error is None or (
                handle.generation == channels.generation
                and channels.connection is not None
                and not channels.connection.is_closed
            ):
                return error
        self.stats[_LOST_EVENTS[verb]] += 1
        raise SettlementLost(
            f"{verb} {handle.message.message_id!r}: its connection was lost ({error!r})"
        )

    async def _repair_topology(self) -> None:
        """Declare the topology again (a returned copy means a queue was deleted), on a
        channel of its own; best effort, the next try says whether it helped."""
        connection = self._channels.connection
        if connection is None or connection.is_closed:
            return
        with contextlib.suppress(*CONNECTION_LOST):
            channel = await connection.channel()
            try:
                await declare_topology(channel, self.settings, at_least_once=self._channels.strict)
            finally:
                with contextlib.suppress(*CONNECTION_LOST):
                    await channel.close()

    async def publish(self, message: aio_pika.Message, exchange: str, routing_key: str) -> None:
        """One publish, mandatory, on the confirming channel; returns once confirmed."""
        publisher = self._channels.publisher
        assert publisher is not None
        # Publishing on a robust channel waits out a reconnect; the ack after it
        # then fails on the old channel and the original comes back anyway.
        target = self._exchanges.get(exchange)
        if target is None:
            target = self._exchanges[exchange] = (
                await publisher.get_exchange(exchange, ensure=False)
                if exchange
                else publisher.default_exchange
            )
        await target.publish(message, routing_key, mandatory=True)
