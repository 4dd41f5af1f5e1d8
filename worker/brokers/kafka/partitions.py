"""The partitions a member owns: how each is kept, and how they come and go.

A :class:`Partition` holds what was fetched and not handed out yet (bounded in records and
bytes), which records are out, and the commit point: the end of the contiguous settled
prefix, one record at a time, a group, or a window of keys. A :class:`Handle` is the
adapter's own object behind one delivery; the pump hands it back to settle the record.
Both are plain data: no client, no I/O.

:class:`Rebalances` is how partitions come to the member and leave it: aiokafka's
rebalance callbacks, the offset store's claim of a new assignment (the partition stays
paused until it is in), a revocation that lets in-flight records settle (bounded) and
commits what did, and a fence raised by another member's claim.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from aiokafka import ConsumerRebalanceListener  # type: ignore[import-untyped]

from worker.brokers.kafka import membership

if TYPE_CHECKING:
    from worker.brokers.kafka.offsets import Slot
    from worker.brokers.kafka.settings import KafkaSettings


class Partition:
    """What this member knows about one partition it owns, for one assignment."""

    __slots__ = (
        "batch",
        "busy",
        "bytes",
        "claimed",
        "committed",
        "done",
        "generation",
        "handed",
        "idle",
        "inflight",
        "keyed",
        "keys",
        "not_before",
        "owned",
        "records",
        "refetch",
        "reserved",
        "reserving",
        "rewind",
        "rewind_to",
        "settled",
        "slot",
        "span",
        "stored",
        "suspect_through",
        "tp",
        "window",
        "windowed",
    )

    def __init__(
        self, tp: Any, generation: int, keyed: bool = False, span: int = 500, batch: int = 1
    ) -> None:
        self.tp = tp
        self.generation = generation  # of the group, when this member got the partition
        self.records: deque[Any] = deque()  # fetched, not handed out (again) yet
        self.bytes = 0  # the size of what ``records`` holds
        self.owned = True
        self.inflight = 0  # records handed out and not settled yet
        self.busy = False  # inflight > 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.rewind: asyncio.TimerHandle | None = None  # nacked: waiting to seek back
        self.settled: int | None = None  # the next offset to commit
        self.committed: int | None = None  # what this member last committed
        # WORKER_KAFKA_ORDERING=key: one record per key in flight, several per partition.
        self.keyed = keyed
        self.window: deque[int] = deque()  # offsets fetched and not committable yet, in order
        self.done: set[int] = set()  # settled offsets inside the window
        self.keys: dict[bytes | None, int] = {}  # key -> the offset that holds it
        self.not_before: dict[int, float] = {}  # nacked offset -> when it may go again
        self.span = span  # records handed out lie within this many of the commit point
        # Partition order with batches: up to ``batch`` contiguous records out at once.
        self.batch = 1 if keyed else max(1, batch)
        self.windowed = keyed or self.batch > 1  # several out: track the settled prefix
        self.rewind_to: int | None = None  # the offset the pending rewind seeks to
        # Database offsets and counts (worker.brokers.kafka.offsets): the partition's row
        # as this member claimed it; nothing is handed out before the claim.
        self.claimed = True
        self.refetch: int | None = None  # fetched before the claim, dropped: read it again
        self.slot: Slot | None = None
        self.stored: int | None = None  # the offset this member last stored
        self.suspect_through = -1  # offsets up to here may have been started before
        self.reserved = -1  # offsets up to here are recorded as possibly started
        self.reserving = False
        self.handed = -1  # the highest offset handed out

    @property
    def size(self) -> int:
        """Records counted against ``max_buffered``: key mode counts the whole window."""
        return len(self.window) if self.keyed else len(self.records)

    @property
    def label(self) -> str:
        return f"{self.tp.topic}/{self.tp.partition}"

    def push(self, records: Iterable[Any]) -> None:
        for record in records:
            self.records.append(record)
            self.bytes += _size(record)
            if self.windowed:
                self.window.append(record.offset)

    def pop(self) -> Any:
        record = self.records.popleft()
        self.bytes -= _size(record)
        return record

    def drop(self) -> None:
        self.records.clear()
        self.bytes = 0
        self.window.clear()
        self.done.clear()
        self.keys.clear()
        self.not_before.clear()

    def disown(self) -> None:
        """From here on, settlements of its records raise SettlementLost."""
        self.owned = False
        self.drop()
        if self.rewind is not None:
            self.rewind.cancel()
            self.rewind = None
            self.rewind_to = None

    # -- key mode --

    def next_index(self, now: float) -> int | None:
        """The first buffered record whose key is free (or its own) and not backing off.

        Scanning in offset order keeps each key's records in order: a later record
        of a key never passes an earlier one, which holds the key or comes first.
        Only the first ``span`` records of the window are candidates: behind a slow
        key, what runs ahead of the commit point (and would run again after a
        crash) stays bounded, whatever one fetch brought.
        """
        last = self.window[self.span - 1] if len(self.window) > self.span else None
        for index, record in enumerate(self.records):
            if last is not None and record.offset > last:
                return None
            holder = self.keys.get(record.key)
            if holder is not None and holder != record.offset:
                continue
            if self.not_before.get(record.offset, 0.0) > now:
                continue
            return index
        return None

    def take(self, index: int) -> Any:
        record = self.records[index]
        del self.records[index]
        self.bytes -= _size(record)
        self.keys[record.key] = record.offset
        self.not_before.pop(record.offset, None)
        return record

    def put_back(self, record: Any, due: float) -> None:
        """A nacked record waits in the buffer, in offset order, still holding its key."""
        index = next((i for i, r in enumerate(self.records) if r.offset > record.offset), None)
        self.records.insert(len(self.records) if index is None else index, record)
        self.bytes += _size(record)
        self.not_before[record.offset] = due

    def prefix_with(self, offsets: Iterable[int]) -> int | None:
        """The commit point if ``offsets`` (one transaction's records) settled too.

        None: that transaction's records do not extend the settled prefix.
        """
        mine = set(offsets)
        if not self.windowed:  # one record out at a time: it is the prefix's next one
            return max(mine) + 1
        end = None
        for offset in self.window:
            if offset not in self.done and offset not in mine:
                break
            end = offset + 1
        return end

    def settle(self, record: Any) -> None:
        """Release the record's key; the commit point moves over the settled prefix."""
        if self.keys.get(record.key) == record.offset:
            del self.keys[record.key]
        self.done.add(record.offset)
        while self.window and self.window[0] in self.done:
            first = self.window.popleft()
            self.done.discard(first)
            self.settled = first + 1


def _size(record: Any) -> int:
    """Bytes a buffered record holds: key, value and headers."""
    size = len(record.key or b"") + len(record.value or b"")
    return size + sum(len(k) + len(v or b"") for k, v in record.headers or ())


class Handle:
    """One record handed out: the adapter's own object behind a delivery, settled through it."""

    __slots__ = ("attempt", "message_id", "partition", "record")

    def __init__(
        self, partition: Partition, record: Any, attempt: int, message_id: str | None
    ) -> None:
        self.partition = partition
        self.record = record
        self.attempt = attempt
        self.message_id = message_id


class Tally:
    """Per record this process read: its deliveries so far and its uncounted give-backs.

    Kafka keeps neither, so both live here, in memory, keyed by (partition, offset). They
    survive a rebalance that gives a partition back to this process (not a restart, not
    a move to another member), and a record's entry goes when it settles.
    """

    __slots__ = ("_records",)

    def __init__(self) -> None:
        self._records: dict[Any, dict[int, list[int]]] = {}  # tp -> offset -> [spent, give-backs]

    def _entry(self, tp: Any, offset: int) -> list[int]:
        return self._records.get(tp, {}).get(offset, [0, 0])

    def attempts(self, tp: Any, offset: int) -> int:
        """Deliveries spent so far (the next one is this + 1)."""
        return self._entry(tp, offset)[0]

    def give_backs(self, tp: Any, offset: int) -> int:
        return self._entry(tp, offset)[1]

    def nacked(self, tp: Any, offset: int, attempt: int, counted: bool) -> None:
        """Delivery ``attempt`` was given back; one the record is not to blame for keeps
        its number (the next delivery is ``attempt`` again) and counts as a give-back."""
        entry = self._records.setdefault(tp, {}).setdefault(offset, [0, 0])
        entry[0] = attempt if counted else attempt - 1
        if not counted:
            entry[1] += 1

    def settled(self, tp: Any, offset: int) -> None:
        records = self._records.get(tp)
        if records:
            records.pop(offset, None)

    def forget_before(self, tp: Any, offset: int) -> None:
        """Entries below where a fresh assignment starts belong to records settled elsewhere."""
        records = self._records.get(tp)
        if records:
            for old in [o for o in records if o < offset]:
                del records[old]


class Offsets(Protocol):
    """What the rebalances ask of the offset store (:mod:`worker.brokers.kafka.store`)."""

    @property
    def claims(self) -> bool:
        """True: a new assignment stays paused until :meth:`claim` is done."""
        ...

    async def claim(self, partition: Partition) -> int | None: ...

    async def commit(self, partitions: Sequence[Partition]) -> bool: ...

    async def hand_over(self, partitions: Sequence[Partition]) -> None: ...


class Member(Protocol):
    """What the rebalances ask of the consumer whose partitions come and go."""

    @property
    def kafka(self) -> KafkaSettings: ...

    @property
    def stats(self) -> Counter[str]: ...

    @property
    def offsets(self) -> Offsets: ...

    @property
    def client(self) -> Any:
        """The AIOKafkaConsumer (None before the member starts)."""
        ...

    @property
    def stopping(self) -> bool: ...

    def chore(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` as a task the member cancels when it closes."""
        ...

    def flow_control(self) -> None:
        """Pause and resume partitions by what they hold."""
        ...


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, rebalances: Rebalances) -> None:
        self._rebalances = rebalances

    async def on_partitions_revoked(self, revoked: Iterable[Any]) -> None:
        await self._rebalances.revoke(revoked)

    async def on_partitions_assigned(self, assigned: Iterable[Any]) -> None:
        self._rebalances.assign(assigned)


class Rebalances:
    """Assignments, revocations, claims and fences of one member's partitions.

    ``owned`` is the member's own map of its partitions (tp -> :class:`Partition`): an
    assignment adds to it and a revocation takes out of it, here and nowhere else.
    """

    def __init__(self, member: Member, owned: dict[Any, Partition], batch: int, log: Any) -> None:
        self._member = member
        self._owned = owned
        self._batch = batch
        self._log = log

    def listener(self) -> ConsumerRebalanceListener:
        """What ``subscribe`` is given: aiokafka calls it around every rebalance."""
        return _Listener(self)

    def assign(self, assigned: Iterable[Any]) -> None:
        member = self._member
        generation = membership.generation(member.client)
        for tp in assigned:
            previous = self._owned.get(tp)
            if previous is not None:  # not revoked first: its handles must not commit
                previous.disown()
            keyed = member.kafka.ordering == "key"
            partition = self._owned[tp] = Partition(
                tp, generation, keyed, span=member.kafka.max_buffered, batch=self._batch
            )
            if member.offsets.claims:  # claim the row first; nothing is read before
                partition.claimed = False
                member.client.pause(tp)
                member.chore(self._claim(partition), f"kafka-claim-{partition.label}")
            member.stats["partitions_assigned"] += 1
        member.stats["rebalances"] += 1
        labels = sorted(p.label for p in self._owned.values())
        self._log.info("partitions assigned", partitions=labels)

    async def revoke(self, revoked: Iterable[Any], hung: Iterable[Any] = ()) -> None:
        """Stop handing out, let in-flight records settle (bounded), commit, drop the rest.

        ``hung``: partitions whose in-flight record is overdue, not worth waiting for.
        """
        member = self._member
        partitions = [self._owned.pop(tp) for tp in revoked if tp in self._owned]
        if not partitions:
            return
        for partition in partitions:
            partition.drop()
            if partition.rewind is not None:
                partition.rewind.cancel()
                partition.rewind = None
                partition.rewind_to = None
        skip = set(hung)
        busy = [p for p in partitions if p.busy and p.tp not in skip]
        if busy:
            waits = [asyncio.create_task(p.idle.wait()) for p in busy]
            _, late = await asyncio.wait(waits, timeout=member.kafka.rebalance_grace)
            for task in late:
                task.cancel()
        dropped = sum(p.busy for p in partitions)
        for partition in partitions:
            partition.disown()
        await member.offsets.commit(partitions)
        await member.offsets.hand_over(partitions)
        member.stats["partitions_revoked"] += len(partitions)
        if dropped:
            member.stats["in_flight_dropped"] += dropped
        self._log.info(
            "partitions revoked",
            partitions=sorted(p.label for p in partitions),
            in_flight_dropped=dropped,
        )

    async def _claim(self, partition: Partition) -> None:
        """Claim the partition in the store, seek where it says, then let records flow.

        Until the claim is in, the partition stays paused: a record handed out before
        it could be fenced out by the previous owner's last commit, or start from a
        broker offset older than the stored one.
        """
        member = self._member
        failures = 0
        while partition.owned and not member.stopping:
            try:
                target = await member.offsets.claim(partition)
                break
            except Exception as exc:  # the database is away: the partition waits for it
                failures += 1
                member.stats["offset_claim_failures"] += 1
                self._log.warning(
                    "offset claim failed", partition=partition.label, error=exc, failures=failures
                )
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))
        else:
            return
        if not partition.owned:
            return
        target = target if target is not None else partition.refetch
        if target is not None:
            member.client.seek(partition.tp, target)
        partition.refetch = None
        partition.claimed = True
        member.flow_control()

    def fenced(self, partition: Partition, where: str) -> None:
        """Another member claimed the row: stop here, and rejoin if Kafka says it is ours."""
        if not partition.owned:
            return
        self._member.stats["fenced"] += 1
        self._log.warning(
            "partition fenced: another member claimed it",
            partition=partition.label,
            epoch=partition.slot.epoch if partition.slot else None,
            where=where,
        )
        partition.disown()
        partition.claimed = False  # stays paused until a new assignment claims it again
        membership.request_rejoin(self._member.client)  # a rebalance settles who owns it
