"""The offset store: where a partition's settled prefix goes, and what a new owner reads first.

:class:`OffsetStore` holds the bookkeeping every store shares (saq's ``queue/base.py``
shape: the shared steps in the base, the store-specific ones as small abstract steps):
commits are serialized, a prefix is committed to Kafka only in the generation its
partition was assigned in, a commit is bounded by ``WORKER_KAFKA_COMMIT_TIMEOUT``, and
a failed one is never fatal (a later commit, or the next owner, covers it; the inbox
absorbs what is read again). The steps:

- :meth:`~OffsetStore.claim`: a newly assigned partition is taken over before any of
  its records flow (only when :attr:`~OffsetStore.claims`), and says where to seek;
- :meth:`~OffsetStore.covers` / :meth:`~OffsetStore.reserve`: records are handed out
  only once the next owner could know they may have been started;
- :meth:`~OffsetStore.in_commit`: the store's writes in the handler's own transaction;
- :meth:`~OffsetStore._save`: before each broker commit, what settled without a
  transaction of its own;
- :meth:`~OffsetStore.hand_over`: at a clean revocation or shutdown.

Two stores. :class:`KafkaOffsets`: the offsets live in Kafka alone, and every step is
empty. :class:`DatabaseRows`: each partition's ``consumer_offsets`` row
(:mod:`worker.brokers.kafka.offsets`), claimed per assignment and fenced by its epoch;
with ``WORKER_KAFKA_OFFSETS=database`` it keeps the offsets (Kafka's commits go on, for
lag monitoring only), with ``WORKER_DELIVERY_COUNTS=database`` it records ahead which
offsets may be started.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiokafka.errors import KafkaError  # type: ignore[import-untyped]

from worker.brokers.kafka import membership
from worker.brokers.kafka import offsets as rows
from worker.brokers.kafka.offsets import Fenced
from worker.db import create_engine

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

    from worker.brokers.kafka.partitions import Handle, Partition
    from worker.brokers.kafka.settings import KafkaSettings
    from worker.settings import Settings

ENGINE_POOL_SIZE = 2
ENGINE_MAX_OVERFLOW = 2
"""The :class:`DatabaseRows` store's own engine (claims, reservations, hand-overs and the
offsets of what commits nothing of its own): at most 4 connections per replica, on top
of ``WORKER_DB_POOL_SIZE``. With both Kafka database modes off there is no such engine."""

RESERVE_AHEAD = 200
"""``WORKER_DELIVERY_COUNTS=database``: offsets are reserved (recorded as "may be started")
this far past the buffer, one write per block; after a crash, the next owner counts the
deliveries of at most this many records (plus the buffer) in the database."""

Fence = Callable[["Partition", str], None]
"""Called when another member claimed a partition's row since this one did."""


