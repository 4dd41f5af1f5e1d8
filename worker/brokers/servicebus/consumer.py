"""The pump's Broker on one Service Bus queue or topic subscription, in PEEK_LOCK mode.

The consumer receives through a link (:mod:`~worker.brokers.servicebus.links`), keeps one
lock per message it holds (:mod:`~worker.brokers.servicebus.locks`), checks each
message's timestamps against the local clock (:mod:`~worker.brokers.servicebus.clock`),
and settles. Each fetched message's :class:`~worker.brokers.servicebus.locks.Lock` waits
in the inbox next to its Delivery, and the pump hands the lock back to
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
  count, so a copy carrying the counts so far is sent to the queue, confirmed, and only
  then is the original completed (:mod:`~worker.brokers.servicebus.giveback`). The same
  happens to fetched messages the pump never took, at shutdown, and to any message
  still unsettled when its lock renewal ends. On a topic subscription a copy would
  reach every subscription, so there it is a (counted) abandon.
- ``dead_letter(reason)``: ``dead_letter_message(reason=..., error_description=...)``
  into the entity's ``$DeadLetterQueue``.

Any settlement the broker refuses (``MessageLockLostError``, a closed receiver,
a connection error) becomes :class:`~worker.errors.SettlementLost`: the lock
runs out, the message comes back, and the inbox absorbs whatever did commit.
The pump's delivery count is the SDK's ``delivery_count`` (0 on a first delivery)
+ 1, + what the worker's own give-back copy carried (``give_backs`` too).

Receiving runs in a loop of its own: the SDK retries internally and then raises, and
the loop opens a new link with jittered backoff, reporting not-ready meanwhile.
Sessions are not supported (see docs/servicebus.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    MessageNotFoundError,
    ServiceBusError,
    SessionLockLostError,
)

from worker.brokers import IdentityFunc
from worker.brokers.servicebus import locks
from worker.brokers.servicebus.client import describe
from worker.brokers.servicebus.clock import ClockCheck
from worker.brokers.servicebus.giveback import GiveBacks
from worker.brokers.servicebus.links import Link, close_link, open_error, open_link
from worker.brokers.servicebus.locks import Lock
from worker.brokers.servicebus.messages import (
    TypeResolver,
    body_of,
    default_message_id,
    handler_headers,
)
from worker.delivery import Delivery, ack_each
from worker.errors import AlreadySettled, SettlementLost
from worker.logs import get_logger
from worker.retry import backoff

if TYPE_CHECKING:
    from azure.servicebus import ServiceBusReceivedMessage

    from worker.brokers.servicebus.client import ClientFactory
    from worker.brokers.servicebus.settings import ServiceBusSettings

_REASON_LIMIT = 256
_DESCRIPTION_LIMIT = 4096
_LOCK_LOST = (MessageLockLostError, SessionLockLostError, MessageNotFoundError)


class ServiceBusConsumer:
    """The pump's :class:`~worker.brokers.Broker` for one queue or subscription."""

    name = "servicebus"
    watches = True  # keep_alive renews the lock
    writes_in_commit = False

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
        self._clock = ClockCheck(settings.clock_skew_tolerance, self.stats, self._log)
        self._give_backs = GiveBacks(settings, self.stats, self._log)
        self._inbox: asyncio.Queue[tuple[Lock, Delivery]] = asyncio.Queue()  # fetched, untaken
        self._link: Link | None = None
        self._links: set[Link] = set()
        self._locks: set[Lock] = set()
        self._credit = asyncio.Event()
        self._limit = 1
        self._loop_task: asyncio.Task[None] | None = None
        self._later: set[asyncio.Task[None]] = set()
        self._returning: set[asyncio.Task[None]] = set()  # untaken, given back before renewal ends
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

    @property
    def clock_skew(self) -> float:
        """The last clock skew seen (local minus broker, a lower bound), s."""
        return self._clock.skew

    async def start(self, prefetch: int) -> None:
        """Open the first receiver, then receive in the background.

        A failed open is :class:`~worker.errors.ConfigurationError` when no retry can fix
        it (credentials or permissions refused, no such entity) and
        :class:`~worker.errors.BrokerUnavailable` otherwise, each with a one-line reason.
        """
        self._limit = prefetch
        try:
            self._link = await self._connect()
        except Exception as exc:
            raise open_error(self.settings, exc) from None
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
        waiting: list[Lock] = []
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
                await self._return_uncounted(waiting, counts=False)
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

    # -- links ----------------------------------------------------------------------

    async def _connect(self) -> Link:
        prefetch = self._limit if self.settings.prefetch is None else self.settings.prefetch
        link = await open_link(self._factory, self.settings, prefetch)
        self._links.add(link)
        self._log.info("servicebus receiver open", prefetch=prefetch)
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
                    error=describe(exc),
                    attempt=failures,
                    retry_in_s=round(delay, 2),
                )
                await asyncio.sleep(delay)

    async def _retire(self, link: Link) -> None:
        """Stop using a receiver; keep it open while its messages can still be settled."""
        link.retired = True
        if link.unsettled == 0:
            await self._close_link(link)

    async def _close_link(self, link: Link) -> None:
        self._links.discard(link)
        await close_link(link)

    # -- receiving ------------------------------------------------------------------

    async def _receive_batch(self, link: Link) -> None:
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

    def _accept(self, link: Link, message: ServiceBusReceivedMessage) -> None:
        try:
            message_id = self._identity(message)
        except Exception as exc:  # a deployment's id function must not sink the whole batch
            self.stats["identity_failed"] += 1
            self._log.warning(
                "message id function failed",
                error=describe(exc),
                broker_message_id=default_message_id(message),
                sequence_number=message.sequence_number,
                delivery_count=(message.delivery_count or 0) + 1,
                outcome="no-message-id",
            )
            message_id = None  # the pump dead-letters it: "no message id"
        self._clock(message, message_id)
        carried = self._give_backs.carried(message, message_id)
        count = carried.deliveries + (message.delivery_count or 0) + 1
        handle = Lock(link, message, message_id, count, carried.give_backs)
        link.unsettled += 1
        self._locks.add(handle)
        locks.renew(handle, self.settings.max_lock_renewal, self._renewal_failed, self._withdraw)
        delivery = Delivery(
            message_id,
            self._type_of(message),
            body_of(message),
            handler_headers(message),
            count,
            self,
            handle,
            # abandoned, or its lock expired in a consumer that never settled it: Service
            # Bus tells the two apart by nothing, so either may have been running there
            suspect=(message.delivery_count or 0) > 0,
            give_backs=carried.give_backs,
        )
        self._inbox.put_nowait((handle, delivery))

    # -- locks ----------------------------------------------------------------------

    def _withdraw(self, handle: Lock) -> None:
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
            kept: list[tuple[Lock, Delivery]] = []
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
        task = asyncio.create_task(self._return_quietly([handle], counts=False))
        self._returning.add(task)
        task.add_done_callback(self._returning.discard)

    async def _renewal_failed(self, handle: Lock, _renewable: Any, error: Exception | None) -> None:
        """The renewer gave up on a lock still in use: whatever the handler does, no complete.

        A delayed nack waiting on that lock holds nothing any more: the entity re-offers
        the message on its own, so the wait ends here and the slot is free again.
        """
        if handle.done:
            return
        handle.lost = describe(error) if error is not None else "lock expired before it was renewed"
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

    def _hold_for(self, handle: Lock, delay: float) -> float:
        hold = locks.hold_for(handle, delay, self.settings.max_lock_renewal)
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

    # -- Settler --------------------------------------------------------------------

    def _refuse_reclaimed(self, handle: Lock, verb: str) -> None:
        handle.settling = True
        if handle.reclaimed:
            self.stats["settlement_lost"] += 1
            raise SettlementLost(
                f"message {handle.message_id!r}: not {verb}, given back before its lock "
                "renewal ended"
            )

    async def ack(self, handle: Lock) -> None:
        self._refuse_reclaimed(handle, "completed")
        if handle.lost is not None:
            await self._finish(handle)
            raise SettlementLost(f"message {handle.message_id!r}: not completed, {handle.lost}")
        await self._settle(handle, "complete", handle.link.receiver.complete_message)

    async def ack_many(self, handles: Sequence[Lock]) -> list[Lock]:
        """Service Bus completes one message per call: each on its own; the lost ones."""
        return await ack_each(self.ack, handles)

    def keep_alive(self, handle: Lock, seconds: float) -> None:
        """The lock renewer keeps the lock for WORKER_SERVICEBUS_MAX_LOCK_RENEWAL already."""

    async def in_commit(self, session: Any, handles: Sequence[Lock]) -> None:
        """Nothing of Service Bus commits with the handler's transaction."""

    async def nack(self, handle: Lock, delay: float | None, counted: bool = True) -> None:
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
        [error] = await self._return_uncounted([handle], counts=True)
        if error is not None:
            raise error

    async def dead_letter(self, handle: Lock, reason: str) -> None:
        self._refuse_reclaimed(handle, "dead-lettered")
        description = f"dead-lettered by the worker on delivery {handle.count}: {reason}"

        async def dead_letter(message: ServiceBusReceivedMessage) -> None:
            await handle.link.receiver.dead_letter_message(
                message,
                reason=reason[:_REASON_LIMIT],
                error_description=description[:_DESCRIPTION_LIMIT],
            )

        await self._settle(handle, "dead-letter", dead_letter)

    # -- giving back ----------------------------------------------------------------

    async def _return_uncounted(
        self, handles: list[Lock], *, counts: bool
    ) -> list[SettlementLost | None]:
        """Give messages back without spending a delivery: copies first, then the originals.

        Each copy is confirmed by the broker before its original is completed, so a
        failure in between leaves a duplicate (the inbox drops it), never a loss. What
        cannot be copied (a topic subscription, a lock known lost, a refused send) is
        abandoned instead, which counts. ``counts``: the pump gave it back (one more
        give-back on the copy). Returns, per handle, the settlement error or None.
        """
        copyable = [h for h in handles if h.lost is None] if self.settings.queue else []
        sent: set[Lock] = set()
        if copyable:
            link = self._link if self._link is not None else copyable[0].link
            sent = await self._give_backs.send(copyable, link, counts=counts)
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

    async def _return_quietly(self, handles: list[Lock], *, counts: bool) -> None:
        for handle, error in zip(
            handles, await self._return_uncounted(handles, counts=counts), strict=True
        ):
            if error is not None:
                self._log.info(
                    "servicebus give-back failed, lock will expire",
                    message_id=handle.message_id,
                    error=str(error),
                )

    async def _abandon_later(self, handle: Lock, hold: float, counted: bool) -> None:
        try:
            await asyncio.sleep(hold)  # the renewer keeps the lock meanwhile
        finally:
            handle.later = None
            if counted:
                await self._give_back(handle)
            elif not handle.done:
                await self._return_quietly([handle], counts=True)

    async def _give_back(self, handle: Lock) -> None:
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
        handle: Lock,
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
                f"message {handle.message_id!r}: {verb}: lock lost: {describe(exc)}"
            ) from None
        except (ServiceBusError, ValueError, TimeoutError) as exc:  # ValueError: receiver closed
            self.stats["settlement_lost"] += 1
            raise SettlementLost(
                f"message {handle.message_id!r}: {verb} failed: {describe(exc)}"
            ) from None
        finally:
            await self._finish(handle)

    async def _finish(self, handle: Lock) -> None:
        if handle.done:
            return
        handle.done = True
        self._locks.discard(handle)
        self._credit.set()
        locks.stop_renewal(handle, self._renewals_ending)
        link = handle.link
        link.unsettled -= 1
        if link.retired and link.unsettled == 0 and link in self._links:
            await self._close_link(link)


__all__ = ["ServiceBusConsumer"]
