"""The pump's Broker on one Service Bus queue or topic subscription, in PEEK_LOCK mode:
its links (client and receiver), the locks it holds and renews, and how it settles.

The consumer keeps its own settlement handles: each fetched message's ``_Lock``
waits in the inbox next to its Delivery, and the pump hands the lock back to
:meth:`ServiceBusConsumer.ack` and the other verbs.

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
import functools
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage, ServiceBusReceiveMode
from azure.servicebus.aio import AutoLockRenewer
from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    MessageNotFoundError,
    MessageSizeExceededError,
    ServiceBusError,
    SessionLockLostError,
)

from worker.brokers import IdentityFunc
from worker.brokers.servicebus import messages
from worker.brokers.servicebus.client import (
    _SEND_CHUNK,
    Client,
    ClientFactory,
    Receiver,
    Sender,
    _describe,
    _quietly,
)
from worker.brokers.servicebus.messages import (
    COPIED_AT_PROPERTY,
    DELIVERIES_PROPERTY,
    TypeResolver,
    _given_back,
    _headers,
    _text,
    body_of,
    default_message_id,
)
from worker.brokers.servicebus.settings import ServiceBusSettings
from worker.delivery import Delivery
from worker.errors import AlreadySettled, BrokerUnavailable, SettlementLost
from worker.logs import get_logger
from worker.retry import backoff

if TYPE_CHECKING:
    from azure.servicebus.aio import ServiceBusReceiver

_REASON_LIMIT = 256
_DESCRIPTION_LIMIT = 4096
_LOCK_LOST = (MessageLockLostError, SessionLockLostError, MessageNotFoundError)
_HOLD_MARGIN = 5.0  # a delayed nack abandons this long before lock renewal ends (at most)
_MAX_LOCK_DURATION = 300.0  # Service Bus's longest lock duration, s
_SKEW_LOG_EVERY = 60.0  # one clock-skew warning a minute; the counter counts every message


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
        self.destination = settings.entity  # the queue, or "topic/subscription"
        self.stats: Counter[str] = Counter()
        self._factory = client_factory
        self._identity = identity
        self._type_of = TypeResolver(settings)
        self._on_close = on_close
        self._log = get_logger(broker="servicebus", entity=settings.entity)
        self._inbox: asyncio.Queue[tuple[_Lock, Delivery]] = asyncio.Queue()  # fetched, untaken
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
        handle, delivery = await self._inbox.get()
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
            handle, _delivery = self._inbox.get_nowait()
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
            # abandoned, or its lock expired in a consumer that never settled it: Service
            # Bus tells the two apart by nothing, so either may have been running there
            suspect=(message.delivery_count or 0) > 0,
        )
        self._inbox.put_nowait((handle, delivery))

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
        now = messages._wall()  # looked up on the module: tests move this one clock
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
            kept: list[tuple[_Lock, Delivery]] = []
            while not self._inbox.empty():  # bounded by the inbox's size; no await in between
                entry = self._inbox.get_nowait()
                if entry[0] is not handle:
                    kept.append(entry)
            for entry in kept:
                self._inbox.put_nowait(entry)
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

    async def ack_many(self, handles: Sequence[_Lock]) -> list[_Lock]:
        """Service Bus completes one message per call: each on its own; the lost ones."""
        lost = []
        for handle in handles:
            try:
                await self.ack(handle)
            except SettlementLost:
                lost.append(handle)
        return lost

    def keep_alive(self, handle: _Lock, seconds: float) -> None:
        """The lock renewer keeps the lock for WORKER_SERVICEBUS_MAX_LOCK_RENEWAL already."""

    async def in_commit(self, session: Any, handles: Sequence[_Lock]) -> None:
        """Nothing of Service Bus commits with the handler's transaction."""

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


__all__ = ["ServiceBusConsumer"]
