"""Kafka (aiokafka): a consumer-group member that commits offsets instead of acking.

Kafka has no per-message settlement, so the verbs map onto offsets:

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

``WORKER_KAFKA_OFFSETS=database`` (:mod:`worker.brokers.kafka_offsets`): a newly
assigned partition is claimed (its row's epoch + 1) and sought to the stored
offset before any record is handed out; each delivery's ``in_transaction``
writes the offset past it in the handler's own commit, guarded by the epoch, so
a member that lost the partition cannot commit. Broker commits go on, advisory.
Deliveries carry ``group = (topic, partition)``: a batch (``WORKER_BATCH_SIZE``,
that many contiguous records of a partition out at once) stays in one partition.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from aiokafka import (  # type: ignore[import-untyped]
    AIOKafkaConsumer,
    AIOKafkaProducer,
    ConsumerRebalanceListener,
    TopicPartition,
)
from aiokafka.errors import (  # type: ignore[import-untyped]
    ClusterAuthorizationFailedError,
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
    InvalidTopicError,
    KafkaConnectionError,
    KafkaError,
    MessageSizeTooLargeError,
    PolicyViolationError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    UnsupportedForMessageFormatError,
)
from aiokafka.helpers import create_ssl_context  # type: ignore[import-untyped]
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import event

from worker.brokers import (
    DEFAULT_SCAN,
    DeadLetterFilter,
    DeadLetterInfo,
    IdentityFunc,
    OutgoingMessage,
    kafka_offsets,
    load_identity,
)
from worker.brokers.kafka_offsets import Fenced
from worker.delivery import Delivery
from worker.errors import BrokerUnavailable, ConfigurationError, SettlementLost
from worker.logs import get_logger
from worker.settings import load

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
    from sqlalchemy.orm import Session

    from worker.settings import Settings

DLT_TOPIC = "dlt-original-topic"
DLT_PARTITION = "dlt-original-partition"
DLT_OFFSET = "dlt-original-offset"
DLT_REASON = "dlt-reason"
DLT_MESSAGE_ID = "dlt-message-id"
DLT_DELIVERY_COUNT = "dlt-delivery-count"
DLT_DROPPED = "dlt-dropped"
DLT_ORIGINAL_SIZE = "dlt-original-size"
_DLT_PREFIX = "dlt-"
_MAX_REASON = 2000
_FETCH_WAIT_MS = 200
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


class KafkaSettings(BaseSettings):
    """``WORKER_KAFKA_*``: where to consume from and how the records are read."""

    model_config = SettingsConfigDict(env_prefix="WORKER_KAFKA_", extra="ignore")

    bootstrap_servers: str = Field("localhost:9092", description="Comma-separated host:port.")
    topics: str = Field("work", description="Comma-separated; `worker publish` uses the first.")
    group_id: str = Field("worker", min_length=1, description="The consumer group of the replicas.")
    client_id: str = "worker"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = Field(None, description="CA bundle of the brokers' certificates.")
    ssl_certfile: str | None = Field(None, description="Client certificate (mutual TLS).")
    ssl_keyfile: str | None = Field(None, description="Client private key (mutual TLS).")
    ssl_password: SecretStr | None = Field(None, description="Password of the client key.")
    message_id_header: str = Field("message-id", min_length=1, description="Dedup key header.")
    type_header: str = Field("type", min_length=1, description="Message type header.")
    topic_types: dict[str, str] = Field(
        default_factory=dict, description='JSON {"topic": "MessageType"} for records without one.'
    )
    dead_letter_suffix: str = Field(".DLT", min_length=1, description="Dead-letter topic suffix.")
    commit_interval: float = Field(1.0, gt=0, description="Seconds between offset commits.")
    commit_timeout: float = Field(
        10.0, gt=0, description="Seconds a commit or a client stop may take (broker away)."
    )
    session_timeout_ms: int = Field(45_000, ge=1000)
    heartbeat_interval_ms: int = Field(3_000, ge=100)
    max_poll_interval_ms: int = Field(300_000, ge=1000)
    rebalance_grace: float = Field(
        10.0, ge=0, description="Seconds in-flight records of revoked partitions get to settle."
    )
    redelivery_delay: float = Field(1.0, ge=0, description="First backoff of a nacked record.")
    redelivery_delay_max: float = Field(30.0, ge=0, description="Cap of that doubling backoff.")
    auto_offset_reset: Literal["earliest", "latest"] = Field(
        "earliest", description="Where a group without a committed offset starts."
    )
    max_buffered: int = Field(500, ge=1, description="Fetched records buffered per partition.")
    max_buffered_bytes: int = Field(
        8 * 1024 * 1024, ge=1, description="Bytes of fetched records buffered per partition."
    )
    max_partition_fetch_bytes: int = Field(
        1024 * 1024, ge=1024, description="Bytes one fetch asks for per partition."
    )
    fetch_max_bytes: int = Field(
        50 * 1024 * 1024, ge=1024, description="Bytes one fetch asks for in all."
    )
    idempotent_producer: bool = Field(True, description="Idempotent dead-letter producer.")
    offsets: Literal["broker", "database"] = Field(
        "broker",
        description="broker: offsets committed to Kafka; database: stored in the handler's "
        "transaction (consumer_offsets), Kafka commits only for lag monitoring.",
    )
    ordering: Literal["partition", "key"] = Field(
        "partition",
        description="partition: one record per partition at a time; key: one per key.",
    )
    max_request_size: int = Field(
        1_048_576, ge=1024, description="Largest request the dead-letter producer sends, bytes."
    )
    watchdog_margin: float = Field(
        30.0,
        ge=0,
        description="Seconds past WORKER_HANDLER_TIMEOUT + WORKER_RETRY_BUDGET before a "
        "record in a handler counts as hung.",
    )

    @property
    def topic_list(self) -> list[str]:
        return [name.strip() for name in self.topics.split(",") if name.strip()]

    def dead_letter_topic(self, topic: str) -> str:
        return f"{topic}{self.dead_letter_suffix}"

    def client_options(self) -> dict[str, Any]:
        """Connection and security options shared by consumers and producers."""
        options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.security_protocol.startswith("SASL"):
            options["sasl_mechanism"] = self.sasl_mechanism
            options["sasl_plain_username"] = self.sasl_username
            options["sasl_plain_password"] = (
                self.sasl_password.get_secret_value() if self.sasl_password else None
            )
        if self.security_protocol.endswith("SSL"):
            options["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile,
                certfile=self.ssl_certfile,
                keyfile=self.ssl_keyfile,
                password=self.ssl_password.get_secret_value() if self.ssl_password else None,
            )
        return options


def load_kafka_settings() -> KafkaSettings:
    """Load and cross-check ``WORKER_KAFKA_*``; every problem is one line."""
    kafka = load(KafkaSettings)
    topics = kafka.topic_list
    if not topics:
        raise ConfigurationError("WORKER_KAFKA_TOPICS: name at least one topic")
    if any(topic.endswith(kafka.dead_letter_suffix) for topic in topics):
        raise ConfigurationError("WORKER_KAFKA_TOPICS: a dead-letter topic cannot be consumed")
    if kafka.security_protocol.startswith("SASL") and not (
        kafka.sasl_username and kafka.sasl_password
    ):
        raise ConfigurationError(
            "WORKER_KAFKA_SASL_USERNAME and WORKER_KAFKA_SASL_PASSWORD are required with "
            f"WORKER_KAFKA_SECURITY_PROTOCOL={kafka.security_protocol}"
        )
    if bool(kafka.ssl_certfile) != bool(kafka.ssl_keyfile):
        raise ConfigurationError(
            "WORKER_KAFKA_SSL_CERTFILE and WORKER_KAFKA_SSL_KEYFILE go together"
        )
    if kafka.heartbeat_interval_ms * 3 > kafka.session_timeout_ms:
        raise ConfigurationError(
            "WORKER_KAFKA_HEARTBEAT_INTERVAL_MS must be at most a third of "
            "WORKER_KAFKA_SESSION_TIMEOUT_MS"
        )
    try:
        kafka.client_options()  # opens the certificate files: fail at start, not at connect
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"WORKER_KAFKA_SSL_*: {exc}") from None
    return kafka


async def start_producer(kafka: KafkaSettings) -> Any:
    """A started ``acks=all`` producer (idempotent unless switched off), or a one-line error."""
    producer = AIOKafkaProducer(
        acks="all", enable_idempotence=kafka.idempotent_producer, **kafka.client_options()
    )
    try:
        await producer.start()
    except KafkaError as exc:
        await producer.stop()
        raise _start_error(kafka, exc) from None
    return producer


def _start_error(kafka: KafkaSettings, exc: Exception) -> Exception:
    """What a failed producer start means: the brokers are away, or refuse the producer mode.

    Past the bootstrap, a producer start fails only in InitProducerId, which the
    idempotent producer needs and some brokers (old ones, some Kafka-compatible
    ones, a principal without IDEMPOTENT_WRITE) refuse, with errors as vague as
    ``UnknownError``: name the setting that avoids it.
    """
    where = f"kafka at {kafka.bootstrap_servers}"
    if kafka.idempotent_producer and not isinstance(exc, KafkaConnectionError):
        return ConfigurationError(
            f"{where} refused the idempotent producer ({type(exc).__name__}: {exc}); the broker "
            "may not support it or not allow it (IDEMPOTENT_WRITE): set "
            "WORKER_KAFKA_IDEMPOTENT_PRODUCER=false to use a plain producer (acks=all)"
        )
    return BrokerUnavailable(f"{where}: {exc}")


# -- reading records -------------------------------------------------------------


def _text(raw: bytes | None) -> str | None:
    """A header value as text; empty or undecodable is no value at all."""
    if not raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _headers(record: Any) -> dict[str, bytes]:
    return {key: value for key, value in record.headers or () if value is not None}


def cloud_event_key(source: str, event_id: str) -> str:
    """The dedup key of a CloudEvent, the same string on every broker: ``["source","id"]``.

    The RabbitMQ adapter builds it the same way, so an event bridged through both
    brokers has one key, and JSON keeps any pair of strings unambiguous.
    """
    return json.dumps([source, event_id], separators=(",", ":"))


def header_message_id(header: str) -> IdentityFunc:
    """The default dedup key: CloudEvents source + id, else ``header``, else the offset.

    A CloudEvent is identified by its source and id wherever it travels, so they
    come first, as on RabbitMQ. Either survives a producer retry: the retry writes
    a second record at a new offset, so the offset fallback would give the two
    copies two different keys. A header that is present but empty or not UTF-8,
    or half a CloudEvents pair without the header, is no usable id (the pump
    dead-letters it).
    """

    def identity(record: Any) -> str | None:
        headers = _headers(record)
        ce_id, ce_source = headers.get("ce_id"), headers.get("ce_source")
        event_id, source = _text(ce_id), _text(ce_source)
        if event_id and source:
            return cloud_event_key(source, event_id)
        if header in headers:
            return _text(headers[header])
        if ce_id is not None or ce_source is not None:
            return None  # half a CloudEvents pair identifies nothing
        return f"{record.topic}/{record.partition}/{record.offset}"

    return identity


class _Partition:
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
        # Database offsets and counts (worker.brokers.kafka_offsets): the partition's row
        # as this member claimed it; nothing is handed out before the claim.
        self.claimed = True
        self.refetch: int | None = None  # fetched before the claim, dropped: read it again
        self.slot: kafka_offsets.Slot | None = None
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


class _Handle:
    __slots__ = ("attempt", "message_id", "partition", "record")

    def __init__(
        self, partition: _Partition, record: Any, attempt: int, message_id: str | None
    ) -> None:
        self.partition = partition
        self.record = record
        self.attempt = attempt
        self.message_id = message_id


class _Pending:
    """One partition's records in one transaction, and the offset already written for them."""

    __slots__ = ("offsets", "written")

    def __init__(self, offsets: set[int]) -> None:
        self.offsets = offsets
        self.written: int | None = None