class OffsetStore(ABC):
    """Commits each partition's settled prefix; the steps say what else a store keeps."""

    claims = False
    """True: a new assignment stays paused until :meth:`claim` is done."""

    engine: AsyncEngine | None = None
    """The store's own engine, if it has one (sized by ``ENGINE_POOL_SIZE``)."""

    def __init__(self, kafka: KafkaSettings, stats: Counter[str], log: Any, fenced: Fence) -> None:
        self.kafka = kafka
        self._stats = stats
        self._log = log
        self._fenced = fenced
        self._client: Any = None  # the AIOKafkaConsumer, from open()
        self._lock = asyncio.Lock()

    async def open(self, client: Any) -> None:
        """Before the consumer starts: its first assignment may claim rows at once."""
        self._client = client

    async def close(self) -> None:
        """After the last commit: release what :meth:`open` took."""
        self._client = None

    async def commit(self, partitions: Sequence[Partition]) -> bool:
        """Commit each partition's settled prefix; False when the broker refused.

        Only for partitions assigned in the member's current generation. A member that
        lost its membership (the group dropped it: a long stall, a network partition)
        commits with generation -1, which Kafka accepts when the group is empty at that
        moment: the offset of another owner's newer work would go backwards. Such a
        prefix is not committed; the next owner redoes it.
        """
        async with self._lock:
            await self._save(partitions)
            generation = membership.generation(self._client)
            pending = [p for p in partitions if p.settled is not None and p.settled != p.committed]
            stale = [p for p in pending if p.generation != generation or generation < 0]
            if stale:
                self._stats["stale_commits_skipped"] += 1
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
                    await self._client.commit(offsets)
            except (KafkaError, TimeoutError) as exc:
                self._stats["commit_failures"] += 1
                self._log.warning("offset commit failed", error=exc, partitions=len(offsets))
                return False
            self._stats["commits"] += 1
            for partition in partitions:
                if partition.tp in offsets:
                    partition.committed = offsets[partition.tp]
            return True

    # -- the steps --------------------------------------------------------------

    @abstractmethod
    async def claim(self, partition: Partition) -> int | None:
        """Take a newly assigned partition over (one try; raises when the store is away).

        Returns the offset to seek to, or None: where Kafka says.
        """

    @abstractmethod
    def covers(self, partition: Partition) -> bool:
        """Whether the partition's buffered records may be handed out now."""

    @abstractmethod
    async def reserve(self, partition: Partition, through: int) -> None:
        """Record offsets up to ``through`` as possibly started, so that :meth:`covers`
        holds (one try; a failure is logged and waited out)."""

    @abstractmethod
    async def in_commit(self, session: AsyncSession, handles: Sequence[Handle]) -> None:
        """The store's writes for these records, in the transaction about to commit them."""

    @abstractmethod
    async def _save(self, partitions: Sequence[Partition]) -> None:
        """Before a broker commit: the store's own copy of the settled prefixes."""

    @abstractmethod
    async def hand_over(self, partitions: Sequence[Partition]) -> None:
        """A clean revocation or shutdown of these partitions (after their last commit)."""


class KafkaOffsets(OffsetStore):
    """Offsets in Kafka alone: nothing to claim, reserve, or write with the work."""

    async def claim(self, partition: Partition) -> int | None:
        return None

    def covers(self, partition: Partition) -> bool:
        return True

    async def reserve(self, partition: Partition, through: int) -> None:
        return None

    async def in_commit(self, session: AsyncSession, handles: Sequence[Handle]) -> None:
        return None

    async def _save(self, partitions: Sequence[Partition]) -> None:
        return None

    async def hand_over(self, partitions: Sequence[Partition]) -> None:
        return None


