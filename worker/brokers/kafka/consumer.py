"""The consumer: :class:`KafkaConsumer`, a group member that commits offsets instead of acking.

It is what the pump receives deliveries from and settles them through, and holds
everything that happens while records flow: fetching, handing out, commits,
rebalances, the watchdog. Kafka has no per-message settlement, so the verbs map onto offsets:

- ``ack``: the record is settled. Records of one partition are handed out one
  at a time, so the settled records always form a contiguous prefix and the
  partition's commit point becomes ``offset + 1``. Commits go out every
  ``commit_interval`` seconds, when partitions are revoked, and on close.
  With ``ordering="key"`` one record per key is out at a time, and the commit
  point is the end of the contiguous settled prefix of the window.
- ``nack``: nothing is committed past the record. The partition is paused, its
  buffered records are dropped, and after a backoff the consumer seeks back to
  the record, which comes again with ``delivery_count + 1`` (the same count when
  the nack is uncounted). With ``ordering="key"`` the record waits in the buffer
  instead, holding its key; other keys go on.
- ``dead_letter``: the record is produced to ``<topic><dead_letter_suffix>``
  with headers naming its origin and the reason; only when the broker has
  acknowledged that send is the record settled. A failed send is a nack, except
  that a send refused for good is repeated once as a reduced dead letter.

Kafka keeps no delivery count: the adapter counts attempts per record in
memory, so a restart (or a record landing on another member) starts again at 1.
With ``WORKER_DELIVERY_COUNTS=database`` it records ahead which offsets it may
start (``consumer_offsets.started_through``), and a later owner hands those out
as possible redeliveries, which the pump counts in the database.
A settlement of a record whose partition was revoked raises
:class:`~worker.errors.SettlementLost`: the new owner gets the record again and
the inbox absorbs whatever this process already committed to the database.

``WORKER_KAFKA_OFFSETS=database`` (:mod:`worker.brokers.kafka.offsets`): a newly
assigned partition is claimed (its row's epoch + 1) and sought to the stored
offset before any record is handed out; each delivery's ``in_transaction``
writes the offset past it in the handler's own commit, guarded by the epoch, so
a member that lost the partition cannot commit. Broker commits go on, advisory.
Deliveries carry ``group = (topic, partition)``: a batch (``WORKER_BATCH_SIZE``,
that many contiguous records of a partition out at once) stays in one partition.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from aiokafka import (  # type: ignore[import-untyped]
    AIOKafkaConsumer,
    AIOKafkaProducer,
    ConsumerRebalanceListener,
)
from aiokafka.errors import (  # type: ignore[import-untyped]
    ClusterAuthorizationFailedError,
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    PolicyViolationError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    UnsupportedForMessageFormatError,
)
from sqlalchemy import event

from worker.brokers import load_identity
from worker.brokers.kafka import offsets as kafka_offsets
from worker.brokers.kafka.offsets import Fenced
from worker.brokers.kafka.partitions import Handle, Partition
from worker.brokers.kafka.records import (
    DLT_DELIVERY_COUNT,
    DLT_DROPPED,
    DLT_MESSAGE_ID,
    DLT_OFFSET,
    DLT_ORIGINAL_SIZE,
    DLT_PARTITION,
    DLT_PREFIX,
    DLT_REASON,
    DLT_TOPIC,
    header_message_id,
    record_headers,
)
from worker.brokers.kafka.settings import FETCH_WAIT_MS, start_error
from worker.delivery import Delivery
from worker.errors import BrokerUnavailable, SettlementLost
from worker.logs import get_logger

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
    from sqlalchemy.orm import Session

    from worker.brokers.kafka.settings import KafkaSettings
    from worker.settings import Settings

_MAX_REASON = 2000
_REDUCED_KEY_MAX = 1024  # a reduced dead letter keeps the original key up to this size
# WORKER_DELIVERY_COUNTS=database: offsets recorded as "may be started" a block ahead of
# what is handed out (one write per block); after a crash, the next owner counts the
# deliveries of at most this many records (plus the buffer) in the database.
_RESERVE_AHEAD = 200
_PENDING = "worker.kafka.offsets"  # session.info: partition -> _Pending
_LISTENING = "worker.kafka.offsets.listening"  # session.info: the before-commit step is set

# Produce errors that come back the same on every retry of the same record: the
# record (too large, malformed) or the permissions are at fault, not the network.
# A dead letter refused with one of these is sent reduced instead of rewound.
_UNSENDABLE: tuple[type[Exception], ...] = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    RecordListTooLargeError,
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
    UnsupportedForMessageFormatError,
    PolicyViolationError,
    InvalidTopicError,
    TopicAuthorizationFailedError,
    ClusterAuthorizationFailedError,
)


class _Pending:
    """One partition's records in one transaction, and the offset already written for them."""

    __slots__ = ("offsets", "written")

    def __init__(self, offsets: set[int]) -> None:
        self.offsets = offsets
        self.written: int | None = None


