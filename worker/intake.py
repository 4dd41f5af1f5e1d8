"""Intake: deliveries in, units of work out.

One reader task takes deliveries from the broker and, for each:

1. refuses what no handler can run, dead-lettering it at once with the reason: what
   the adapter could not read (``Delivery.refusal``), no usable id (missing, empty, not
   a string, longer than the inbox stores), no handler for its type, a body that does
   not decode or validate (whatever the validator raises), a key function that fails
   or returns something unhashable. Each of these fails the same way on every
   delivery, so none of them may be a counted nack that comes back for ever;
2. runs a suspect alone. A suspect is a delivery the broker took back from a consumer
   that never settled it: any of them may be what killed that process. The reader
   waits until nothing else is in flight, hands it out, and takes nothing more until
   it is settled, so a further death charges only the message that caused it, and a
   delivery that ran beside the killer spends one count, for that one death. Where
   every start is recorded (batch mode, or ``WORKER_COUNT_FIRST_DELIVERIES``), a
   suspect whose start the database never saw was only held, not running: it is no
   suspect, and runs as any other delivery;
3. in batch mode, puts a delivery that may share a transaction into its bucket
   (one per message type and delivery group); a key belongs to one open bucket at a
   time (a delivery whose key a running batch holds waits for it before it joins one,
   unless it has a group: then it joins its group's bucket, which waits for the key),
   and a group's open bucket is cut as soon as a delivery of another type, or one that
   must run on its own, arrives in that group, so a partition's records still run in
   offset order. A bucket is handed out full, or by a timer once its first delivery
   has waited ``WORKER_BATCH_WAIT``;
4. hands the unit of work out through its lanes: work holds its key and its delivery
   group while it runs, and work that shares one waits behind it, in arrival order.
   One key may park at most ``concurrency`` (batch mode: a batch) deliveries: the
   excess goes back uncounted after a delay, so a hot key cannot fill the prefetch
   and starve the others; a delivery that came back that way three times waits in
   the lane regardless, so no delivery is turned away for ever.

Nothing that goes wrong with one delivery ends intake: an unexpected error is logged
and the delivery settled as a bug (nacked, dead-lettered on its last allowed delivery).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from worker import attempts, inbox
from worker.verdict import GIVE_BACK_DELAY, Outcome, Verb, Verdict, poison, unexpected
from worker.work import Item, Messages, Work

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from worker.brokers import Broker
    from worker.delivery import Delivery
    from worker.health import DatabaseHealth
    from worker.registry import Handler, Registry
    from worker.settings import Settings
    from worker.settle import Settlement

Lane = tuple[str, Hashable]
"""What a unit of work holds while it runs: ("key", its key) or ("group", its group)."""

_BOM = b"\xef\xbb\xbf"
_PARKED_REGARDLESS = 3
"""Give-backs for a busy key after which a delivery waits in its key's lane regardless."""
_ALONE_WAIT = 30.0
"""Seconds a suspect waits for the work in flight to settle. Past it, it runs beside what
is still there (hung work, which WORKER_HANDLER_TIMEOUT bounds) rather than halt intake."""


class _Bucket:
    """Deliveries of one type and group filling one batch."""

    __slots__ = ("by_id", "group", "items", "lanes", "type")

    def __init__(self, message_type: str, group: Hashable) -> None:
        self.type = message_type
        self.group = group
        self.items: list[Item] = []
        self.by_id: dict[str, Item] = {}
        self.lanes: set[Lane] = set()


def _lanes(item: Item) -> Iterator[Lane]:
    if item.key is not None:
        yield ("key", item.key)
    group = item.delivery.group
    if group is not None:
        yield ("group", group)