class DatabaseRows(OffsetStore):
    """Each partition's ``consumer_offsets`` row, claimed per assignment, fenced by its epoch.

    ``offsets``: the row keeps the partition's offset (``WORKER_KAFKA_OFFSETS=database``).
    ``counting``: the row records which offsets may be started
    (``WORKER_DELIVERY_COUNTS=database``), so that the next owner delivers those as
    possible redeliveries.
    """

    claims = True

    def __init__(
        self,
        kafka: KafkaSettings,
        stats: Counter[str],
        log: Any,
        fenced: Fence,
        *,
        database_url: str,
        offsets: bool,
        counting: bool,
    ) -> None:
        super().__init__(kafka, stats, log, fenced)
        self.database_url = database_url
        self.offsets = offsets
        self.counting = counting
        here = f"{socket.gethostname()}/{os.getpid()}"
        self.owner = f"{kafka.client_id}@{here}/{uuid.uuid4().hex[:6]}"  # the row says who

    async def open(self, client: Any) -> None:
        await super().open(client)
        if self.engine is None:
            self.engine = create_engine(
                self.database_url, pool_size=ENGINE_POOL_SIZE, max_overflow=ENGINE_MAX_OVERFLOW
            )

    async def close(self) -> None:
        await super().close()
        if self.engine is not None:
            await self.engine.dispose()
            self.engine = None

    def _engine(self) -> AsyncEngine:
        assert self.engine is not None, "open() first"
        return self.engine

    async def claim(self, partition: Partition) -> int | None:
        """Take the row over (epoch + 1); with database offsets, seek to its offset.

        On PostgreSQL the claim waits for the row lock a committing transaction of the
        previous owner holds, so it reads that commit's offset, never an older one.
        """
        tp, group = partition.tp, self.kafka.group_id
        claim = await rows.claim(self._engine(), group, tp.topic, tp.partition, self.owner)
        if not partition.owned:
            return None
        partition.slot = rows.Slot(group, tp.topic, tp.partition, claim.epoch)
        if self.counting and claim.started_through is not None:
            partition.suspect_through = claim.started_through
        target = None
        if self.offsets and claim.next_offset is not None:
            target = partition.stored = claim.next_offset
        self._stats["partitions_claimed"] += 1
        self._log.info(
            "partition claimed",
            partition=partition.label,
            epoch=claim.epoch,
            offset=claim.next_offset,
            started_through=claim.started_through,
        )
        return target

    def covers(self, partition: Partition) -> bool:
        return not self.counting or partition.records[-1].offset <= partition.reserved

    async def reserve(self, partition: Partition, through: int) -> None:
        slot = partition.slot
        assert slot is not None  # reservations follow the claim
        try:
            if await rows.reserve(self._engine(), slot, through):
                partition.reserved = through
            else:
                self._fenced(partition, "reservation")
        except Exception as exc:
            self._stats["offset_reservation_failures"] += 1
            self._log.warning("offset reservation failed", partition=partition.label, error=exc)
            await asyncio.sleep(1.0)

    async def in_commit(self, session: AsyncSession, handles: Sequence[Handle]) -> None:
        """Database offsets: once per partition, the offset past these records' work.

        The value is the contiguous settled prefix as if these records were settled, so
        a batch with a failure in its middle (whose committed members are all that is
        passed here) keeps the offset below the failure. A write that moves nothing still
        checks the epoch and takes the row's lock: a fenced member's transaction fails.
        """
        if not self.offsets:
            return
        by_partition: dict[Partition, list[int]] = {}
        for handle in handles:
            by_partition.setdefault(handle.partition, []).append(handle.record.offset)
        for partition, mine in by_partition.items():
            slot = partition.slot
            assert slot is not None  # handed out only once claimed
            try:
                await rows.store(session, slot, partition.prefix_with(mine))
            except Fenced:
                self._fenced(partition, "handler transaction")
                raise

    async def _save(self, partitions: Sequence[Partition]) -> None:
        """Database offsets: move each row over what settled without a commit of its own.

        A handler's transaction stores the offset past its record; duplicates, dead
        letters and side-effect claims commit nothing of the worker's, so the settled
        prefix is stored here, every commit interval, at a revocation and at close.
        Records below it are settled, whoever wrote them; the epoch guard keeps a
        member that lost the row from writing. A failure only means those records are
        read again and absorbed as duplicates.
        """
        if not self.offsets:
            return
        for partition in partitions:
            slot, settled = partition.slot, partition.settled
            if slot is None or settled is None or settled <= (partition.stored or -1):
                continue
            try:
                if await rows.advance(self._engine(), slot, settled):
                    partition.stored = settled
                else:
                    self._fenced(partition, "offset store")
            except Exception as exc:
                self._stats["offset_store_failures"] += 1
                self._log.warning(
                    "offset store failed", partition=partition.label, offset=settled, error=exc
                )

    async def hand_over(self, partitions: Sequence[Partition]) -> None:
        """Database counts: the next owner need not count what was never started."""
        if not self.counting:
            return
        for partition in partitions:
            if partition.busy or partition.slot is None:
                continue
            try:
                # what this member handed out, and what a crashed owner before it may have
                # started and this member never reached: still suspect for the next one
                through = max(partition.handed, partition.suspect_through)
                await rows.hand_over(self._engine(), partition.slot, through)
            except Exception as exc:
                self._stats["hand_over_failures"] += 1
                self._log.warning("hand-over not stored", partition=partition.label, error=exc)


def open_store(
    settings: Settings, kafka: KafkaSettings, stats: Counter[str], log: Any, fenced: Fence
) -> OffsetStore:
    """The store the settings ask for: rows in the database if either mode needs them."""
    offsets = kafka.offsets == "database"
    counting = settings.delivery_counts == "database"
    if not (offsets or counting):
        return KafkaOffsets(kafka, stats, log, fenced)
    return DatabaseRows(
        kafka,
        stats,
        log,
        fenced,
        database_url=settings.database_url,
        offsets=offsets,
        counting=counting,
    )