class _Store:
    """``Delivery.in_transaction`` of a record when offsets live in the database."""

    __slots__ = ("broker", "handle")

    def __init__(self, broker: KafkaConsumer, handle: Handle) -> None:
        self.broker = broker
        self.handle = handle

    async def __call__(self, session: AsyncSession) -> None:
        await self.broker._store_in(self.handle, session)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, broker: KafkaConsumer) -> None:
        self._broker = broker

    async def on_partitions_revoked(self, revoked: Iterable[Any]) -> None:
        await self._broker._revoke(revoked)

    async def on_partitions_assigned(self, assigned: Iterable[Any]) -> None:
        self._broker._assign(assigned)


class KafkaConsumer:
    """One consumer-group member: the pump's :class:`~worker.brokers.Broker` and Settler."""

    name = "kafka"

    def __init__(self, settings: Settings, kafka: KafkaSettings) -> None:
        self.settings = settings
        self.kafka = kafka
        self.destination = ",".join(kafka.topic_list)  # span names: process <topics>
        # The adapter's own events (rebalances, seeks back, commits and their failures,
        # fences, fetch errors...): worker_broker_events_total{broker="kafka", event}.
        self.stats: Counter[str] = Counter()
        self._identity = load_identity(
            settings.message_id_func, header_message_id(kafka.message_id_header)
        )
        self._log = get_logger(broker="kafka", group=kafka.group_id)
        self._consumer: Any = None
        self._producer: Any = None
        self._partitions: dict[Any, Partition] = {}
        self._ready: deque[Partition] = deque()
        self._wakeup = asyncio.Event()
        self._attempts: dict[Any, dict[int, int]] = {}  # tp -> offset -> deliveries so far
        self._commit_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._fetch_ok = False
        self._started = False
        self._stopping = False
        # The watchdog: every record handed out and not settled yet, with the time
        # it becomes overdue. An overdue record takes this member out of the group.
        self._out: dict[Handle, float] = {}
        # A delivery may legitimately take one handler attempt, plus the pump's
        # in-process retries of conflicts; past that and the margin, it is hung.
        limit = getattr(settings, "handler_timeout", 300.0)  # WORKER_HANDLER_TIMEOUT
        retries = float(getattr(settings, "retry_budget", 0.0))  # WORKER_RETRY_BUDGET
        self._overdue_after = (
            None if limit is None else float(limit) + retries + kafka.watchdog_margin
        )
        self._left = False  # out of the group because a record is overdue
        # Offsets and delivery counts in the database (worker.brokers.kafka.offsets).
        self._database = kafka.offsets == "database"
        self._counting = getattr(settings, "delivery_counts", "broker") == "database"
        self._batch = max(1, int(getattr(settings, "batch_size", 1) or 1))  # WORKER_BATCH_SIZE
        self._engine: AsyncEngine | None = None
        here = f"{socket.gethostname()}/{os.getpid()}"
        self._owner = f"{kafka.client_id}@{here}/{uuid.uuid4().hex[:6]}"  # the row says who
        self._chores: set[asyncio.Task[None]] = set()  # claims and reservations under way

    # -- lifecycle --------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Started, not stopping, fetching, and the group coordinator known.

        An idle member (no partition: a replica beyond the partition count, a surge pod
        during a rollout) is healthy and ready: requiring partitions would hang rollouts
        and node drains at maximum scale. False while the watchdog keeps the member out
        of the group.
        """
        if not self._started or self._stopping or self._left:
            return False
        if not self._fetch_ok:
            return False
        # aiokafka has no public "connected" flag; the group coordinator is the
        # best one: a heartbeat that cannot reach it marks it unknown at once.
        coordinator = getattr(self._consumer, "_coordinator", None)
        return getattr(coordinator, "coordinator_id", None) is not None

    @property
    def assignment(self) -> list[Any]:
        return list(self._partitions)

    async def start(self, prefetch: int) -> None:
        """Join the group. ``prefetch`` is moot: one record per partition (or key) is in flight."""
        kafka = self.kafka
        options = kafka.client_options()
        if (self._database or self._counting) and self._engine is None:
            # before the consumer starts: its first assignment claims rows
            from worker.db import create_engine

            self._engine = create_engine(self.settings.database_url, pool_size=2, max_overflow=2)
        self._consumer = AIOKafkaConsumer(
            group_id=kafka.group_id,
            enable_auto_commit=False,
            auto_offset_reset=kafka.auto_offset_reset,
            session_timeout_ms=kafka.session_timeout_ms,
            heartbeat_interval_ms=kafka.heartbeat_interval_ms,
            max_poll_interval_ms=kafka.max_poll_interval_ms,
            max_partition_fetch_bytes=kafka.max_partition_fetch_bytes,
            fetch_max_bytes=kafka.fetch_max_bytes,
            **options,
        )
        self._consumer.subscribe(kafka.topic_list, listener=_Listener(self))
        self._producer = AIOKafkaProducer(
            acks="all",
            enable_idempotence=kafka.idempotent_producer,
            max_request_size=kafka.max_request_size,
            **options,
        )
        try:
            await self._producer.start()
        except KafkaError as exc:
            await self._stop_clients()
            raise start_error(kafka, exc) from None
        try:
            await self._consumer.start()
        except KafkaError as exc:
            await self._stop_clients()
            raise BrokerUnavailable(f"kafka at {kafka.bootstrap_servers}: {exc}") from None
        self._started = True
        self._tasks = [
            asyncio.create_task(self._fetch(), name="kafka-fetch"),
            asyncio.create_task(self._commit_periodically(), name="kafka-commit"),
        ]
        if self._overdue_after is not None:
            self._tasks.append(asyncio.create_task(self._watch(), name="kafka-watchdog"))
        self._log.info("kafka consumer started", topics=kafka.topic_list)

    async def receive(self) -> Delivery:
        while True:
            while self._ready and not self._stopping:
                partition = self._ready.popleft()
                if self._offerable(partition):
                    return self._hand_out(partition)
            self._wakeup.clear()
            await self._wakeup.wait()  # the only await: a cancel here takes nothing

    async def stop_receiving(self) -> None:
        self._stopping = True
        self._ready.clear()
        await self._cancel_tasks("kafka-fetch")

    async def close(self) -> None:
        """Commit what is settled, then leave the group; anything unsettled is redelivered."""
        self._stopping = True
        await self._cancel_tasks()
        partitions = list(self._partitions.values())
        self._partitions.clear()
        for partition in partitions:
            self._disown(partition)
        for chore in list(self._chores):
            chore.cancel()
        await asyncio.gather(*self._chores, return_exceptions=True)
        if self._consumer is not None and partitions:
            await self._commit(partitions)
            await self._hand_over(partitions)
        await self._stop_clients()
        self._log.info("kafka consumer closed")

    async def _cancel_tasks(self, name: str | None = None) -> None:
        chosen = [t for t in self._tasks if name is None or t.get_name() == name]
        for task in chosen:
            task.cancel()
        await asyncio.gather(*chosen, return_exceptions=True)
        self._tasks = [t for t in self._tasks if t not in chosen]

    async def _stop_clients(self) -> None:
        for client in (self._consumer, self._producer):
            if client is None:
                continue
            try:
                async with asyncio.timeout(self.kafka.commit_timeout):
                    await client.stop()
            except (KafkaError, TimeoutError) as exc:
                self.stats["unclean_stops"] += 1
                self._log.warning("kafka client did not stop cleanly", error=exc)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # With the broker away, aiokafka's fetcher lets the cancellation of
                # its own retry task escape stop(); it is not ours to propagate.
                self.stats["unclean_stops"] += 1
                self._log.warning("kafka client did not stop cleanly", error="cancelled inside")
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None

    # -- the flow of records ----------------------------------------------------

    async def _fetch(self) -> None:
        """Buffer fetched records per partition; pause partitions that are full or rewinding."""
        consumer = self._consumer
        failures = 0
        while True:
            if self._left:  # unsubscribed: nothing to fetch until the watchdog rejoins
                await asyncio.sleep(FETCH_WAIT_MS / 1000)
                continue
            self._flow_control()
            try:
                batches = await consumer.getmany(timeout_ms=FETCH_WAIT_MS)
            except Exception as exc:  # aiokafka retries inside; whatever escapes, back off
                self._fetch_ok = False
                failures += 1
                self.stats["fetch_errors"] += 1
                self._log.warning("kafka fetch failed", error=exc, failures=failures)
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))
                continue
            self._fetch_ok, failures = True, 0
            for tp, records in batches.items():
                partition = self._partitions.get(tp)
                if partition is None or partition.rewind is not None or not records:
                    continue  # revoked, or about to seek back: fetched again later
                if not partition.claimed:  # paused at assignment; a fetch under way came anyway
                    first = records[0].offset
                    partition.refetch = first if partition.refetch is None else partition.refetch
                    continue
                if not partition.records and partition.settled is None:
                    self._forget_attempts_before(tp, records[0].offset)
                partition.push(records)
                self._offer(partition)

    def _flow_control(self) -> None:
        consumer, limit, room = (
            self._consumer,
            self.kafka.max_buffered,
            self.kafka.max_buffered_bytes,
        )
        want = {
            tp
            for tp, p in self._partitions.items()
            if p.rewind is not None or not p.claimed or p.size >= limit or p.bytes >= room
        }
        paused = set(consumer.paused())
        if want - paused:
            consumer.pause(*(want - paused))
        resume = (paused - want) & self._partitions.keys()
        if resume:
            consumer.resume(*resume)

    def _offerable(self, partition: Partition) -> bool:
        if not partition.owned or partition.rewind is not None or not partition.records:
            return False
        if not partition.claimed:
            return False
        if self._counting and partition.records[-1].offset > partition.reserved:
            self._reserve(partition)  # hand out only what the next owner would know of
            return False
        if partition.keyed:
            return partition.next_index(time.monotonic()) is not None
        return partition.inflight < partition.batch

    def _offer(self, partition: Partition) -> None:
        if self._offerable(partition) and partition not in self._ready:
            self._ready.append(partition)
            self._wakeup.set()

    def _hand_out(self, partition: Partition) -> Delivery:
        if partition.keyed:
            index = partition.next_index(time.monotonic())
            assert index is not None  # receive() checked _offerable
            record = partition.take(index)
        else:
            record = partition.pop()
        partition.inflight += 1
        partition.busy = True
        partition.idle.clear()
        attempt = self._attempts.get(partition.tp, {}).get(record.offset, 0) + 1
        if record.offset <= partition.suspect_through:
            attempt = max(attempt, 2)  # may have been started before: counted in the database
        partition.handed = max(partition.handed, record.offset)
        headers = {
            key: value.decode("utf-8", "replace") for key, value in record_headers(record).items()
        }
        try:
            message_id = self._identity(record)
        except Exception as exc:  # a deployment's id function must not stop the pump
            self.stats["message_id_func_failed"] += 1
            self._log.warning(
                "message id function failed",
                error=exc,
                partition=partition.label,
                offset=record.offset,
            )
            message_id = None
        message_type = (
            headers.get(self.kafka.type_header)
            or headers.get("ce_type")
            or self.kafka.topic_types.get(record.topic)
        )
        handle = Handle(partition, record, attempt, message_id)
        if self._overdue_after is not None:
            self._out[handle] = time.monotonic() + self._overdue_after
        body = record.value or b""
        if partition.windowed:
            self._offer(partition)  # records of other keys, or the rest of a batch, may go at once
        suspect = record.offset <= partition.suspect_through  # a dead owner may have started it
        delivery = Delivery(
            message_id, message_type, body, headers, attempt, self, handle, suspect=suspect
        )
        delivery.group = (record.topic, record.partition)  # batches stay within a partition
        if self._database:
            delivery.in_transaction = _Store(self, handle)
        return delivery

    def _returned(self, partition: Partition) -> None:
        partition.inflight -= 1
        partition.busy = partition.inflight > 0
        if not partition.busy:
            partition.idle.set()

    def _settled(self, handle: Handle) -> None:
        partition = handle.partition
        offset = handle.record.offset
        if partition.windowed:
            partition.settle(handle.record)
        else:
            partition.settled = offset + 1
        self._returned(partition)
        attempts = self._attempts.get(partition.tp)
        if attempts:
            attempts.pop(offset, None)
        self._offer(partition)

    def _forget_attempts_before(self, tp: Any, offset: int) -> None:
        """Counts below where a fresh assignment starts belong to records settled elsewhere."""
        attempts = self._attempts.get(tp)
        if attempts:
            for old in [o for o in attempts if o < offset]:
                del attempts[old]

    # -- Settler ----------------------------------------------------------------

    async def ack(self, handle: Handle) -> None:
        self._out.pop(handle, None)
        self._require_owned(handle, "ack")
        self._settled(handle)

    async def ack_many(self, handles: Sequence[Handle]) -> list[Handle]:
        """Offsets settle one record at a time; the lost ones (revoked partitions)."""
        lost = []
        for handle in handles:
            try:
                await self.ack(handle)
            except SettlementLost:
                lost.append(handle)
        return lost

    def keep_alive(self, handle: Handle, seconds: float) -> None:
        """The watchdog allows the record ``seconds`` more, plus its margin."""
        if handle in self._out:
            self._out[handle] = time.monotonic() + seconds + self.kafka.watchdog_margin

    async def in_commit(self, session: AsyncSession, handles: Sequence[Handle]) -> None:
        """Database offsets: the offset past these records, in the handler's transaction."""
        if self._database:
            for handle in handles:
                await self._store_in(handle, session)

    async def nack(self, handle: Handle, delay: float | None, counted: bool = True) -> None:
        self._out.pop(handle, None)
        partition, record = handle.partition, handle.record
        if not partition.owned:
            return  # revoked: the new owner reads from the committed offset, which is before it
        # The next delivery is attempt + 1; one the record is not to blame for
        # (a database outage, a shutdown, a lost conflict) keeps its number.
        spent = handle.attempt if counted else handle.attempt - 1
        self._attempts.setdefault(partition.tp, {})[record.offset] = spent
        if delay is None:
            kafka = self.kafka
            delay = kafka.redelivery_delay * 2 ** (handle.attempt - 1)
            delay = min(kafka.redelivery_delay_max, delay)
        loop = asyncio.get_running_loop()
        self._returned(partition)
        if partition.keyed:
            # Keep the record, and its key: later records of the key wait behind it,
            # other keys go on; the commit point stays below it meanwhile.
            partition.put_back(record, time.monotonic() + delay)
            loop.call_later(delay + 0.001, self._offer, partition)
            self.stats["backoffs"] += 1
            self._log.debug(
                "backing off", partition=partition.label, offset=record.offset, delay=delay
            )
            return
        # Pause now, so that nothing fetched behind the record is handed out;
        # seek back to it once the backoff is over.
        self._consumer.pause(partition.tp)
        partition.drop()
        if partition.rewind is not None:  # a batch with several failures: the lowest one wins
            assert partition.rewind_to is not None
            if partition.rewind_to <= record.offset:
                return
            partition.rewind.cancel()
        partition.rewind_to = record.offset
        partition.rewind = loop.call_later(delay, self._seek_back, partition, record.offset)
        self._log.debug(
            "rewinding",
            partition=partition.label,
            offset=record.offset,
            attempt=handle.attempt,
            delay=round(delay, 3),
        )

    def _seek_back(self, partition: Partition, offset: int) -> None:
        partition.rewind = None
        partition.rewind_to = None
        if partition.owned and not self._stopping:
            self._consumer.seek(partition.tp, offset)
            self._consumer.resume(partition.tp)
            self.stats["seeks_back"] += 1

    async def dead_letter(self, handle: Handle, reason: str) -> None:
        """Produce the record to its dead-letter topic; settle it once the broker has it.

        A send the broker (or the producer's own size check) refuses for good is
        tried once more as a reduced dead letter: the ``dlt-*`` headers with the
        original coordinates, the value (and, if large, the headers and key)
        dropped, which ``dlt-dropped`` names. Any other failure rewinds the record.
        """
        self._out.pop(handle, None)
        self._require_owned(handle, "dead-letter")
        record = handle.record
        topic = self.kafka.dead_letter_topic(record.topic)
        own = self._dead_letter_headers(handle, reason)
        original = [(k, v) for k, v in record.headers or () if not k.startswith(DLT_PREFIX)]
        # aiokafka refuses a record with neither key nor value (a keyless tombstone)
        value = b"" if record.value is None and record.key is None else record.value
        try:
            await self._producer.send_and_wait(topic, value, key=record.key, headers=original + own)
        except _UNSENDABLE as exc:
            await self._dead_letter_reduced(handle, topic, original, own, exc)
        except KafkaError as exc:
            await self._dead_letter_failed(handle, topic, exc)
        self._require_owned(handle, "dead-letter")
        self._settled(handle)

    def _dead_letter_headers(self, handle: Handle, reason: str) -> list[tuple[str, bytes]]:
        record = handle.record
        headers = [
            (DLT_TOPIC, record.topic.encode()),
            (DLT_PARTITION, str(record.partition).encode()),
            (DLT_OFFSET, str(record.offset).encode()),
            (DLT_REASON, reason[:_MAX_REASON].encode()),
            (DLT_DELIVERY_COUNT, str(handle.attempt).encode()),
        ]
        if handle.message_id is not None:
            headers.append((DLT_MESSAGE_ID, handle.message_id[:_MAX_REASON].encode()))
        return headers

    async def _dead_letter_reduced(
        self,
        handle: Handle,
        topic: str,
        original: list[tuple[str, bytes]],
        own: list[tuple[str, bytes]],
        refusal: Exception,
    ) -> None:
        """Send what identifies the record and why it failed; the value stays in its topic."""
        record = handle.record
        value = record.value or b""
        dropped, headers, key = ["value"], original, record.key
        if sum(len(k) + len(v) for k, v in original) > _REDUCED_KEY_MAX * 4:
            dropped.append("headers")
            headers = []
        if key is not None and len(key) > _REDUCED_KEY_MAX:
            dropped.append("key")
            key = None
        marks = [(DLT_DROPPED, ",".join(dropped).encode()), (DLT_ORIGINAL_SIZE, b"%d" % len(value))]
        self.stats["dead_letters_reduced"] += 1
        self._log.warning(
            "dead letter refused for good, sending it reduced",
            message_id=handle.message_id,
            topic=topic,
            partition=record.partition,
            offset=record.offset,
            dropped=",".join(dropped),
            size=len(value),
            error=refusal,
        )
        try:
            await self._producer.send_and_wait(topic, b"", key=key, headers=headers + own + marks)
        except KafkaError as exc:
            await self._dead_letter_failed(handle, topic, exc)

    async def _dead_letter_failed(self, handle: Handle, topic: str, exc: Exception) -> None:
        self.stats["dead_letter_failures"] += 1
        self._log.warning(
            "dead-letter send failed, record rewound",
            message_id=handle.message_id,
            topic=topic,
            attempt=handle.attempt,
            outcome="rewound",
            error=exc,
        )
        await self.nack(handle, None)
        raise SettlementLost(f"dead-letter topic {topic!r} refused the record: {exc}") from None

    def _require_owned(self, handle: Handle, verb: str) -> None:
        partition = handle.partition
        if not partition.owned:
            raise SettlementLost(
                f"{verb} of {partition.label}@{handle.record.offset}: partition revoked; "
                "its new owner reads it again from the committed offset"
            )

    # -- commits and rebalances -------------------------------------------------

    async def _commit_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.kafka.commit_interval)
            await self._commit(list(self._partitions.values()))

    async def _commit(self, partitions: Sequence[Partition]) -> bool:
        """Commit each partition's settled prefix; False when the broker refused.

        Only for partitions assigned in the member's current generation. A member
        that lost its membership (the group dropped it: a long stall, a network
        partition) commits with generation -1, which Kafka accepts when the group
        is empty at that moment: the offset of another owner's newer work would go
        backwards. Such a prefix is not committed; the next owner redoes it.
        """
        async with self._commit_lock:
            if self._database:
                await self._store_offsets(partitions)
            generation = self._generation()
            pending = [p for p in partitions if p.settled is not None and p.settled != p.committed]
            stale = [p for p in pending if p.generation != generation or generation < 0]
            if stale:
                self.stats["stale_commits_skipped"] += 1
                self._log.warning(
                    "not committing for a lost membership",
                    partitions=sorted(p.label for p in stale),
                    generation=generation,
                )
            offsets = {p.tp: p.settled for p in pending if p not in stale}
            if not offsets:
                return not stale
            try:
                async with asyncio.timeout(self.kafka.commit_timeout):
                    await self._consumer.commit(offsets)
            except (KafkaError, TimeoutError) as exc:
                # Not fatal: a later commit (or the next owner) covers it, and
                # what was processed twice meanwhile is absorbed by the inbox.
                self.stats["commit_failures"] += 1
                self._log.warning("offset commit failed", error=exc, partitions=len(offsets))
                return False
            self.stats["commits"] += 1
            for partition in partitions:
                if partition.tp in offsets:
                    partition.committed = offsets[partition.tp]
            return True

    async def _store_offsets(self, partitions: Sequence[Partition]) -> None:
        """Database offsets: move each row over what settled without a commit of its own.

        A handler's transaction stores the offset past its record; duplicates, dead
        letters and side-effect claims commit nothing of the pump's, so the settled
        prefix is stored here, every commit interval, at a revocation and at close.
        Records below it are settled, whoever wrote them; the epoch guard keeps a
        member that lost the row from writing. A failure only means those records are
        read again and absorbed as duplicates.
        """
        assert self._engine is not None
        for partition in partitions:
            slot, settled = partition.slot, partition.settled
            if slot is None or settled is None or settled <= (partition.stored or -1):
                continue
            try:
                if await kafka_offsets.advance(self._engine, slot, settled):
                    partition.stored = settled
                else:
                    self._fenced(partition, "offset store")
            except Exception as exc:
                self.stats["offset_store_failures"] += 1
                self._log.warning(
                    "offset store failed", partition=partition.label, offset=settled, error=exc
                )

    def _chore(self, work: Any, name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _claim(self, partition: Partition) -> None:
        """Take the partition's row over, seek to its stored offset, then let records flow.

        Until the claim is in, the partition stays paused: a record handed out before
        it could be fenced out by the previous owner's last commit, or start from a
        broker offset older than the stored one.
        """
        assert self._engine is not None
        tp, failures = partition.tp, 0
        while partition.owned and not self._stopping:
            try:
                claim = await kafka_offsets.claim(
                    self._engine, self.kafka.group_id, tp.topic, tp.partition, self._owner
                )
                break
            except Exception as exc:  # the database is away: the partition waits for it
                failures += 1
                self.stats["offset_claim_failures"] += 1
                self._log.warning(
                    "offset claim failed", partition=partition.label, error=exc, failures=failures
                )
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))
        else:
            return
        if not partition.owned:
            return
        group = self.kafka.group_id
        partition.slot = kafka_offsets.Slot(group, tp.topic, tp.partition, claim.epoch)
        if self._counting and claim.started_through is not None:
            partition.suspect_through = claim.started_through
        target = partition.refetch
        if self._database and claim.next_offset is not None:
            target = partition.stored = claim.next_offset
        if target is not None:
            self._consumer.seek(tp, target)
        partition.refetch = None
        partition.claimed = True
        self.stats["partitions_claimed"] += 1
        self._log.info(
            "partition claimed",
            partition=partition.label,
            epoch=claim.epoch,
            offset=claim.next_offset,
            started_through=claim.started_through,
        )
        self._flow_control()

    def _reserve(self, partition: Partition) -> None:
        if partition.reserving or partition.slot is None:
            return
        partition.reserving = True
        through = partition.records[-1].offset + _RESERVE_AHEAD
        self._chore(self._reserving(partition, through), f"kafka-reserve-{partition.label}")

    async def _reserving(self, partition: Partition, through: int) -> None:
        assert self._engine is not None and partition.slot is not None
        try:
            if await kafka_offsets.reserve(self._engine, partition.slot, through):
                partition.reserved = through
            else:
                self._fenced(partition, "reservation")
        except Exception as exc:
            self.stats["offset_reservation_failures"] += 1
            self._log.warning("offset reservation failed", partition=partition.label, error=exc)
            await asyncio.sleep(1.0)
        finally:
            partition.reserving = False
        self._offer(partition)

    async def _hand_over(self, partitions: Sequence[Partition]) -> None:
        """A clean revocation: the next owner need not count what was never started."""
        if not self._counting or self._engine is None:
            return
        for partition in partitions:
            if partition.busy or partition.slot is None:
                continue
            try:
                # what this member handed out, and what a crashed owner before it may have
                # started and this member never reached: still suspect for the next one
                through = max(partition.handed, partition.suspect_through)
                await kafka_offsets.hand_over(self._engine, partition.slot, through)
            except Exception as exc:
                self.stats["hand_over_failures"] += 1
                self._log.warning("hand-over not stored", partition=partition.label, error=exc)

    def _fenced(self, partition: Partition, where: str) -> None:
        """Another member claimed the row: stop here, and rejoin if Kafka says it is ours."""
        if not partition.owned:
            return
        self.stats["fenced"] += 1
        self._log.warning(
            "partition fenced: another member claimed it",
            partition=partition.label,
            epoch=partition.slot.epoch if partition.slot else None,
            where=where,
        )
        self._disown(partition)
        partition.claimed = False  # stays paused until a new assignment claims it again
        coordinator = getattr(self._consumer, "_coordinator", None)  # no public accessor
        if coordinator is not None:
            coordinator.request_rejoin()  # a rebalance settles who owns it

    async def _store_in(self, handle: Handle, session: AsyncSession) -> None:
        """The offset past ``handle``'s record, written in the handler's transaction.

        A partition's first record in a session is written at once (taking the row's
        lock, and failing a fenced member before its commit). More records of that
        partition in the same session (a batch) only join the pending set, which is
        written once more just before the commit: one statement per batch, not one
        per record. Either way the value is the contiguous settled prefix as if this
        transaction's records were settled, so a failure in the middle of a batch
        keeps the offset below it.
        """
        partition, offset = handle.partition, handle.record.offset
        info = session.info
        pending: dict[Partition, _Pending] | None = info.get(_PENDING)
        if pending is None:
            pending = info[_PENDING] = {}
        entry = pending.get(partition)
        if entry is not None:
            entry.offsets.add(offset)
            if not info.get(_LISTENING):
                info[_LISTENING] = True
                event.listen(session.sync_session, "before_commit", self._before_commit)
            return
        entry = pending[partition] = _Pending({offset})
        slot = partition.slot
        assert slot is not None  # handed out only once claimed
        n = partition.prefix_with(entry.offsets)
        try:
            await kafka_offsets.store(session, slot, n)
        except Fenced:
            self._fenced(partition, "handler transaction")
            raise
        entry.written = n

    def _before_commit(self, session: Session) -> None:
        """A batch's last word on each partition's offset (runs inside the commit)."""
        pending: dict[Partition, _Pending] = session.info.get(_PENDING, {})
        for partition, entry in pending.items():
            n = partition.prefix_with(entry.offsets)
            if n is None or n == entry.written:
                continue
            assert partition.slot is not None
            try:
                kafka_offsets.store_sync(session, partition.slot, n)
            except Fenced:
                self._fenced(partition, "handler transaction")
                raise
            entry.written = n

    def _generation(self) -> int:
        """The group generation this member is in; -1 when it is in none."""
        coordinator = getattr(self._consumer, "_coordinator", None)  # no public accessor
        generation = getattr(coordinator, "generation", -1)
        return generation if isinstance(generation, int) else -1

    def _assign(self, assigned: Iterable[Any]) -> None:
        for tp in assigned:
            previous = self._partitions.get(tp)
            if previous is not None:  # not revoked first: its handles must not commit
                self._disown(previous)
            keyed = self.kafka.ordering == "key"
            partition = self._partitions[tp] = Partition(
                tp, self._generation(), keyed, span=self.kafka.max_buffered, batch=self._batch
            )
            if self._engine is not None:  # claim the row first; nothing is read before
                partition.claimed = False
                self._consumer.pause(tp)
                self._chore(self._claim(partition), f"kafka-claim-{partition.label}")
            self.stats["partitions_assigned"] += 1
        self.stats["rebalances"] += 1
        labels = sorted(p.label for p in self._partitions.values())
        self._log.info("partitions assigned", partitions=labels)

    async def _revoke(self, revoked: Iterable[Any], hung: Iterable[Any] = ()) -> None:
        """Stop handing out, let in-flight records settle (bounded), commit, drop the rest.

        ``hung``: partitions whose in-flight record is overdue, not worth waiting for.
        """
        partitions = [self._partitions.pop(tp) for tp in revoked if tp in self._partitions]
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
            _, late = await asyncio.wait(waits, timeout=self.kafka.rebalance_grace)
            for task in late:
                task.cancel()
        dropped = sum(p.busy for p in partitions)
        for partition in partitions:
            self._disown(partition)
        await self._commit(partitions)
        await self._hand_over(partitions)
        self.stats["partitions_revoked"] += len(partitions)
        if dropped:
            self.stats["in_flight_dropped"] += dropped
        self._log.info(
            "partitions revoked",
            partitions=sorted(p.label for p in partitions),
            in_flight_dropped=dropped,
        )

    # -- the watchdog -----------------------------------------------------------

    async def _watch(self) -> None:
        """Leave the group while a record handed out is overdue; rejoin once none is.

        The fetch task keeps polling whatever the handlers do, so the group's
        ``max.poll.interval`` never notices a hung handler; this does. A record
        still out ``WORKER_HANDLER_TIMEOUT`` + ``WORKER_RETRY_BUDGET`` +
        ``WORKER_KAFKA_WATCHDOG_MARGIN`` seconds after it was handed out means the
        pump's own time limits did not end it: the member commits its settled
        prefixes, leaves, and its partitions go to the other members, the overdue
        record included.
        """
        assert self._overdue_after is not None
        step = max(0.05, min(1.0, self._overdue_after / 4))
        while True:
            await asyncio.sleep(step)
            now = time.monotonic()
            overdue = [h for h, due in self._out.items() if due <= now]
            try:
                if self._left:
                    if not overdue and not self._stopping:
                        self._rejoin()
                elif any(h.partition.owned for h in overdue):
                    await self._leave([h for h in overdue if h.partition.owned])
            except Exception as exc:  # aiokafka refused: try again next round, never go quiet
                self.stats["watchdog_errors"] += 1
                self._log.error("kafka watchdog step failed", error=exc, left=self._left)

    async def _leave(self, overdue: list[Handle]) -> None:
        self._left = True
        assert self._overdue_after is not None
        for handle in overdue:
            self._log.error(
                "record overdue, leaving the consumer group so its partitions move on",
                message_id=handle.message_id,
                partition=handle.partition.label,
                offset=handle.record.offset,
                attempt=handle.attempt,
                limit=self._overdue_after,
            )
        hung = {handle.partition.tp for handle in overdue}
        try:
            await self._revoke(list(self._partitions), hung=hung)
            self._consumer.unsubscribe()  # sends LeaveGroup; no rebalance callback follows
        except Exception:
            self._left = False  # still in the group: the next round tries again
            raise
        self.stats["watchdog_leaves"] += 1
        for partition in self._partitions.values():  # assigned while _revoke waited
            self._disown(partition)
        self._partitions.clear()

    def _rejoin(self) -> None:
        self._left = False
        self._consumer.subscribe(self.kafka.topic_list, listener=_Listener(self))
        self.stats["watchdog_rejoins"] += 1
        self._log.info("no record overdue any more, rejoining the consumer group")

    def _disown(self, partition: Partition) -> None:
        """From here on, settlements of its records raise SettlementLost."""
        partition.owned = False
        partition.drop()
        if partition.rewind is not None:
            partition.rewind.cancel()
            partition.rewind = None
            partition.rewind_to = None
