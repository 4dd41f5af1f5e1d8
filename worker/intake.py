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
   delivery that ran beside the killer spends one count, for that one death. With
   ``WORKER_COUNT_FIRST_DELIVERIES`` every start is recorded, and a suspect whose start
   the database never saw was only held, not running: it is no suspect;
3. puts it in its lanes. A delivery holds its key (``key=`` on a handler) and its
   delivery group (Kafka: the partition) while it runs; deliveries that share a lane
   run one after another in arrival order. One key's lane holds at most
   ``max(concurrency, WORKER_BATCH_SIZE)`` deliveries: the excess goes back uncounted
   after a delay, so a hot key cannot fill the prefetch and starve the others; one
   that came back that way three times waits in the lane regardless.

A worker that is free takes the next unit of work (:meth:`Intake.next`) the moment one
is ready, never waiting for company: one delivery, or a group of deliveries of one
type that are ready together, which share one transaction (group commit). A group
takes, up to ``WORKER_BATCH_SIZE`` deliveries, what waits behind its first delivery in
its lanes (a key's or a partition's next deliveries, which no other worker could run
yet), and, when no other worker is free, whatever else of its type is ready: so a
lightly loaded pump runs each delivery at once on its own, and a busy one runs the
backlog in groups. A group never holds a delivery whose lane another unit of work
holds. What must run on its own is never grouped: a redelivery
(its start is counted on its own, and it may be a suspect), a side-effect claim, the
same message id twice.

Nothing that goes wrong with one delivery ends intake: an unexpected error is logged
and the delivery settled as a bug (nacked, dead-lettered on its last allowed delivery).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Hashable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from worker import attempts, inbox
from worker.registry import Runs
from worker.verdict import GIVE_BACK_DELAY, HELD_BACK, Outcome, Verb, Verdict, poison, unexpected

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from worker.brokers import Broker
    from worker.delivery import Delivery
    from worker.health import DatabaseHealth
    from worker.registry import Handler, Registry
    from worker.settings import Settings

Lane = tuple[str, Hashable]
"""What a delivery holds while it runs: ("key", its key) or ("group", its group)."""

Messages = dict[type[BaseModel], BaseModel]
"""One delivery's body decoded once per model its handlers take."""

_BOM = b"\xef\xbb\xbf"
_PARKED_REGARDLESS = 3
"""Give-backs for a busy key after which a delivery waits in its key's lane regardless."""
_ALONE_WAIT = 30.0
"""Seconds a suspect waits for the work in flight to settle. Past it, it runs beside what
is still there (hung work, which WORKER_HANDLER_TIMEOUT bounds) rather than halt intake."""
_BUSY_TURN = 0.001
"""Seconds one turn of the event loop takes at most while the process has CPU to spare."""
_SCAN = 256
"""Ready deliveries a worker looks through for company of its group's type."""
_GROUP_TIME = 0.25
"""Seconds a group should take at most, by what its type's deliveries have taken so far
(wall time: on a busy event loop a member's time counts every other task's turns too,
several times its own, which is why the budget is a second): a group is as slow as the
sum of its members, and a slow handler's group would hold the others' acks, a key's or a
partition's lane, and a shutdown's grace period behind it. Fast handlers (most: a few
ms) fill groups to the cap; a type of a second or more runs alone, and so does the first
unit of a type, before anything says how long its deliveries take."""


class Item:
    """One delivery as intake took it: its decoded messages, its key and lanes, its place.

    ``redelivered``: the adapter's word when it was taken (``Delivery.redelivered``).
    ``refused``: why no handler can run it (it has none), for a worker to settle.
    ``single``: it must run on its own (a redelivery, whose start is counted on its own
    and which may be a suspect; a type some handler of which cannot share a transaction,
    a side-effect claim). Written once, here; the pump and the runners only read it.
    """

    __slots__ = (
        "arrival",
        "delivery",
        "handlers",
        "key",
        "lanes",
        "message_id",
        "messages",
        "redelivered",
        "refused",
        "single",
    )

    def __init__(
        self,
        delivery: Delivery,
        message_id: str,
        handlers: tuple[Handler[Any], ...],
        messages: Messages,
        key: Hashable,
        arrival: int,
        redelivered: bool,
        single: bool,
        refused: Verdict | None = None,
    ) -> None:
        self.delivery = delivery
        self.message_id = message_id
        self.handlers = handlers
        self.messages = messages
        self.key = key
        self.arrival = arrival
        self.redelivered = redelivered
        self.single = single
        self.refused = refused
        lanes: tuple[Lane, ...] = () if key is None else (("key", key),)
        group = delivery.group
        if group is not None:
            lanes = (*lanes, ("group", group))
        self.lanes = lanes

    def message(self, handler: Handler[Any]) -> BaseModel:
        return self.messages[handler.model]

    def __repr__(self) -> str:
        return f"<Item {self.delivery!r}>"