class _Store:
    """``Delivery.in_transaction`` of a record when offsets live in the database."""

    __slots__ = ("broker", "handle")

    def __init__(self, broker: KafkaBroker, handle: _Handle) -> None:
        self.broker = broker
        self.handle = handle

    async def __call__(self, session: AsyncSession) -> None:
        await self.broker._store_in(self.handle, session)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, broker: KafkaBroker) -> None:
        self._broker = broker

    async def on_partitions_revoked(self, revoked: Iterable[Any]) -> None:
        await self._broker._revoke(revoked)

    async def on_partitions_assigned(self, assigned: Iterable[Any]) -> None:
        self._broker._assign(assigned)


class KafkaBroker:
    """One consumer-group member: the pump's :class:`~worker.brokers.Broker` and Settler."""

    name = "kafka"

    def __init__(self, settings: Settings, kafka: KafkaSettings) -> None:
        self.settings = settings
        self.kafka = kafka
        self._identity = load_identity(
            settings.message_id_func, header_message_id(kafka.message_id_header)
        )
        self._log = get_logger(broker="kafka", group=kafka.group_id)
        self._consumer: Any = None
        self._producer: Any = None
        self._partitions: dict[Any, _Partition] = {}
        self._ready: deque[_Partition] = deque()
        self._wakeup = asyncio.Event()
        self._attempts: dict[Any, dict[int, int]] = {}  # tp -> offset -> deliveries so far
        self._commit_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._fetch_ok = False
        self._started = False
        self._stopping = False
        # The watchdog: every record handed out and not settled yet, with the time
        # it becomes overdue. An overdue record takes this member out of the group.
        self._out: dict[_Handle, float] = {}
        # A delivery may legitimately take one handler attempt, plus the pump's
        # in-process retries of conflicts; past that and the margin, it is hung.
        limit = getattr(settings, "handler_timeout", 300.0)  # WORKER_HANDLER_TIMEOUT
        retries = float(getattr(settings, "retry_budget", 0.0))  # WORKER_RETRY_BUDGET
        self._overdue_after = (
            None if limit is None else float(limit) + retries + kafka.watchdog_margin
        )
        self._left = False  # out of the group because a record is overdue
        # Offsets and delivery counts in the database (worker.brokers.kafka_offsets).
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
            raise _start_error(kafka, exc) from None
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
                self._log.warning("kafka client did not stop cleanly", error=exc)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # With the broker away, aiokafka's fetcher lets the cancellation of
                # its own retry task escape stop(); it is not ours to propagate.
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
                await asyncio.sleep(_FETCH_WAIT_MS / 1000)
                continue
            self._flow_control()
            try:
                batches = await consumer.getmany(timeout_ms=_FETCH_WAIT_MS)
            except Exception as exc:  # aiokafka retries inside; whatever escapes, back off
                self._fetch_ok = False
                failures += 1
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

    def _offerable(self, partition: _Partition) -> bool:
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

    def _offer(self, partition: _Partition) -> None:
        if self._offerable(partition) and partition not in self._ready:
            self._ready.append(partition)
            self._wakeup.set()

    def _hand_out(self, partition: _Partition) -> Delivery:
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
        headers = {key: value.decode("utf-8", "replace") for key, value in _headers(record).items()}
        try:
            message_id = self._identity(record)
        except Exception as exc:  # a deployment's id function must not stop the pump
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
        handle = _Handle(partition, record, attempt, message_id)
        if self._overdue_after is not None:
            self._out[handle] = time.monotonic() + self._overdue_after
        body = record.value or b""
        if partition.windowed:
            self._offer(partition)  # records of other keys, or the rest of a batch, may go at once
        delivery = Delivery(message_id, message_type, body, headers, attempt, self, handle)
        delivery.group = (record.topic, record.partition)  # batches stay within a partition
        if self._database:
            delivery.in_transaction = _Store(self, handle)
        return delivery

    def _returned(self, partition: _Partition) -> None:
        partition.inflight -= 1
        partition.busy = partition.inflight > 0
        if not partition.busy:
            partition.idle.set()

    def _settled(self, handle: _Handle) -> None:
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

    async def ack(self, handle: _Handle) -> None:
        self._out.pop(handle, None)
        self._require_owned(handle, "ack")
        self._settled(handle)

    async def nack(self, handle: _Handle, delay: float | None, counted: bool = True) -> None:
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

    def _seek_back(self, partition: _Partition, offset: int) -> None:
        partition.rewind = None
        partition.rewind_to = None
        if partition.owned and not self._stopping:
            self._consumer.seek(partition.tp, offset)
            self._consumer.resume(partition.tp)

    async def dead_letter(self, handle: _Handle, reason: str) -> None:
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
        original = [(k, v) for k, v in record.headers or () if not k.startswith(_DLT_PREFIX)]
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

    def _dead_letter_headers(self, handle: _Handle, reason: str) -> list[tuple[str, bytes]]:
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
        handle: _Handle,
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

    async def _dead_letter_failed(self, handle: _Handle, topic: str, exc: Exception) -> None:
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

    def _require_owned(self, handle: _Handle, verb: str) -> None:
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

    async def _commit(self, partitions: Sequence[_Partition]) -> bool:
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
                self._log.warning("offset commit failed", error=exc, partitions=len(offsets))
                return False
            for partition in partitions:
                if partition.tp in offsets:
                    partition.committed = offsets[partition.tp]
            return True

    async def _store_offsets(self, partitions: Sequence[_Partition]) -> None:
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
                self._log.warning(
                    "offset store failed", partition=partition.label, offset=settled, error=exc
                )

    def _chore(self, work: Any, name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _claim(self, partition: _Partition) -> None:
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
        self._log.info(
            "partition claimed",
            partition=partition.label,
            epoch=claim.epoch,
            offset=claim.next_offset,
            started_through=claim.started_through,
        )
        self._flow_control()

    def _reserve(self, partition: _Partition) -> None:
        if partition.reserving or partition.slot is None:
            return
        partition.reserving = True
        through = partition.records[-1].offset + _RESERVE_AHEAD
        self._chore(self._reserving(partition, through), f"kafka-reserve-{partition.label}")

    async def _reserving(self, partition: _Partition, through: int) -> None:
        assert self._engine is not None and partition.slot is not None
        try:
            if await kafka_offsets.reserve(self._engine, partition.slot, through):
                partition.reserved = through
            else:
                self._fenced(partition, "reservation")
        except Exception as exc:
            self._log.warning("offset reservation failed", partition=partition.label, error=exc)
            await asyncio.sleep(1.0)
        finally:
            partition.reserving = False
        self._offer(partition)

    async def _hand_over(self, partitions: Sequence[_Partition]) -> None:
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
                self._log.warning("hand-over not stored", partition=partition.label, error=exc)

    def _fenced(self, partition: _Partition, where: str) -> None:
        """Another member claimed the row: stop here, and rejoin if Kafka says it is ours."""
        if not partition.owned:
            return
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

    async def _store_in(self, handle: _Handle, session: AsyncSession) -> None:
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
        pending: dict[_Partition, _Pending] | None = info.get(_PENDING)
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
        pending: dict[_Partition, _Pending] = session.info.get(_PENDING, {})
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
            partition = self._partitions[tp] = _Partition(
                tp, self._generation(), keyed, span=self.kafka.max_buffered, batch=self._batch
            )
            if self._engine is not None:  # claim the row first; nothing is read before
                partition.claimed = False
                self._consumer.pause(tp)
                self._chore(self._claim(partition), f"kafka-claim-{partition.label}")
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
                self._log.error("kafka watchdog step failed", error=exc, left=self._left)

    async def _leave(self, overdue: list[_Handle]) -> None:
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
        for partition in self._partitions.values():  # assigned while _revoke waited
            self._disown(partition)
        self._partitions.clear()

    def _rejoin(self) -> None:
        self._left = False
        self._consumer.subscribe(self.kafka.topic_list, listener=_Listener(self))
        self._log.info("no record overdue any more, rejoining the consumer group")

    def _disown(self, partition: _Partition) -> None:
        """From here on, settlements of its records raise SettlementLost."""
        partition.owned = False
        partition.drop()
        if partition.rewind is not None:
            partition.rewind.cancel()
            partition.rewind = None
            partition.rewind_to = None


def open_broker(settings: Settings) -> KafkaBroker:
    return KafkaBroker(settings, load_kafka_settings())


# -- operator tools ----------------------------------------------------------------


def _encode_header(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    return (value if isinstance(value, str) else json.dumps(value)).encode()


class KafkaAdmin:
    """``worker publish`` and ``worker dlq`` for Kafka.

    Dead letters count as pending from the offsets committed by the group
    ``<group_id><dead_letter_suffix>`` onward; ``resubmit`` moves them back to
    their original topic and then commits that group past them. A crash between
    the two re-submits them again, under the same message id, so the inbox
    absorbs it.
    """

    def __init__(self, kafka: KafkaSettings, timeout: float = 30.0) -> None:
        self.kafka = kafka
        self.timeout = timeout
        self._producer: Any = None

    async def _producer_started(self) -> Any:
        if self._producer is None:
            self._producer = await start_producer(self.kafka)
        return self._producer

    async def publish(self, messages: list[OutgoingMessage]) -> int:
        """Send to the first topic, keyed by message id (a retry lands on the same partition)."""
        kafka = self.kafka
        topic = kafka.topic_list[0]
        producer = await self._producer_started()
        try:
            pending = []
            for message in messages:
                headers = [(k, _encode_header(v)) for k, v in message.headers.items()]
                headers.append((kafka.type_header, message.type.encode()))
                key = None
                if message.message_id is not None:
                    key = message.message_id.encode()
                    headers.append((kafka.message_id_header, key))
                pending.append(await producer.send(topic, message.body, key=key, headers=headers))
            await asyncio.gather(*pending)
        except KafkaError as exc:
            raise BrokerUnavailable(f"publishing to {topic!r}: {exc}") from None
        return len(messages)

    async def dead_letters(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> list[DeadLetterInfo]:
        """Read the pending dead letters without committing: listing changes nothing."""
        consumer = await self._dead_letter_consumer()
        try:
            records = await self._pending(consumer, scan)
        except KafkaError as exc:
            raise BrokerUnavailable(f"reading dead letters: {exc}") from None
        finally:
            await consumer.stop()
        letters = [self._info(record) for record in records]
        return [letter for letter in letters if match is None or match(letter)][:limit]

    async def resubmit(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> int:
        """Send matching dead letters back to their topic, then commit the group past them.

        The commit point of a partition can only move over a contiguous prefix: a
        dead letter that does not match but lies before a moved one is appended to
        the dead-letter topic again (same partition, key, headers and timestamp)
        before the commit, so it stays pending, now at the end of its partition.
        Every send is acknowledged before the commit; a crash in between re-sends
        under the same message id, and the inbox absorbs it.
        """
        consumer = await self._dead_letter_consumer()
        try:
            records = await self._pending(consumer, scan)
            chosen: set[tuple[str, int, int]] = set()
            for record in records:  # offset order within each partition
                if len(chosen) >= limit:
                    break
                if match is None or match(self._info(record)):
                    chosen.add((record.topic, record.partition, record.offset))
            if not chosen:
                return 0
            last: dict[Any, int] = {}
            for topic, partition, offset in chosen:
                tp = TopicPartition(topic, partition)
                last[tp] = max(last.get(tp, -1), offset)
            producer = await self._producer_started()
            sent = []
            for record in records:
                tp = TopicPartition(record.topic, record.partition)
                if record.offset > last.get(tp, -1):
                    continue  # after the last moved one: left alone
                if (record.topic, record.partition, record.offset) in chosen:
                    sent.append(await self._send_back(producer, record))
                else:
                    sent.append(
                        await producer.send(
                            record.topic,
                            record.value,
                            key=record.key,
                            headers=list(record.headers or ()),
                            partition=record.partition,
                            timestamp_ms=record.timestamp,
                        )
                    )
            await asyncio.gather(*sent)
            await consumer.commit({tp: offset + 1 for tp, offset in last.items()})
        except KafkaError as exc:
            raise BrokerUnavailable(f"re-submitting dead letters: {exc}") from None
        finally:
            await consumer.stop()
        return len(chosen)

    async def _send_back(self, producer: Any, record: Any) -> Any:
        """Produce the dead letter to its original topic without the ``dlt-*`` headers."""
        kafka = self.kafka
        headers = _headers(record)
        suffix = kafka.dead_letter_suffix
        topic = _text(headers.get(DLT_TOPIC)) or record.topic.removesuffix(suffix)
        out = [(k, v) for k, v in record.headers or () if not k.startswith(_DLT_PREFIX)]
        if kafka.message_id_header not in headers and DLT_MESSAGE_ID in headers:
            # The id came from a fallback (CloudEvents, offset): keep it as the header,
            # or the record's new offset would make it a new message.
            out.append((kafka.message_id_header, headers[DLT_MESSAGE_ID]))
        return await producer.send(topic, record.value, key=record.key, headers=out)

    def _info(self, record: Any) -> DeadLetterInfo:
        headers = {k: v.decode("utf-8", "replace") for k, v in _headers(record).items()}
        at = record.timestamp
        return DeadLetterInfo(
            message_id=headers.get(DLT_MESSAGE_ID),
            type=headers.get(self.kafka.type_header) or headers.get("ce_type"),
            reason=headers.get(DLT_REASON, ""),
            body=record.value or b"",
            headers=headers,
            dead_lettered_at=datetime.fromtimestamp(at / 1000, UTC) if at and at > 0 else None,
        )

    async def _dead_letter_consumer(self) -> Any:
        kafka = self.kafka
        consumer = AIOKafkaConsumer(
            group_id=kafka.dead_letter_topic(kafka.group_id),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **kafka.client_options(),
        )
        try:
            await consumer.start()
        except KafkaError as exc:
            await consumer.stop()
            raise BrokerUnavailable(f"kafka at {kafka.bootstrap_servers}: {exc}") from None
        return consumer

    async def _pending(self, consumer: Any, limit: int) -> list[Any]:
        """Dead letters from the group's committed offsets on, in order per partition.

        A partition is read up to the high watermark its fetch responses report,
        bounded by ``limit`` records and ``timeout`` seconds.
        """
        kafka = self.kafka
        await consumer.topics()  # loads the metadata partitions_for_topic reads
        tps = [
            TopicPartition(topic, number)
            for topic in map(kafka.dead_letter_topic, kafka.topic_list)
            for number in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        if not tps or limit <= 0:
            return []
        consumer.assign(tps)
        for tp in tps:
            committed = await consumer.committed(tp)
            if committed is None:
                await consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, committed)
        remaining, records = set(tps), list[Any]()
        deadline = time.monotonic() + self.timeout
        while remaining and len(records) < limit and time.monotonic() < deadline:
            batches = await consumer.getmany(
                *remaining, timeout_ms=_FETCH_WAIT_MS, max_records=limit - len(records)
            )
            for batch in batches.values():
                records.extend(batch)
            for tp in list(remaining):
                highwater = consumer.highwater(tp)
                if highwater is not None and await consumer.position(tp) >= highwater:
                    remaining.discard(tp)
        return records

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None


def open_admin(settings: Settings) -> KafkaAdmin:
    return KafkaAdmin(load_kafka_settings())
