"""Uncounted give-backs: a copy that carries the counts, confirmed before the original goes.

Service Bus has no settlement that returns a message without counting:
``abandon_message`` raises its DeliveryCount, and so does a lock that runs out. So a
give-back the message is not to blame for sends a copy to the queue (the same message,
plus ``x-worker-deliveries``, the deliveries spent so far, ``x-worker-give-backs``, the
uncounted give-backs so far, and ``x-worker-copied-at``, the send's local time), waits
for the broker to take it, and only then does the consumer complete the original.

The counts are honoured only on the worker's own copy (:meth:`GiveBacks.carried`): its
enqueued time (the broker's clock) must lie within one send's bound, give or take the
clock-skew tolerance, of the stamp. A dead letter an operator moves back later, with the
properties copied, is enqueued long after the stamp and starts from nothing again.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from azure.servicebus.exceptions import MessageSizeExceededError, ServiceBusError

from worker.brokers.servicebus.client import SEND_CHUNK, describe
from worker.brokers.servicebus.messages import (
    COPIED_AT_PROPERTY,
    DELIVERIES_PROPERTY,
    GIVE_BACKS_PROPERTY,
    given_back,
    text,
)

if TYPE_CHECKING:
    from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage

    from worker.brokers.servicebus.links import Link
    from worker.brokers.servicebus.locks import Lock
    from worker.brokers.servicebus.settings import ServiceBusSettings


class Carried(NamedTuple):
    """What the worker's own copy carried over from the message it replaced."""

    deliveries: int
    give_backs: int


class GiveBacks:
    """Sends the give-back copies and reads back what a received copy carries."""

    def __init__(self, settings: ServiceBusSettings, stats: Counter[str], log: Any) -> None:
        self.settings = settings
        self._stats = stats
        self._log = log

    def carried(self, message: ServiceBusReceivedMessage, message_id: str | None) -> Carried:
        """Deliveries spent and give-backs made before the worker's own copy, else zero."""
        properties = message.application_properties or {}

        def read(name: str) -> Any:
            return properties.get(name.encode(), properties.get(name))

        raw = read(DELIVERIES_PROPERTY)
        if raw is None:
            return Carried(0, 0)
        stamp, backs = read(COPIED_AT_PROPERTY), read(GIVE_BACKS_PROPERTY)
        enqueued = message.enqueued_time_utc
        try:
            carried, copied_at = int(text(raw)), int(text(stamp)) / 1000
            give_backs = 0 if backs is None else int(text(backs))  # copies of older releases
        except (TypeError, ValueError):
            carried, copied_at, give_backs = -1, 0.0, 0
        tolerance = self.settings.clock_skew_tolerance
        if carried >= 0 and give_backs >= 0 and enqueued is not None:
            lag = enqueued.timestamp() - copied_at
            if -tolerance <= lag <= self.settings.operation_bound + tolerance:
                return Carried(carried, give_backs)
        self._stats["carried_count_ignored"] += 1
        self._log.info(
            "servicebus carried delivery count ignored: not the worker's own give-back",
            message_id=message_id,
            carried=text(raw),
            give_backs=text(backs),
            copied_at=text(stamp),
            enqueued=enqueued.isoformat() if enqueued is not None else None,
        )
        return Carried(0, 0)

    async def send(self, handles: Sequence[Lock], link: Link, *, counts: bool) -> set[Lock]:
        """Send each handle's copy on ``link`` and wait for the broker; the confirmed ones.

        ``counts``: the copy records one more give-back (the pump's uncounted nack); a
        message the worker returns on its own (never taken, or its renewal ending) keeps
        the give-backs it had.
        """
        assert self.settings.queue is not None  # a topic copy would reach every subscription
        sent: set[Lock] = set()
        copies: dict[Lock, ServiceBusMessage] = {}
        for handle in handles:
            try:
                copies[handle] = given_back(
                    handle.message, handle.count - 1, handle.give_backs + int(counts)
                )
            except ValueError as exc:  # an id the SDK refuses to send (over 128 characters)
                self._failed([handle], exc)
        chunks = [list(copies)[n : n + SEND_CHUNK] for n in range(0, len(copies), SEND_CHUNK)]
        for chunk in chunks:
            try:
                async with asyncio.timeout(self.settings.operation_bound):
                    if link.sender is None:
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
                                self._failed([handle], exc)
            except (ServiceBusError, ValueError, TimeoutError) as exc:  # ValueError: UTF-8
                self._failed([h for h in chunk if h not in sent], exc)
        self._stats["given_back_uncounted"] += len(sent)
        return sent

    def _failed(self, handles: list[Lock], exc: Exception) -> None:
        self._stats["give_back_copy_failed"] += len(handles)
        self._log.warning(
            "servicebus uncounted give-back failed to send its copy, abandoning (counted)",
            message_ids=[h.message_id for h in handles],
            error=describe(exc),
        )