class Work:
    """One unit of work: deliveries of one type that run together, and their handlers.

    ``counted``: the consumer whose durable delivery count this work's start moved
    (worker.attempts), so that an uncounted give-back takes it back; set by the pump.
    """

    __slots__ = ("counted", "handlers", "items", "taken")

    def __init__(self, items: list[Item], handlers: tuple[Handler[Any], ...]) -> None:
        self.items = items
        self.handlers = handlers
        self.counted: str | None = None
        self.taken = 0.0  # time.monotonic() when a worker took it

    @property
    def deliveries(self) -> list[Delivery]:
        return [item.delivery for item in self.items]

    def __repr__(self) -> str:
        return f"<Work {len(self.items)} x {self.items[0].delivery.type!r}>"


class Intake:
    """The pump's only broker reader, and the lanes between it and the workers."""

    def __init__(
        self,
        broker: Broker,
        engine: AsyncEngine,
        registry: Registry,
        settings: Settings,
        health: DatabaseHealth,
        settle: Callable[[Delivery, Verdict], Awaitable[None]],
        stats: Counter[str],
        outcomes: Counter[tuple[str, str]],
        log: Any,
    ) -> None:
        self._broker = broker
        self._engine = engine
        self._settings = settings
        self._health = health
        self._settle = settle  # worker.settle's, for what intake itself gives back
        self._stats = stats
        self._outcomes = outcomes
        self._log = log
        self._size = settings.batch_size
        # what one key's lane may hold, running or waiting: at most half the prefetch
        # (pump.prefetch), so a hot key leaves room for every other key
        self._lane_limit = max(settings.concurrency, self._size)
        self._handlers = {t: registry.for_type(t) for t in registry.message_types}
        self._shared = {  # types every handler of which may share a transaction
            t: all(h.runs is Runs.TRANSACTION for h in handlers)
            for t, handlers in self._handlers.items()
        }
        self._cost: dict[str, float] = {}  # seconds per delivery so far, by type (EWMA)
        self._group: dict[str, int] = {}  # how many of a type a group may hold now
        self._lanes: dict[Lane, deque[Item]] = {}  # every unsettled item of a lane, in order
        self._ready: deque[Item] = deque()  # at the head of each of its lanes, not taken
        self._waiters: deque[asyncio.Future[None]] = deque()  # free workers, first come
        self._idle = 0  # free workers: waiting, or woken and not back yet
        self._busy = False  # the event loop's last turn was long: CPU, not workers, is short
        self._running: set[Work] = set()
        self._suspect: Item | None = None  # the suspect running alone
        self._arrivals = 0
        self._changed = asyncio.Event()  # something settled: what the reader may wait for
        self._turned_away: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.in_flight = 0
        """Deliveries in the units of work the workers hold now."""

    # -- the workers' side --------------------------------------------------------------

    async def next(self) -> Work:
        """The next unit of work, as soon as one is ready (cancel-safe: a cancelled wait
        takes nothing). While other work runs, one turn of the event loop first: what the
        broker delivered with this delivery is admitted and may share its group; on an
        idle pump, none (the delivery runs at once)."""
        while True:
            while not self._ready:
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                self._idle += 1
                try:
                    await waiter
                except BaseException:
                    if waiter.done() and not waiter.cancelled() and self._ready:
                        self._wake()  # it was this worker's turn: hand it on
                    waiter.cancel()
                    raise
                finally:
                    self._idle -= 1
            if self.in_flight and len(self._ready) < self._size:
                loop = asyncio.get_running_loop()
                turn = loop.time()
                try:
                    await asyncio.sleep(0)
                except BaseException:
                    if self._ready:
                        self._wake()  # hand it on
                    raise
                self._busy = loop.time() - turn > _BUSY_TURN
                if not self._ready:  # another worker took it meanwhile
                    continue
            return self._take()

    def done(self, work: Work, verdicts: list[Verdict] | None = None) -> None:
        """The work is settled: its lanes go to the deliveries waiting behind it. Behind
        a delivery given back in a delivery group, the group's waiting deliveries are
        given back too, unrun: the adapter rewinds the group to the earlier one (a Kafka
        partition seeks back to it), and they must not apply before it."""
        if work not in self._running:
            return
        self._running.discard(work)
        count = len(work.items)
        self.in_flight -= count
        if work.handlers:  # how long a delivery of its type takes: the size of its groups
            message_type = work.items[0].delivery.type or ""
            spent = (time.monotonic() - work.taken) / count
            cost = self._cost.get(message_type)
            cost = spent if cost is None else 0.8 * cost + 0.2 * spent
            self._cost[message_type] = cost
            self._group[message_type] = max(1, min(self._size, int(_GROUP_TIME / cost)))
        if self._lanes:
            self._free(work, verdicts or [])
        if self._suspect is not None and self._suspect in work.items:
            self._suspect = None
        self._changed.set()

    def _free(self, work: Work, verdicts: list[Verdict]) -> None:
        """The work's lanes, to the deliveries next in them (its items head their lanes,
        in arrival order)."""
        lanes = self._lanes
        touched: list[Lane] = []
        rewound: list[Lane] = []
        for item, verdict in zip(work.items, verdicts, strict=False):
            if verdict.verb is Verb.NACK and item.delivery.group is not None:
                rewound.append(("group", item.delivery.group))
        for item in work.items:
            for lane in item.lanes:
                queue = lanes[lane]
                queue.popleft()
                if queue:
                    touched.append(lane)
                else:
                    del lanes[lane]
        for lane in rewound:
            for follower in lanes.pop(lane, ()):
                self._hold_back(follower, lane, touched)
        heads = {id(lanes[lane][0]): lanes[lane][0] for lane in touched if lane in lanes}
        for head in sorted(heads.values(), key=_arrival):
            if all(lanes[lane][0] is head for lane in head.lanes):
                self._ready.append(head)
                self._wake()

    def _hold_back(self, item: Item, group: Lane, touched: list[Lane]) -> None:
        """Give ``item`` back unrun (its group rewinds), and out of its other lanes."""
        for lane in item.lanes:
            if lane == group:
                continue
            queue = self._lanes[lane]
            headed = queue[0] is item
            queue.remove(item)
            if not queue:
                del self._lanes[lane]
            elif headed:  # the next in this lane may be ready now (not so behind another)
                touched.append(lane)
        self._stats["held-back"] += 1
        self._outcomes["", HELD_BACK.outcome] += 1
        self._background(self._settle(item.delivery, HELD_BACK))

    def unstarted(self) -> list[Item]:
        """At shutdown: every item taken from the broker and never handed to a worker."""
        running = {id(item) for work in self._running for item in work.items}
        left: dict[int, Item] = {id(item): item for item in self._ready}
        for queue in self._lanes.values():
            left.update((id(item), item) for item in queue if id(item) not in running)
        self._ready.clear()
        self._lanes.clear()
        return sorted(left.values(), key=_arrival)

    def running(self) -> list[Work]:
        return list(self._running)

    def held(self) -> dict[str, int]:
        """The sizes of what intake holds per delivery (all zero when nothing is in flight)."""
        return {
            "ready": len(self._ready),
            "lanes": len(self._lanes),
            "running": len(self._running),
            "waiting turned away": len(self._turned_away),
        }

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _take(self) -> Work:
        """The unit of work for a worker now free: the first ready delivery, and what may
        share its transaction."""
        ready = self._ready
        first = ready.popleft()
        group = [first]
        size = self._group.get(first.delivery.type or "", 1)  # 1 until its cost is known
        if size > 1 and not first.single:
            # what waits behind it in its lanes (a key's credits in one session, a
            # partition's records in order); failing that, what else is ready
            if first.lanes:
                self._followers(group, size)
            if ready and len(group) == 1 and (self._busy or not self._idle):
                self._company(group, size)
            if len(group) > 1:
                group.sort(key=_arrival)
        work = Work(group, first.handlers)
        work.taken = time.monotonic()
        self._running.add(work)
        self.in_flight += len(group)
        return work

    def _company(self, group: list[Item], size: int) -> None:
        """Ready deliveries of the first one's type join its group, up to the cap (ready
        deliveries hold no lane in common: each heads its lanes): what is ready together
        shares a transaction. Only for a delivery that has no followers (a lane's run may
        be long, and what joined it would wait for all of it), and only when no other
        worker is free, or when the event loop is what is short (its last turn took over
        1 ms: the process's CPU is spent, and a delivery given to a free worker would wait
        for the loop all the same); otherwise a delivery runs at once beside the others
        rather than wait behind a group's slowest member. On a quiet queue only one is
        ever ready, and it runs alone."""
        handlers = group[0].handlers
        ids = {item.message_id for item in group}
        kept: list[Item] = []
        ready = self._ready
        for _ in range(min(len(ready), _SCAN)):
            item = ready.popleft()
            if (
                len(group) < size
                and item.handlers is handlers
                and item.message_id not in ids
                and not item.single
            ):
                group.append(item)
                ids.add(item.message_id)
            else:
                kept.append(item)
        ready.extendleft(reversed(kept))

    def _followers(self, group: list[Item], size: int) -> None:
        """Deliveries queued behind the group in its lanes join it while they are next in
        every lane they hold (so each lane's deliveries still run in arrival order)."""
        lanes = self._lanes
        handlers = group[0].handlers
        ids = {item.message_id for item in group}
        taken: dict[Lane, int] = {}
        for item in group:
            for lane in item.lanes:
                taken[lane] = taken.get(lane, 0) + 1
        grew = True
        while grew and len(group) < size:
            grew = False
            for lane, count in list(taken.items()):
                queue = lanes[lane]
                if count >= len(queue):
                    continue
                item = queue[count]
                if (
                    item.handlers is not handlers
                    or item.message_id in ids
                    or item.single
                    or not all(
                        taken.get(other, 0) < len(lanes[other])
                        and lanes[other][taken.get(other, 0)] is item
                        for other in item.lanes
                    )
                ):
                    continue
                group.append(item)
                ids.add(item.message_id)
                for other in item.lanes:
                    taken[other] = taken.get(other, 0) + 1
                grew = True
                if len(group) >= size:
                    return

    # -- the reader ---------------------------------------------------------------------

    async def run(self) -> None:
        """Receive until cancelled; the only caller of ``broker.receive``."""
        receive, health, take = self._broker.receive, self._health, self._take_in
        while not self._stopping:
            if not health.gate.is_set():
                await health.wait_available()
            try:
                delivery = await receive()
            except Exception as exc:  # an adapter bug must not silently stop intake
                self._log.error("receive failed", error=exc)
                await asyncio.sleep(1.0)
                continue
            try:
                suspect = take(delivery)
                if suspect is not None:
                    await self._alone(suspect)
            except Exception as exc:  # nothing that goes wrong with one delivery ends intake
                self._log.exception(
                    "intake failed on a delivery",
                    message_id=repr(delivery.message_id),
                    attempt=0,
                    outcome="nacked",
                )
                verdict = unexpected(delivery.delivery_count, self._settings.max_deliveries, exc)
                await self._settle(delivery, verdict)

    def stop(self) -> None:
        self._stopping = True
        self._changed.set()

    async def settled(self) -> None:
        """Wait for the give-backs of turned-away deliveries still under way."""
        await asyncio.gather(*self._turned_away, return_exceptions=True)

    def _take_in(self, delivery: Delivery) -> Item | None:
        """Refuse, queue or admit ``delivery``; a suspect is returned, to run alone."""
        message_type = delivery.type
        handlers = self._handlers.get(message_type, ()) if isinstance(message_type, str) else ()
        self._arrivals += 1
        item = self._prepare(delivery, handlers, self._arrivals)
        if isinstance(item, Verdict):  # a worker settles it, through the middleware
            message_id = delivery.message_id if isinstance(delivery.message_id, str) else ""
            item = Item(delivery, message_id, (), {}, None, self._arrivals, True, True, item)
            self._admit(item)  # in its delivery group's place: a partition keeps its order
            return None
        if delivery.suspect:
            return item
        self._admit(item, fresh=True)
        return None

    def _prepare(
        self, delivery: Delivery, handlers: tuple[Handler[Any], ...], arrival: int
    ) -> Item | Verdict:
        """Decode once per model and compute the key; or the reason no handler can run it."""
        unreadable = _unreadable(delivery)
        if unreadable is not None:
            return poison(unreadable)
        if not handlers:
            return poison(f"no handler for message type {delivery.type!r}")
        body = delivery.body
        if body[:3] == _BOM:  # JSON allows none, but Windows tools write one
            body = body[3:]
        messages: Messages = {}
        key: Hashable = None
        for handler in handlers:
            model = handler.model
            if model not in messages:
                try:
                    messages[model] = model.model_validate_json(body)
                except ValidationError as exc:
                    return poison(f"invalid body for {delivery.type}: {_first_error(exc)}")
                except Exception as exc:  # a validator's own error: the body, every time
                    return poison(f"invalid body for {delivery.type}: {type(exc).__name__}: {exc}")
            if key is None and handler.key is not None:
                try:
                    key = handler.key(messages[model])
                    hash(key)
                except Exception as exc:
                    reason = f"{handler.consumer}: key function failed: {type(exc).__name__}: {exc}"
                    return poison(reason)
        message_id = delivery.message_id
        assert isinstance(message_id, str)  # _unreadable refused every other id
        redelivered = delivery.redelivered
        single = redelivered or not self._shared[delivery.type or ""]
        return Item(delivery, message_id, handlers, messages, key, arrival, redelivered, single)

    def _background(self, settling: Any) -> None:
        task = asyncio.create_task(settling)
        self._turned_away.add(task)
        task.add_done_callback(self._turned_away.discard)

    # -- lanes --------------------------------------------------------------------------

    def _admit(self, item: Item, *, fresh: bool = False) -> None:
        """Hand ``item`` out, or queue it behind the deliveries holding its lanes."""
        lanes = self._lanes
        if not item.lanes:
            self._ready.append(item)
            self._wake()
            return
        if fresh and item.key is not None:
            queue = lanes.get(("key", item.key))
            if (
                queue is not None
                and len(queue) >= self._lane_limit
                and item.delivery.give_backs < _PARKED_REGARDLESS
            ):
                self._turn_away(item)
                return
        free = True
        for lane in item.lanes:
            queue = lanes.get(lane)
            if queue is None:
                lanes[lane] = deque((item,))
            else:
                queue.append(item)
                free = False
        if free:
            self._ready.append(item)
            self._wake()
        elif fresh:
            self._stats["parked"] += 1

    def _turn_away(self, item: Item) -> None:
        """A key with a full lane: the delivery goes back uncounted, after a delay."""
        self._stats["key-busy"] += 1
        verdict = Verdict(
            Verb.NACK,
            Outcome.KEY_BUSY,
            f"key busy: {self._lane_limit} deliveries already wait for it",
            GIVE_BACK_DELAY,
            counted=False,
        )
        self._outcomes["", verdict.outcome] += 1
        self._background(self._settle(item.delivery, verdict))

    # -- suspects -----------------------------------------------------------------------

    async def _alone(self, item: Item) -> None:
        """Run a suspect with nothing else in flight, and take nothing until it is done;
        unless it needs no such care (:meth:`_runs_alone`)."""
        if not await self._runs_alone(item):
            self._admit(item, fresh=True)
            return
        self._stats["suspects"] += 1
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_ALONE_WAIT):
                while (self._running or self._ready) and not self._stopping:
                    self._changed.clear()
                    await self._changed.wait()
        self._log.info(
            "running a suspect alone",
            message_id=item.message_id,
            delivery_count=item.delivery.delivery_count,
        )
        self._suspect = item
        self._admit(item)
        while self._suspect is item and not self._stopping:
            self._changed.clear()
            await self._changed.wait()

    async def _runs_alone(self, item: Item) -> bool:
        """Whether a suspect runs alone: always, unless the database can tell it was only
        held (every start is recorded, and this one's never was), or its first copy still
        runs here (it came back on a lost lock, not after a death). Running every delivery
        a dead process held one at a time costs a short queue of one (the prefetch); a
        suspect running beside others would charge them its next death too."""
        if any(i.message_id == item.message_id for w in self._running for i in w.items):
            return False
        settings = self._settings
        if settings.delivery_counts == "database" and settings.count_first_deliveries:
            consumer = item.handlers[0].consumer
            return await attempts.started(self._engine, item.delivery, consumer)
        return True


def _arrival(item: Item) -> int:
    return item.arrival


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
