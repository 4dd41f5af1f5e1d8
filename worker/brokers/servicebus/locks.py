"""The locks the consumer holds: one settlement handle per locked message, and its renewal.

Every message gets the SDK's own ``AutoLockRenewer``, one per message, so that renewal
stops the moment the message is settled or given up on, whatever the settlement's
outcome (the SDK's renewer cannot drop one message, and would otherwise keep a message
whose complete failed locked for the whole renewal window). Renewal ends
``WORKER_SERVICEBUS_MAX_LOCK_RENEWAL`` after the receive; shortly before that (the
*margin*), a message still unsettled is given back uncounted (the consumer's
``withdraw``), because a lock that runs out brings the message back counted. A delayed
nack holds the lock only while the renewer still renews it (:func:`hold_for`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from azure.servicebus.aio import AutoLockRenewer

if TYPE_CHECKING:
    from azure.servicebus import ServiceBusReceivedMessage
    from azure.servicebus.aio import ServiceBusReceiver

    from worker.brokers.servicebus.links import Link

_HOLD_MARGIN = 5.0  # renewal-based deadlines end this long before renewal does (at most)


class Lock:
    """The settlement handle: one locked message and the receiver that holds its lock."""

    __slots__ = (
        "count",
        "done",
        "give_backs",
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
        self,
        link: Link,
        message: ServiceBusReceivedMessage,
        message_id: str | None,
        count: int,
        give_backs: int = 0,
    ) -> None:
        self.link = link
        self.message = message
        self.message_id = message_id
        self.count = count  # the pump's delivery count, from 1
        self.give_backs = give_backs  # uncounted give-backs so far, carried by the copies
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


def margin(window: float) -> float:
    return min(_HOLD_MARGIN, window / 4)


def renew(
    handle: Lock,
    window: float,
    failed: Callable[[Lock, Any, Exception | None], Awaitable[None]],
    ending: Callable[[Lock], None],
) -> None:
    """Renew the handle's lock for ``window`` seconds; call ``ending`` a margin before."""
    if window <= 0:
        return
    handle.renewer = AutoLockRenewer(
        max_lock_renewal_duration=window,
        on_lock_renew_failure=functools.partial(failed, handle),
    )
    # The renewer only calls renew_message_lock on the receiver it is given.
    handle.renewer.register(cast("ServiceBusReceiver", handle.link.receiver), handle.message)
    # A message still unsettled when renewal ends (the pump paused by a database
    # outage, a delivery parked behind its key) would lose its lock and come back counted.
    loop = asyncio.get_running_loop()
    handle.withdraw = loop.call_later(window - margin(window), ending, handle)


def stop_renewal(handle: Lock, pending: set[asyncio.Task[None]]) -> None:
    """Stop renewing at once (the renewer's close waits for its 1 s tick: not here)."""
    if handle.withdraw is not None:
        handle.withdraw.cancel()
        handle.withdraw = None
    if handle.renewer is not None:
        ending = asyncio.create_task(handle.renewer.close())
        pending.add(ending)
        ending.add_done_callback(pending.discard)


def hold_for(handle: Lock, delay: float, window: float) -> float:
    """How long a delayed nack may keep the lock: only while the renewer still renews it.

    Past the renewal window the lock expires unseen and the entity re-offers the message
    while the consumer would still count it against its slots. Renewal off (``window``
    0), or the lock already lost: not at all.
    """
    left = 0.0
    if window > 0 and handle.lost is None:
        left = handle.received + window - margin(window) - time.monotonic()
    return max(0.0, min(delay, left))
