"""What the broker and the handlers saw: the journal the invariants are checked against.

:class:`RecordingConsumer` is a :class:`~worker.brokers.memory.MemoryConsumer` that writes
down every delivery it hands to its pump (an *arrival*, in receive order) and every
settlement the pump makes of it, puts a ``group`` header into ``Delivery.group`` (as the
Kafka adapter groups a partition's records), and honours give-back delays at
:data:`DELAY_SCALE` (so a schedule's give-backs fit in seconds; their order is kept).
The handlers (tests/explorer/workload.py) write down each call: which arrival it served
(the oldest unsettled arrival of that id at that pump), and the message's own failures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.brokers.memory import MemoryBroker, MemoryConsumer
from worker.delivery import Delivery
from worker.errors import SettlementLost

DELAY_SCALE = 0.05
"""Give-back delays (seconds to minutes in production) shrink to this fraction."""


@dataclass(slots=True, eq=False)
class Arrival:
    """One delivery handed to one pump, and what became of it."""

    seq: int
    pump: str
    message_id: str | None
    group: Any
    handle: Any
    settled: list[str] = field(default_factory=list)
    lost: int = 0  # settlements attempted after the broker had taken it back
    returned: bool = False  # taken back by a crash
    invoked: bool = False


@dataclass(frozen=True, slots=True)
class Start:
    """The first handler call serving an arrival: the order invariant reads these."""

    pump: str
    seq: int
    message_id: str
    key: str | None
    group: Any
    again: bool  # this message ran at this pump before (a failed copy's twin, a redelivery)


class Journal:
    """Everything one run recorded, in the order it happened."""

    def __init__(self) -> None:
        self.arrivals: list[Arrival] = []
        self._by_handle: dict[int, Arrival] = {}
        self._unsettled: dict[tuple[str, str | None], list[Arrival]] = {}
        self.starts: list[Start] = []
        self._ran: set[tuple[str, str]] = set()  # (pump, message id) that had a start
        self.invocations: Counter[str] = Counter()  # message id -> primary handler calls
        self.own_failures: Counter[str] = Counter()
        self.uncounted: Counter[str] = Counter()  # message id -> uncounted give-backs
        self.counted: Counter[str] = Counter()  # message id -> counted give-backs (nacks)
        self.settlements = 0
        self.deaths = 0
        self.on_settled: Callable[[int], None] = lambda _settlements: None

    # -- the broker's side ---------------------------------------------------------------

    def arrived(self, pump: str, handle: Any, delivery: Delivery) -> None:
        arrival = Arrival(len(self.arrivals), pump, delivery.message_id, delivery.group, handle)
        self.arrivals.append(arrival)
        self._by_handle[id(handle)] = arrival
        self._unsettled.setdefault((pump, delivery.message_id), []).append(arrival)

    def settled(self, handle: Any, verb: str, counted: bool = True) -> None:
        arrival = self._by_handle[id(handle)]
        arrival.settled.append(verb)
        self._forget(arrival)
        if verb == "nack" and arrival.message_id is not None:
            (self.counted if counted else self.uncounted)[arrival.message_id] += 1
        self.settlements += 1
        self.on_settled(self.settlements)

    def lost(self, handle: Any) -> None:
        self._by_handle[id(handle)].lost += 1

    def returned(self, handles: Sequence[Any]) -> None:
        for handle in handles:
            arrival = self._by_handle[id(handle)]
            arrival.returned = True
            self._forget(arrival)

    def _forget(self, arrival: Arrival) -> None:
        waiting = self._unsettled.get((arrival.pump, arrival.message_id), [])
        if arrival in waiting:
            waiting.remove(arrival)

    # -- the handlers' side --------------------------------------------------------------

    def invoked(self, pump: str, message_id: str, key: str | None) -> None:
        """A handler call for ``message_id`` at ``pump``: the first one serving an arrival
        is that arrival's start (the oldest arrival of the id still unsettled there)."""
        waiting = self._unsettled.get((pump, message_id))
        if not waiting:
            return
        arrival = waiting[0]
        if not arrival.invoked:
            arrival.invoked = True
            again = (pump, message_id) in self._ran
            self._ran.add((pump, message_id))
            self.starts.append(Start(pump, arrival.seq, message_id, key, arrival.group, again))


class RecordingConsumer(MemoryConsumer):
    """A memory broker connection that journals what it hands out and what is settled."""

    def __init__(self, broker: MemoryBroker, pump: str, journal: Journal) -> None:
        super().__init__(broker)
        self.pump = pump
        self.journal = journal
        self.dead = False

    def accept(self, flight: Any) -> None:
        delivery: Delivery = flight.delivery
        delivery.group = delivery.headers.get("group")
        self.journal.arrived(self.pump, flight, delivery)
        super().accept(flight)

    def die(self) -> None:
        """The process is gone: the broker takes back everything it held unsettled."""
        self.dead = True
        self.journal.returned(list(self.unsettled))
        self.crash()

    async def ack(self, handle: Any) -> None:
        try:
            await super().ack(handle)
        except SettlementLost:
            self.journal.lost(handle)
            raise
        self.journal.settled(handle, "ack")

    async def nack(self, handle: Any, delay: float | None, counted: bool = True) -> None:
        scaled = None if delay is None else delay * DELAY_SCALE
        try:
            await super().nack(handle, scaled, counted)
        except SettlementLost:
            self.journal.lost(handle)
            raise
        self.journal.settled(handle, "nack", counted)

    async def dead_letter(self, handle: Any, reason: str) -> None:
        try:
            await super().dead_letter(handle, reason)
        except SettlementLost:
            self.journal.lost(handle)
            raise
        self.journal.settled(handle, "dead-letter")
