"""The consumer: :class:`KafkaConsumer`, a group member that commits offsets instead of acking.

It is the transport: it fetches, buffers and hands records out, keeps each partition's
flow in check, and maps the settlement verbs onto offsets. What it leaves to its parts:
how partitions are kept and how they come and go in a rebalance
(:mod:`~worker.brokers.kafka.partitions`), where the settled prefixes go
(:mod:`~worker.brokers.kafka.store`),
when a record is hung (:mod:`~worker.brokers.kafka.watchdog`), producing dead letters
(:mod:`~worker.brokers.kafka.deadletters`), and what aiokafka keeps private about the
group (:mod:`~worker.brokers.kafka.membership`). Kafka has no per-message settlement:

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

Kafka keeps no delivery count: the adapter counts attempts (and uncounted give-backs)
per record in memory, so a restart (or a record landing on another member) starts again
at 1. With ``WORKER_DELIVERY_COUNTS=database`` the store records ahead which offsets may
be started, and a later owner hands those out as *suspect*: possible redeliveries, which
the worker counts in the database. A settlement of a record whose partition was revoked
raises :class:`~worker.errors.SettlementLost`: the new owner gets the record again and
the inbox absorbs whatever this process already committed to the database.

Deliveries carry ``group = (topic, partition)``: the pump's lane for the partition, so its
records apply in offset order while records of other partitions may share their group
(``WORKER_BATCH_SIZE``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]
from aiokafka.errors import KafkaError  # type: ignore[import-untyped]

from worker.brokers import load_identity
from worker.brokers.kafka import membership
from worker.brokers.kafka.deadletters import DeadLetters
from worker.brokers.kafka.partitions import Handle, Partition, Rebalances, Tally
from worker.brokers.kafka.records import header_message_id, record_contents, record_headers
from worker.brokers.kafka.settings import FETCH_WAIT_MS, start_client
from worker.brokers.kafka.store import RESERVE_AHEAD, open_store
from worker.brokers.kafka.watchdog import Watchdog
from worker.delivery import Delivery, ack_each
from worker.errors import BrokerUnavailable, ConfigurationError, SettlementLost
from worker.logs import get_logger

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

    from worker.brokers.kafka.settings import KafkaSettings
    from worker.settings import Settings


class KafkaConsumer:
    """One consumer-group member: the pump's :class:`~worker.brokers.Broker` and Settler."""

    name = "kafka"
    watches = True  # keep_alive feeds the watchdog
    writes_in_commit = True  # offsets, with WORKER_KAFKA_OFFSETS=database

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
        self._partitions: dict[Any, Partition] = {}
        self._ready: deque[Partition] = deque()
        self._wakeup = asyncio.Event()
        self._tally = Tally()
        self._tasks: list[asyncio.Task[None]] = []
        self._chores: set[asyncio.Task[None]] = set()  # claims and reservations under way
        self._fetch_ok = False
        self._started = False
        self._stopping = False
        batch = max(1, settings.batch_size or 1)  # WORKER_BATCH_SIZE
        self._rebalances = Rebalances(self, self._partitions, batch, self._log)
        self.offsets = open_store(settings, kafka, self.stats, self._log, self._rebalances.fenced)
        self.dead_letters = DeadLetters(kafka, self.stats, self._log)
        # A delivery may legitimately take one handler attempt, plus the in-process
        # retries of conflicts, before its first keep_alive says what it is doing.
        limit = settings.handler_timeout
        arm = None if limit is None else limit + settings.retry_budget + kafka.watchdog_margin
        self.watchdog = Watchdog(arm, kafka.watchdog_margin, self.stats, self._log)

    # -- lifecycle --------------------------------------------------------------

    @property
    def engine(self) -> AsyncEngine | None:
        """The offset store's own engine, if it has one (see ``store.ENGINE_POOL_SIZE``)."""
        return self.offsets.engine

    @property
    def ready(self) -> bool:
        """Started, not stopping, fetching, and the group coordinator known.

        An idle member (no partition: a replica beyond the partition count, a surge pod
        during a rollout) is healthy and ready: requiring partitions would hang rollouts
        and node drains at maximum scale. False while the watchdog keeps the member out
        of the group.
        """
        if not self._started or self._stopping or self.watchdog.left or not self._fetch_ok:
            return False
        return membership.coordinator_known(self._consumer)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def assignment(self) -> list[Any]:
        return list(self._partitions)

    @property
    def client(self) -> Any:
        """The AIOKafkaConsumer (None before :meth:`start`)."""
        return self._consumer

    async def start(self, prefetch: int) -> None:
        """Join the group. ``prefetch`` is moot: one record per partition (or key) is in flight.

        Raises :class:`~worker.errors.BrokerUnavailable` when trying again may succeed and
        :class:`~worker.errors.ConfigurationError` when it cannot (a refused login).
        """
        kafka = self.kafka
        options = kafka.client_options()
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
        await self.offsets.open(self._consumer)  # before the first assignment claims rows
        self._consumer.subscribe(kafka.topic_list, listener=self._rebalances.listener())
        self.dead_letters.producer = AIOKafkaProducer(
            acks="all",
            enable_idempotence=kafka.idempotent_producer,
            max_request_size=kafka.max_request_size,
            **options,
        )
        try:
            await start_client(kafka, self.dead_letters.producer, producer=True)
            await start_client(kafka, self._consumer)
        except (BrokerUnavailable, ConfigurationError):
            await self._stop_clients()
            raise
        self._started = True
        self._tasks = [
            asyncio.create_task(self._fetch(), name="kafka-fetch"),
            asyncio.create_task(self._commit_periodically(), name="kafka-commit"),
        ]
        if self.watchdog.enabled:
            self._tasks.append(asyncio.create_task(self.watchdog.run(self), name="kafka-watchdog"))
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
            partition.disown()
        for chore in list(self._chores):
            chore.cancel()
        await asyncio.gather(*self._chores, return_exceptions=True)
        if self._consumer is not None and partitions:
            await self.offsets.commit(partitions)
            await self.offsets.hand_over(partitions)
        await self._stop_clients()
        self._log.info("kafka consumer closed")

    async def _cancel_tasks(self, name: str | None = None) -> None:
        chosen = [t for t in self._tasks if name is None or t.get_name() == name]
        for task in chosen:
            task.cancel()
        await asyncio.gather(*chosen, return_exceptions=True)
        self._tasks = [t for t in self._tasks if t not in chosen]

    async def _stop_clients(self) -> None:
        for client in (self._consumer, self.dead_letters.producer):
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
        await self.offsets.close()

    # -- the flow of records ----------------------------------------------------

    async def _fetch(self) -> None:
        """Buffer fetched records per partition; pause partitions that are full or rewinding."""
        consumer = self._consumer
        failures = 0
        while True:
            if self.watchdog.left:  # unsubscribed: nothing to fetch until the watchdog rejoins
                await asyncio.sleep(FETCH_WAIT_MS / 1000)
                continue
            self.flow_control()
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
                    self._tally.forget_before(tp, records[0].offset)
                partition.push(records)
                self._offer(partition)

    def flow_control(self) -> None:
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
        if not self.offsets.covers(partition):  # hand out only what the next owner would know of
            if not partition.reserving:
                partition.reserving = True
                through = partition.records[-1].offset + RESERVE_AHEAD
                self.chore(self._reserve(partition, through), f"kafka-reserve-{partition.label}")
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
        tp, offset = partition.tp, record.offset
        attempt = self._tally.attempts(tp, offset) + 1
        suspect = offset <= partition.suspect_through  # a dead owner may have started it
        if suspect:
            attempt = max(attempt, 2)  # a possible redelivery: counted in the database
        partition.handed = max(partition.handed, offset)
        headers = {
            key: value.decode("utf-8", "replace") for key, value in record_headers(record).items()
        }
        try:
            message_id = self._identity(record)
        except Exception as exc:  # a deployment's id function must not stop the pump
            self.stats["message_id_func_failed"] += 1
            self._log.warning(
                "message id function failed", error=exc, partition=partition.label, offset=offset
            )
            message_id = None
        # a structured CloudEvent's type, data and attributes; else the headers' type
        contents = record_contents(record, headers, self.kafka.type_header, self.kafka.topic_types)
        handle = Handle(partition, record, attempt, message_id)
        self.watchdog.arm(handle)
        if partition.windowed:
            self._offer(partition)  # records of other keys, or the rest of a batch, may go at once
        delivery = Delivery(
            message_id,
            contents.type,
            contents.body,
            contents.headers,
            attempt,
            self,
            handle,
            suspect=suspect,
            give_backs=self._tally.give_backs(tp, offset),
            refusal=contents.refusal,
        )
        delivery.group = (record.topic, record.partition)  # the partition's lane: offset order
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
        self._tally.settled(partition.tp, offset)
        self._offer(partition)

    # -- Settler ----------------------------------------------------------------

    async def ack(self, handle: Handle) -> None:
        self.watchdog.disarm(handle)
        self._require_owned(handle, "ack")
        self._settled(handle)

    async def ack_many(self, handles: Sequence[Handle]) -> list[Handle]:
        """Offsets settle one record at a time; the lost ones (revoked partitions)."""
        return await ack_each(self.ack, handles)

    def keep_alive(self, handle: Handle, seconds: float) -> None:
        """The watchdog allows the record ``seconds`` from now, plus its margin."""
        self.watchdog.keep_alive(handle, seconds)

    async def in_commit(self, session: AsyncSession, handles: Sequence[Handle]) -> None:
        """Database offsets: each partition's offset past these records, in their transaction."""
        await self.offsets.in_commit(session, handles)

    async def nack(self, handle: Handle, delay: float | None, counted: bool = True) -> None:
        self.watchdog.disarm(handle)
        partition, record = handle.partition, handle.record
        if not partition.owned:
            return  # revoked: the new owner reads from the committed offset, which is before it
        # The next delivery is attempt + 1; one the record is not to blame for
        # (a database outage, a shutdown, a lost conflict) keeps its number.
        self._tally.nacked(partition.tp, record.offset, handle.attempt, counted)
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

        A send that fails (also reduced, see :mod:`~worker.brokers.kafka.deadletters`)
        rewinds the record as a nack would, and the settlement is lost.
        """
        self.watchdog.disarm(handle)
        self._require_owned(handle, "dead-letter")
        failure = await self.dead_letters.send(handle, reason)
        if failure is not None:
            await self.nack(handle, None)
            topic = self.kafka.dead_letter_topic(handle.record.topic)
            raise SettlementLost(f"dead-letter topic {topic!r} refused the record: {failure}")
        self._require_owned(handle, "dead-letter")
        self._settled(handle)

    def _require_owned(self, handle: Handle, verb: str) -> None:
        partition = handle.partition
        if not partition.owned:
            raise SettlementLost(
                f"{verb} of {partition.label}@{handle.record.offset}: partition revoked; "
                "its new owner reads it again from the committed offset"
            )

    # -- commits, chores and reservations -----------------------------------------

    async def _commit_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.kafka.commit_interval)
            await self.offsets.commit(list(self._partitions.values()))

    def chore(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _reserve(self, partition: Partition, through: int) -> None:
        try:
            await self.offsets.reserve(partition, through)
        finally:
            partition.reserving = False
        self._offer(partition)

    # -- what the watchdog asks of the member -----------------------------------

    async def leave(self, overdue: list[Handle]) -> None:
        """Commit the settled prefixes and leave the group; the overdue records' partitions
        are not waited for."""
        await self._rebalances.revoke(
            list(self._partitions), hung={h.partition.tp for h in overdue}
        )
        self._consumer.unsubscribe()  # sends LeaveGroup; no rebalance callback follows
        for partition in self._partitions.values():  # assigned while revoke() waited
            partition.disown()
        self._partitions.clear()

    def rejoin(self) -> None:
        self._consumer.subscribe(self.kafka.topic_list, listener=self._rebalances.listener())