class Intake:
    """The pump's only broker reader, and the lanes and buckets between it and the workers."""

    def __init__(
        self,
        broker: Broker,
        engine: AsyncEngine,
        registry: Registry,
        settings: Settings,
        health: DatabaseHealth,
        settlement: Settlement,
        stats: Counter[str],
        log: Any,
    ) -> None:
        self._broker = broker
        self._engine = engine
        self._registry = registry
        self._settings = settings
        self._health = health
        self._settlement = settlement
        self._stats = stats
        self._log = log
        self._size = settings.batch_size
        self._wait = settings.batch_wait
        self._park_limit = max(settings.concurrency, self._size)
        self._batchable = {
            message_type: all(h.batchable for h in registry.for_type(message_type))
            for message_type in registry.message_types
        }
        self._ready: asyncio.Queue[Work] = asyncio.Queue()
        self._lanes: dict[Lane, deque[Work]] = {}  # busy lane -> work waiting for it
        self._buckets: dict[tuple[str, Hashable], _Bucket] = {}
        self._open: dict[Lane, _Bucket] = {}  # lane -> the open bucket holding it
        self._running: set[Work] = set()
        self._running_ids: Counter[str] = Counter()  # message ids in the running work
        self._suspect: Work | None = None  # the suspect running alone
        self._arrivals = 0  # deliveries taken so far: each item's place in arrival order
        self._changed = asyncio.Event()
        self._turned_away: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.in_flight = 0
        """Deliveries in the units of work the workers hold now."""

    # -- the workers' side --------------------------------------------------------------

    async def next(self) -> Work:
        """The next unit of work (cancel-safe: a cancelled wait takes nothing)."""
        work = await self._ready.get()
        self._running.add(work)
        self._running_ids.update(item.delivery.message_id or "" for item in work.items)
        self.in_flight += work.size
        work.started = time.monotonic()
        return work

    def done(self, work: Work) -> None:
        """The work is settled: free its lanes, and run again what it left (deferred
        members of a batch, twins of a member that did not commit), first in its lanes."""
        if work not in self._running:
            return
        if work is self._suspect:
            self._suspect = None
        self._running.discard(work)
        self._running_ids.subtract(item.delivery.message_id or "" for item in work.items)
        self.in_flight -= work.size
        again: list[Item] = []
        for item in work.items:
            if item.deferred:  # runs again on its own, its twins with it (settled with it)
                item.deferred, item.verdict, item.consumer = False, None, None
                again.append(item)
                continue
            if item.verdict is not None and item.verdict.verb is not Verb.ACK:
                again.extend(item.twins)
            item.twins = []
        waiting: list[Work] = []
        for lane in work.lanes:
            waiting.extend(self._lanes.pop(lane, ()))
        if work.items[0].delivery.group is not None:
            # Work parks behind the first busy lane it needs: what waited in different
            # lanes of this work goes again in the order it arrived, so a group's work
            # keeps its order. (Without groups, each key's lane is in order already, and
            # a key's seeds going on together fill batches with that key.)
            waiting.sort(key=_arrival)
        for item in again:
            self._admit(self._single(item, work.handlers))
        for parked in waiting:
            self._admit(parked)
        self._changed.set()

    def unstarted(self) -> list[Item]:
        """At shutdown: every item taken from the broker and never handed to a worker."""
        items: list[Item] = []
        while not self._ready.empty():
            items.extend(_with_twins(self._ready.get_nowait().items))
        for waiting in self._lanes.values():
            for work in waiting:
                items.extend(_with_twins(work.items))
        self._lanes.clear()
        for bucket in self._buckets.values():
            items.extend(_with_twins(bucket.items))
        self._buckets.clear()
        self._open.clear()
        return items

    def running(self) -> list[Work]:
        return list(self._running)

    # -- the reader ---------------------------------------------------------------------

    async def run(self) -> None:
        """Receive until cancelled; the only caller of ``broker.receive``."""
        while not self._stopping:
            await self._health.wait_available()
            try:  # no timeout here: a bucket ripens on a timer of its own (_bucket)
                delivery = await self._broker.receive()
            except Exception as exc:  # an adapter bug must not silently stop intake
                self._log.error("receive failed", error=exc)
                await asyncio.sleep(1.0)
                continue
            try:
                await self._take(delivery)
            except Exception as exc:  # nothing that goes wrong with one delivery ends intake
                self._log.exception(
                    "intake failed on a delivery",
                    message_id=repr(delivery.message_id),
                    attempt=0,
                    outcome="nacked",
                )
                count, limit = delivery.delivery_count, self._settings.max_deliveries
                item = Item(delivery, {})
                item.consumer = ""
                await self._settlement.one(item, unexpected(count, limit, exc))

    def stop(self) -> None:
        self._stopping = True
        self._changed.set()

    async def settled(self) -> None:
        """Wait for the give-backs of turned-away deliveries still under way."""
        await asyncio.gather(*self._turned_away, return_exceptions=True)

    async def _take(self, delivery: Delivery) -> None:
        handlers = self._handlers(delivery)
        item, refused = self._prepare(delivery, handlers)
        item.arrival = self._arrivals = self._arrivals + 1
        if refused is not None:
            item.verdict = refused
            self._ready.put_nowait(Work([item]))
            return
        if delivery.suspect and await self._runs_alone(item, handlers):
            await self._alone(self._single(item, handlers, alone=True))
        elif self._size > 1 and self._may_batch(delivery):
            self._bucket(item, handlers)
        else:
            if self._size > 1:
                self._cut(item)
            self._admit(self._single(item, handlers), fresh=True)

    def _handlers(self, delivery: Delivery) -> tuple[Handler[Any], ...]:
        message_type = delivery.type
        return self._registry.for_type(message_type) if isinstance(message_type, str) else ()

    def _prepare(
        self, delivery: Delivery, handlers: tuple[Handler[Any], ...]
    ) -> tuple[Item, Verdict | None]:
        """Decode once per model and compute the key; or the reason no handler can run it."""
        item = Item(delivery, {})
        unreadable = _unreadable(delivery)
        if unreadable is not None:
            return item, poison(unreadable)
        if not handlers:
            return item, poison(f"no handler for message type {delivery.type!r}")
        body = delivery.body
        if body[:3] == _BOM:  # JSON allows none, but Windows tools write one
            body = body[3:]
        messages: Messages = {}
        for handler in handlers:
            model = handler.model
            if model not in messages:
                try:
                    messages[model] = model.model_validate_json(body)
                except ValidationError as exc:
                    return item, poison(f"invalid body for {delivery.type}: {_first_error(exc)}")
                except Exception as exc:  # a validator's own error: the body, every time
                    reason = f"invalid body for {delivery.type}: {type(exc).__name__}: {exc}"
                    return item, poison(reason)
            if item.key is None and handler.key is not None:
                try:
                    key = handler.key(messages[model])
                    hash(key)
                except Exception as exc:
                    reason = f"{handler.consumer}: key function failed: {type(exc).__name__}: {exc}"
                    return item, poison(reason)
                item.key = key
        item.messages = messages
        return item, None

    def _single(
        self, item: Item, handlers: tuple[Handler[Any], ...], *, alone: bool = False
    ) -> Work:
        return Work([item], handlers, alone=alone, lanes=frozenset(_lanes(item)))

    # -- suspects -----------------------------------------------------------------------

    async def _runs_alone(self, item: Item, handlers: tuple[Handler[Any], ...]) -> bool:
        """Whether a suspect runs alone: always, unless the database can tell it was only
        held (every start is recorded, and this one's never was), or its first copy still
        runs here (it came back on a lost lock, not after a death). Running every delivery
        a dead process held one at a time costs a short queue of one (the prefetch); a
        suspect running beside others would charge them its next death too."""
        if self._running_ids[item.message_id] > 0:
            return False
        settings = self._settings
        if settings.delivery_counts == "database" and attempts.every_start(settings):
            consumer = handlers[0].consumer
            return await attempts.started(self._engine, item.delivery, consumer)
        return True

    async def _alone(self, work: Work) -> None:
        """Run ``work`` with nothing else in flight, and take nothing until it is done."""
        self._stats["suspects"] += 1
        for bucket in list(self._buckets.values()):
            self._release(bucket)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_ALONE_WAIT):
                await self._until_idle()
        self._log.info(
            "running a suspect alone",
            message_id=work.items[0].delivery.message_id,
            delivery_count=work.items[0].delivery.delivery_count,
        )
        self._suspect = work
        self._admit(work)
        while self._suspect is work and not self._stopping:
            self._changed.clear()
            await self._changed.wait()

    async def _until_idle(self) -> None:
        while (self._running or not self._ready.empty()) and not self._stopping:
            self._changed.clear()
            await self._changed.wait()

    # -- lanes --------------------------------------------------------------------------

    def _admit(self, work: Work, *, fresh: bool = False) -> None:
        """Hand ``work`` out, or park it behind the first busy lane it needs."""
        for lane in work.lanes:
            waiting = self._lanes.get(lane)
            if waiting is None:
                continue
            if fresh and lane[0] == "key" and len(waiting) >= self._park_limit:
                delivery = work.items[0].delivery
                if delivery.give_backs < _PARKED_REGARDLESS:
                    self._turn_away(work)
                    return
            waiting.append(work)
            if fresh:
                self._stats["parked"] += 1
            return
        if work.seed:  # a delivery that waited for its key: now it joins a bucket
            self._bucket(work.items[0], work.handlers)
            return
        for lane in work.lanes:
            self._lanes[lane] = deque()
        self._ready.put_nowait(work)

    def _turn_away(self, work: Work) -> None:
        """A key with a full lane: the delivery goes back uncounted, after a delay."""
        self._stats["key-busy"] += 1
        item = work.items[0]
        verdict = Verdict(
            Verb.NACK,
            Outcome.KEY_BUSY,
            f"key busy: {self._park_limit} deliveries already wait for it",
            GIVE_BACK_DELAY,
            counted=False,
        )
        item.verdict, item.consumer = verdict, ""
        task = asyncio.create_task(self._settlement.one(item, verdict))
        self._turned_away.add(task)
        task.add_done_callback(self._turned_away.discard)

    # -- batch mode ---------------------------------------------------------------------

    def _may_batch(self, delivery: Delivery) -> bool:
        # a redelivery runs on its own: it is counted on its own, and may be a suspect
        return self._batchable.get(delivery.type or "", False) and not delivery.redelivered

    def _bucket(self, item: Item, handlers: tuple[Handler[Any], ...]) -> None:
        delivery = item.delivery
        message_type, group = delivery.type or "", delivery.group
        key_lane: Lane | None = ("key", item.key) if item.key is not None else None
        holder = self._open.get(key_lane) if key_lane is not None else None
        if holder is not None and (holder.type, holder.group) != (message_type, group):
            self._release(holder)  # the key's open batch is another type's: it goes first
            holder = None
        if group is not None:
            current = self._open.get(("group", group))
            if current is not None and current.type != message_type:
                self._release(current)  # a partition's records run in offset order
        if key_lane is not None and holder is None and key_lane in self._lanes and group is None:
            # The key runs elsewhere now: wait behind it, then join a bucket. (A delivery
            # of a group joins its group's bucket at once, which then waits for the key:
            # the group's later deliveries must not overtake it.)
            seed = Work([item], handlers, lanes=frozenset({key_lane}), seed=True)
            self._admit(seed, fresh=True)
            return
        bucket = self._buckets.get((message_type, group))
        if bucket is None:
            bucket = _Bucket(message_type, group)
            self._buckets[message_type, group] = bucket
            # ripe after WORKER_BATCH_WAIT, whoever opened it (the reader, or a worker
            # whose key a waiting delivery needed) and whatever the reader waits for
            asyncio.get_running_loop().call_later(self._wait, self._release, bucket)
            if group is not None:
                self._open["group", group] = bucket
        first = bucket.by_id.get(item.message_id)
        if first is not None:
            first.twins.append(item)
            return
        bucket.by_id[item.message_id] = item
        bucket.items.append(item)
        if key_lane is not None:
            bucket.lanes.add(key_lane)
            self._open[key_lane] = bucket
        if len(bucket.items) >= self._size:
            self._release(bucket, handlers)

    def _cut(self, item: Item) -> None:
        """A delivery that runs on its own: its group's and its key's open batches go first."""
        for lane in _lanes(item):
            bucket = self._open.get(lane)
            if bucket is not None:
                self._release(bucket)

    def _release(self, bucket: _Bucket, handlers: tuple[Handler[Any], ...] | None = None) -> None:
        if self._buckets.get((bucket.type, bucket.group)) is not bucket:
            return
        del self._buckets[bucket.type, bucket.group]
        lanes = set(bucket.lanes)
        if bucket.group is not None:
            lanes.add(("group", bucket.group))
        for lane in lanes:
            if self._open.get(lane) is bucket:
                del self._open[lane]
        if handlers is None:
            handlers = self._registry.for_type(bucket.type)
        self._admit(Work(bucket.items, handlers, batch=True, lanes=frozenset(lanes)))


def _arrival(work: Work) -> int:
    return work.items[0].arrival


def _with_twins(items: list[Item]) -> Iterator[Item]:
    for item in items:
        yield item
        yield from item.twins


def _unreadable(delivery: Delivery) -> str | None:
    """Why the delivery has no usable id, or what its adapter could not read (that comes
    first: it is the cause, a missing id only its consequence)."""
    if delivery.refusal is not None:
        return delivery.refusal
    message_id = delivery.message_id
    if message_id is None:
        return "no message id"
    if not isinstance(message_id, str):
        return f"message id is a {type(message_id).__name__}, not a string"
    if not message_id:
        return "empty message id"
    if len(message_id) > inbox.MESSAGE_ID_LENGTH:
        return f"message id longer than {inbox.MESSAGE_ID_LENGTH} characters"
    return None


def _first_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"]) or "body"
    return f"{where}: {error['msg']}"
