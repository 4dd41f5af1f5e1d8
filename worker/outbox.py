"""The transactional outbox: handlers publish by writing rows; a relay sends them.

``await ctx.publish(type, body)`` adds a row to ``outbox`` in the pump's own
session, so the event commits with the inbox marker and the business writes, or
rolls back with them. Nothing is sent from inside the handler.

The :class:`Relay` (a task in every ``worker run``, or ``worker relay`` on its
own) moves committed rows to the broker, at least once (every move of a message is at-least-once)::

    claim a batch (a lease: lease_until, claimed_by; SKIP LOCKED on PostgreSQL), commit
    publish, waiting for the broker's confirmation
    mark the confirmed rows sent (or delete them); count a refusal against its row

A relay that dies after the broker confirmed and before the mark leaves its rows
leased; once the lease runs out another relay (or the same one, restarted) sends
them again, under the same message id. That duplicate is the price of never
losing an event; a downstream inbox absorbs it, because the id is derived from
(incoming message id, consumer, sequence number within the handler) and is the
same on every re-run of the handler.

A broker that cannot be reached spends no attempt (the rows are released and the
relay backs off); a broker that refuses a row (unroutable, no such exchange, too
large) counts an attempt, and after ``WORKER_OUTBOX_MAX_ATTEMPTS`` the row is
parked: kept, listed by ``worker outbox``, retried by ``worker outbox --retry``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import Counter, Gauge
from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import (
    BigInteger,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    any_,
    delete,
    event,
    exists,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from worker.brokers.publishers import Outgoing, Publisher, encode_headers
from worker.db import Base, classify, insert_ignoring_conflicts
from worker.errors import BrokerUnavailable
from worker.logs import get_logger
from worker.retry import backoff

if TYPE_CHECKING:
    from worker.context import Context
    from worker.settings import Settings

PENDING, SENT, PARKED = "pending", "sent", "parked"
OUTBOX_CONSTRAINT = "uq_outbox_message_id"
OUTBOX_PURGE_LOCK = 0x776F726B_6F757462  # "workoutb": one replica purges sent rows at a time
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:idempotent-worker:outbox")
"""The uuid5 namespace of outgoing ids: change it and every re-run gets new ids."""


class OutboxSettings(BaseSettings):
    """``WORKER_OUTBOX_*``: the relay and the defaults of ``ctx.publish``."""

    model_config = SettingsConfigDict(env_prefix="WORKER_OUTBOX_", extra="ignore")

    relay: bool = Field(True, description="Run the relay inside `worker run`.")
    destination: str | None = Field(
        None, description="Default destination; unset: the message type (see publishers)."
    )
    destinations: dict[str, str] = Field(
        {}, description='JSON {"MessageType": "destination"}: per-type defaults.'
    )
    source: str = Field("urn:worker", description="CloudEvents source of published events.")
    max_attempts: int = Field(10, ge=1, le=1000, description="Refusals before a row is parked.")
    batch: int = Field(100, ge=1, le=5000, description="Rows claimed and published at once.")
    lease: float = Field(30.0, gt=0, description="Seconds a claimed batch is held.")
    publish_timeout: float = Field(10.0, gt=0, description="Bound on one batch's confirms.")
    poll_interval: float = Field(1.0, gt=0, description="Seconds between polls when idle.")
    linger: float = Field(
        0.02, ge=0, description="Seconds a woken relay waits for more commits to batch."
    )
    retry_backoff: float = Field(1.0, ge=0, description="First delay after a refusal, seconds.")
    retry_backoff_max: float = Field(60.0, ge=0, description="Cap of that delay, seconds.")
    ordered: bool = Field(False, description="Rows with the same key go out in id order.")
    delete_sent: bool = Field(False, description="Delete confirmed rows instead of marking.")
    retention: timedelta = Field(timedelta(days=7), description="How long sent rows are kept.")
    purge_interval: float = Field(600.0, ge=0, description="Seconds between purges; 0: off.")
    purge_batch: int = Field(1000, ge=1, le=50_000, description="Sent rows deleted per statement.")
    purge_max_batches: int = Field(100, ge=1, description="Statements per purge run.")
    metrics_interval: float = Field(5.0, gt=0, description="Seconds between backlog gauges.")

    @field_validator("publish_timeout")
    @classmethod
    def _inside_lease(cls, value: float, info: ValidationInfo) -> float:
        lease = info.data.get("lease")
        if lease is not None and value >= lease:
            raise ValueError(
                f"must be shorter than WORKER_OUTBOX_LEASE ({lease}s): a batch still being "
                "published when its lease ends is sent by two relays at once"
            )
        return value

    def destination_for(self, message_type: str) -> str | None:
        return self.destinations.get(message_type, self.destination)


class OutboxMessage(Base):
    """One event a handler published; the relay sends it after the handler's commit.

    The bigint key orders rows as they were inserted (per-key ordering uses it);
    the outgoing id is unique, so a handler that runs again without the inbox
    (``inbox=False``) adds nothing the second time.
    """

    __tablename__ = "outbox"
    __table_args__ = (
        UniqueConstraint("message_id", name=OUTBOX_CONSTRAINT),
        Index("ix_outbox_state_id", "state", "id"),
        Index("ix_outbox_key_id", "key", "id"),
        Index("ix_outbox_sent_at", "sent_at"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), Identity(), primary_key=True
    )
    message_id: Mapped[str] = mapped_column(String(64))
    message_type: Mapped[str] = mapped_column(String(255))
    body: Mapped[bytes] = mapped_column(LargeBinary)
    headers: Mapped[str] = mapped_column(Text, server_default="{}")
    key: Mapped[str | None] = mapped_column(String(255))
    destination: Mapped[str | None] = mapped_column(String(512))
    source_message_id: Mapped[str] = mapped_column(String(255))
    consumer: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16), server_default=PENDING)
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    available_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    claimed_by: Mapped[str | None] = mapped_column(String(128))
    sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)


_outbox = cast(Table, OutboxMessage.__table__)
_c = _outbox.c

# -- metrics (prometheus-client's default registry; served by /metrics) ------------

PENDING_ROWS = Gauge("worker_outbox_pending", "Outbox rows not yet confirmed by the broker.")
OLDEST_PENDING = Gauge(
    "worker_outbox_oldest_pending_seconds", "Age of the oldest unsent outbox row (0: none)."
)
PARKED_ROWS = Gauge("worker_outbox_parked", "Outbox rows parked after too many refusals.")
PUBLISHED = Counter("worker_outbox_published", "Outbox rows the broker confirmed.")
FAILED = Counter(
    "worker_outbox_failed",
    "Outbox publishes that failed, by reason (refused: counted, unavailable: not).",
    ["reason"],
)

# -- the handler-facing API ----------------------------------------------------------


def outgoing_id(incoming_id: str, consumer: str, sequence: int) -> str:
    """The id of the ``sequence``-th message a handler publishes for ``incoming_id``."""
    return str(uuid.uuid5(NAMESPACE, f"{incoming_id}\0{consumer}\0{sequence}"))


_settings: OutboxSettings | None = None


def settings() -> OutboxSettings:
    """``WORKER_OUTBOX_*``, read once per process (``configure`` replaces it)."""
    global _settings
    if _settings is None:
        from worker.settings import load

        _settings = load(OutboxSettings)
    return _settings


def configure(outbox: OutboxSettings | None) -> None:
    """Use ``outbox`` for publishing defaults from now on (None: read the environment again)."""
    global _settings
    _settings = outbox


def _encode_body(body: BaseModel | Mapping[str, Any] | bytes | str) -> bytes:
    if isinstance(body, BaseModel):
        return body.model_dump_json().encode()
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return json.dumps(body, separators=(",", ":"), default=str).encode()


def _trace_headers(incoming: Mapping[str, Any] | None) -> dict[str, str]:
    """The W3C trace context: the consuming span's when tracing is on, else the incoming one."""
    carrier: dict[str, str] = {}
    try:
        from opentelemetry import propagate

        propagate.inject(carrier)
    except Exception:  # no usable OpenTelemetry: fall back to what came in
        carrier = {}
    if "traceparent" not in carrier and incoming:
        for name in ("traceparent", "tracestate"):
            value = incoming.get(name)
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            if isinstance(value, str) and value:
                carrier[name] = value
    return {k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")}


async def add(
    ctx: Context,
    sequence: int,
    message_type: str,
    body: BaseModel | Mapping[str, Any] | bytes | str,
    *,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    destination: str | None = None,
) -> str:
    """Add the outbox row for :meth:`Context.publish`; returns the outgoing id."""
    outbox = settings()
    message_id = outgoing_id(ctx.message_id, ctx.consumer, sequence)
    all_headers: dict[str, Any] = dict(headers or {})
    all_headers.update(_trace_headers(ctx.headers))
    all_headers.update(
        {
            "ce-specversion": "1.0",
            "ce-id": message_id,
            "ce-type": message_type,
            "ce-source": outbox.source,
        }
    )
    session = ctx.session
    row = {
        "message_id": message_id,
        "message_type": message_type,
        "body": _encode_body(body),
        "headers": json.dumps(encode_headers(all_headers), separators=(",", ":")),
        "key": key,
        "destination": destination or outbox.destination_for(message_type),
        "source_message_id": ctx.message_id,
        "consumer": ctx.consumer,
    }
    # A handler without the inbox may run again after committing: its ids are the same,
    # and the event already went out (or will), so a second row would be a second event.
    await session.execute(insert_ignoring_conflicts(session, OutboxMessage).values(row))
    _wake_after_commit(session)
    return message_id


# -- in-process wake-up --------------------------------------------------------------

_wakers: set[asyncio.Event] = set()


def wake() -> None:
    """Tell this process's relays that rows were committed."""
    for waker in _wakers:
        waker.set()


def _after_commit(_session: Any) -> None:
    wake()


def _wake_after_commit(session: AsyncSession) -> None:
    sync = session.sync_session
    if not sync.info.get("outbox_wake"):
        sync.info["outbox_wake"] = True
        event.listen(sync, "after_commit", _after_commit, once=True)


# -- the relay -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claimed:
    id: int
    message: Outgoing
    attempts: int


@dataclass(frozen=True, slots=True)
class BatchResult:
    claimed: int
    sent: int
    refused: int
    parked: int
    unavailable: bool = False


def _now() -> datetime:
    return datetime.now(UTC)


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


_COLUMNS = (
    _c.id,
    _c.message_id,
    _c.message_type,
    _c.body,
    _c.headers,
    _c.key,
    _c.destination,
    _c.attempts,
)


class Relay:
    """Move committed outbox rows to the broker until :meth:`stop`."""

    def __init__(
        self,
        engine: AsyncEngine,
        publisher: Publisher,
        outbox: OutboxSettings | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.engine = engine
        self.publisher = publisher
        self.outbox = outbox or settings()
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.postgres = engine.dialect.name == "postgresql"
        self.stats: dict[str, int] = {"published": 0, "refused": 0, "parked": 0}
        self._log = get_logger(component="outbox-relay", relay=self.name)
        self.task: asyncio.Task[None] | None = None  # set by :func:`start`
        self.running = False
        self._wakeup = asyncio.Event()
        self._stop = asyncio.Event()

    @property
    def ready(self) -> bool:
        """Running and not stopping: the readiness of a dedicated ``worker relay``."""
        return self.running and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()

    # -- one batch -------------------------------------------------------------------

    def _claimable(self, now: datetime) -> Any:
        query = select(_c.id).where(
            _c.state == PENDING,
            _c.available_at <= now,
            or_(_c.lease_until.is_(None), _c.lease_until < now),
        )
        if self.outbox.ordered:
            # Only the oldest unsent row of a key may go: the next waits for its confirm.
            earlier = _outbox.alias("earlier")
            query = query.where(
                or_(
                    _c.key.is_(None),
                    ~exists().where(
                        earlier.c.key == _c.key, earlier.c.id < _c.id, earlier.c.state != SENT
                    ),
                )
            )
        return query.order_by(_c.id).limit(self.outbox.batch)

    async def claim(self) -> list[Claimed]:
        """Lease up to ``batch`` rows to this relay, committed before anything is sent."""
        now = _now()
        lease = {"lease_until": now + timedelta(seconds=self.outbox.lease), "claimed_by": self.name}
        if self.postgres:
            # SKIP LOCKED: a row another relay is claiming right now is not waited for.
            ids = self._claimable(now).with_for_update(skip_locked=True, of=_outbox)
            statement = update(_outbox).where(_c.id == any_(func.array(ids.scalar_subquery())))
        else:
            # SQLite: a read of its own first (an idle relay takes no write lock, and a
            # write transaction that began with a read fails when another writer got in
            # between), then a conditional claim: SQLite runs one writer at a time, and
            # the lease condition rechecks what the read saw, so no two relays lease a row.
            async with self.engine.connect() as connection:
                candidates = list((await connection.execute(self._claimable(now))).scalars())
            if not candidates:
                return []
            statement = update(_outbox).where(
                _c.id.in_(candidates),
                _c.state == PENDING,
                or_(_c.lease_until.is_(None), _c.lease_until < now),
            )
        async with self.engine.begin() as connection:
            rows = (await connection.execute(statement.values(**lease).returning(*_COLUMNS))).all()
        claimed = [
            Claimed(
                row.id,
                Outgoing(
                    row.message_id,
                    row.message_type,
                    row.body,
                    json.loads(row.headers or "{}"),
                    row.key,
                    row.destination,
                ),
                row.attempts,
            )
            for row in rows
        ]
        claimed.sort(key=lambda c: c.id)
        return claimed

    async def run_once(self) -> BatchResult:
        """Claim, publish and settle one batch; ``claimed == 0``: nothing was due."""
        started = time.perf_counter()  # the lease runs from the claim
        batch = await self.claim()
        if not batch:
            return BatchResult(0, 0, 0, 0)
        try:
            results = await self.publisher.publish([c.message for c in batch])
        except BrokerUnavailable as exc:
            FAILED.labels("unavailable").inc(len(batch))
            self._log.warning("outbox broker unavailable", rows=len(batch), error=str(exc))
            await self._release(batch)
            return BatchResult(len(batch), 0, 0, 0, unavailable=True)
        sent = [c.id for c, result in zip(batch, results, strict=True) if result is None]
        refused = [(c, r) for c, r in zip(batch, results, strict=True) if r is not None]
        took = time.perf_counter() - started
        if took > self.outbox.lease:  # another relay may have taken the rows over meanwhile
            self._log.warning(
                "outbox batch outlived its lease: its rows may go out twice",
                rows=len(batch),
                seconds=round(took, 2),
                lease=self.outbox.lease,
            )
        await self.mark_sent(sent)
        parked = await self._refused(refused) if refused else 0
        PUBLISHED.inc(len(sent))
        self.stats["published"] += len(sent)
        self.stats["refused"] += len(refused)
        self.stats["parked"] += parked
        self._log.debug("outbox batch", sent=len(sent), refused=len(refused), s=took)
        return BatchResult(len(batch), len(sent), len(refused), parked)

    async def mark_sent(self, ids: Sequence[int]) -> None:
        """The broker confirmed these: mark them sent (or delete them), in one statement."""
        if not ids:
            return
        if self.outbox.delete_sent:
            statement: Any = delete(_outbox).where(_c.id.in_(ids))
        else:
            statement = (
                update(_outbox)
                .where(_c.id.in_(ids))
                .values(state=SENT, sent_at=_now(), lease_until=None, last_error=None)
            )
        async with self.engine.begin() as connection:
            await connection.execute(statement)

    async def _release(self, batch: Sequence[Claimed]) -> None:
        """Give rows back without spending an attempt: the broker, not the row, failed."""
        async with self.engine.begin() as connection:
            await connection.execute(
                update(_outbox)
                .where(_c.id.in_([c.id for c in batch]), _c.claimed_by == self.name)
                .values(lease_until=None)
            )

    async def _refused(self, refused: Sequence[tuple[Claimed, str]]) -> int:
        outbox = self.outbox
        now = _now()
        parked = 0
        async with self.engine.begin() as connection:
            for claimed, reason in refused:
                attempts = claimed.attempts + 1
                park = attempts >= outbox.max_attempts
                parked += park
                delay = backoff(attempts, outbox.retry_backoff, outbox.retry_backoff_max)
                await connection.execute(
                    update(_outbox)
                    .where(_c.id == claimed.id, _c.claimed_by == self.name)
                    .values(
                        attempts=attempts,
                        state=PARKED if park else PENDING,
                        available_at=now + timedelta(seconds=delay),
                        lease_until=None,
                        last_error=reason[:2000],
                    )
                )
                log = self._log.error if park else self._log.warning
                log(
                    "outbox row parked" if park else "outbox publish refused",
                    message_id=claimed.message.message_id,
                    type=claimed.message.type,
                    attempts=attempts,
                    reason=reason,
                    outcome="parked" if park else "refused",
                )
        FAILED.labels("refused").inc(len(refused))
        return parked

    # -- the loop --------------------------------------------------------------------

    async def drain(self, *, max_batches: int = 10_000) -> int:
        """Publish until nothing is due (or ``max_batches``); returns the rows sent."""
        sent = 0
        for _ in range(max_batches):
            result = await self.run_once()
            sent += result.sent
            if result.claimed == 0 or result.unavailable:
                break
        return sent

    async def run(self) -> None:
        """Batches while there is work; otherwise wait for a commit's wake-up or the poll."""
        outbox = self.outbox
        _wakers.add(self._wakeup)
        failures = unavailable = 0
        next_gauges = next_purge = time.monotonic()
        if outbox.purge_interval > 0:
            next_purge += outbox.purge_interval
        self._log.info("outbox relay started", ordered=outbox.ordered, batch=outbox.batch)
        self.running = True
        try:
            while not self._stop.is_set():
                self._wakeup.clear()
                delay = outbox.poll_interval
                try:
                    result = await self.run_once()
                    failures = 0
                    if result.unavailable:  # the broker: wait longer, a commit won't fix it
                        unavailable += 1
                        delay = max(delay, backoff(unavailable, 0.5, outbox.retry_backoff_max))
                    elif result.claimed == outbox.batch:
                        unavailable = 0
                        delay = 0.0  # a full batch: more is likely due
                    else:
                        unavailable = 0
                    if time.monotonic() >= next_gauges:
                        next_gauges = time.monotonic() + outbox.metrics_interval
                        await self.update_gauges()
                    if outbox.purge_interval > 0 and time.monotonic() >= next_purge:
                        next_purge = time.monotonic() + outbox.purge_interval
                        await purge(self.engine, outbox, log=self._log)
                except Exception as exc:  # the database: back off, never die of it
                    failures += 1
                    delay = backoff(failures, 0.5, 30.0)
                    self._log.warning("outbox relay failed", error=exc, failure=classify(exc).value)
                if self._stop.is_set() or delay <= 0:
                    continue
                # After a failure a commit's wake-up must not cut the backoff short; stop may.
                waiting = self._stop if failures or unavailable else self._wakeup
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiting.wait(), delay)
                if self._wakeup.is_set() and not self._stop.is_set() and outbox.linger > 0:
                    # Woken by a commit: let the commits right behind it join the batch,
                    # or a busy pump would pay two relay transactions per message.
                    await asyncio.sleep(outbox.linger)
        finally:
            self.running = False
            _wakers.discard(self._wakeup)
            self._log.info("outbox relay stopped", **self.stats)

    async def update_gauges(self) -> Backlog:
        backlog = await backlog_of(self.engine)
        PENDING_ROWS.set(backlog.pending)
        PARKED_ROWS.set(backlog.parked)
        OLDEST_PENDING.set(backlog.oldest_pending_seconds)
        return backlog


@dataclass(frozen=True, slots=True)
class Backlog:
    pending: int
    parked: int
    oldest_pending_seconds: float


async def backlog_of(engine: AsyncEngine) -> Backlog:
    async with engine.connect() as connection:
        rows = (
            await connection.execute(
                select(_c.state, func.count(), func.min(_c.created_at))
                .where(_c.state != SENT)
                .group_by(_c.state)
            )
        ).all()
    counts = {row[0]: row[1] for row in rows}
    oldest = next((row[2] for row in rows if row[0] == PENDING), None)
    age = (_now() - _aware(oldest)).total_seconds() if oldest is not None else 0.0
    return Backlog(counts.get(PENDING, 0), counts.get(PARKED, 0), max(age, 0.0))


# -- retention -----------------------------------------------------------------------


async def purge(
    engine: AsyncEngine, outbox: OutboxSettings, *, now: datetime | None = None, log: Any = None
) -> int | None:
    """Delete sent rows older than the retention in bounded batches; None: another purges."""
    from worker.retention import exclusive

    cutoff = (now or _now()) - outbox.retention
    oldest = (
        select(_c.id)
        .where(_c.state == SENT, _c.sent_at < cutoff)
        .order_by(_c.sent_at)
        .limit(outbox.purge_batch)
    )
    deleted = 0
    async with exclusive(engine, OUTBOX_PURGE_LOCK) as connection:
        if connection is None:
            return None
        if connection.dialect.name == "postgresql":
            statement = delete(_outbox).where(_c.id == any_(func.array(oldest.scalar_subquery())))
        else:
            statement = delete(_outbox).where(_c.id.in_(oldest.scalar_subquery()))
        for _ in range(outbox.purge_max_batches):
            result = await connection.execute(statement)
            await connection.commit()
            deleted += result.rowcount
            if result.rowcount < outbox.purge_batch:
                break
            await asyncio.sleep(0.01)
    if log is not None and deleted:
        log.info("outbox purged", deleted=deleted, cutoff=cutoff.isoformat())
    return deleted


# -- operator tools ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowInfo:
    id: int
    message_id: str
    type: str
    state: str
    attempts: int
    destination: str | None
    key: str | None
    created_at: datetime
    last_error: str | None
    source_message_id: str
    consumer: str

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": self.type,
            "state": self.state,
            "attempts": self.attempts,
            "destination": self.destination,
            "key": self.key,
            "created_at": _aware(self.created_at).isoformat(),
            "error": self.last_error,
            "source_message_id": self.source_message_id,
            "consumer": self.consumer,
        }


async def rows(engine: AsyncEngine, *, states: Sequence[str], limit: int) -> list[RowInfo]:
    """Unsent rows (``pending``, ``parked``), oldest first."""
    query = (
        select(
            _c.id,
            _c.message_id,
            _c.message_type,
            _c.state,
            _c.attempts,
            _c.destination,
            _c.key,
            _c.created_at,
            _c.last_error,
            _c.source_message_id,
            _c.consumer,
        )
        .where(_c.state.in_(states))
        .order_by(_c.id)
        .limit(limit)
    )
    async with engine.connect() as connection:
        return [RowInfo(*row) for row in (await connection.execute(query)).all()]


async def retry_parked(engine: AsyncEngine, *, limit: int, batch: int = 500) -> int:
    """Parked rows back to pending with a fresh attempt count, in bounded batches."""
    moved = 0
    async with engine.connect() as connection:
        while moved < limit:
            ids = list(
                (
                    await connection.execute(
                        select(_c.id)
                        .where(_c.state == PARKED)
                        .order_by(_c.id)
                        .limit(min(batch, limit - moved))
                    )
                ).scalars()
            )
            if not ids:
                break
            result = await connection.execute(
                update(_outbox)
                .where(and_(_c.id.in_(ids), _c.state == PARKED))
                .values(state=PENDING, attempts=0, available_at=_now(), lease_until=None)
            )
            await connection.commit()
            moved += result.rowcount
    return moved


async def outbox_command(settings_: Settings, *, retry: bool, limit: int) -> int:
    """``worker outbox``: list pending and parked rows; ``--retry``: re-queue the parked ones."""
    import sys

    from worker.db import create_engine

    engine = create_engine(settings_.database_url, pool_size=1)
    try:
        if retry:
            moved = await retry_parked(engine, limit=limit)
            print(f"re-queued {moved} parked outbox rows", file=sys.stderr)
            return 0
        backlog = await backlog_of(engine)
        for row in await rows(engine, states=(PENDING, PARKED), limit=limit):
            print(json.dumps(row.as_json()))
        print(
            f"{backlog.pending} pending (oldest {backlog.oldest_pending_seconds:.1f}s), "
            f"{backlog.parked} parked",
            file=sys.stderr,
        )
    finally:
        await engine.dispose()
    return 0


async def relay_command(settings_: Settings, *, once: bool = False) -> int:
    """``worker relay``: a dedicated relay until SIGTERM/SIGINT (``--once``: drain, then exit)."""
    import signal
    import sys

    from worker.brokers.publishers import open_publisher
    from worker.db import create_engine
    from worker.ops import start_ops

    outbox = settings()
    engine = create_engine(settings_.database_url, pool_size=2)
    publisher = open_publisher(settings_, timeout=outbox.publish_timeout)
    relay = Relay(engine, publisher, outbox)
    try:
        if once:
            sent = await relay.drain()
            print(f"published {sent} outbox rows", file=sys.stderr)
            return 0
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, relay.stop)
        ops = await start_ops(settings_, relay)  # /metrics shows the backlog gauges
        try:
            await relay.run()
        finally:
            if ops is not None:
                await ops.stop()
    finally:
        await publisher.close()
        await engine.dispose()
    return 0


def start(settings_: Settings, engine: AsyncEngine, broker: Any) -> Relay | None:
    """The relay inside ``worker run`` (unless ``WORKER_OUTBOX_RELAY=false``), started as a task.

    It runs next to the pump, never in its way: readiness is the pump's alone, so a
    broker that refuses publishes shows as a backlog, not as a pod taken out of service.
    """
    from worker.brokers.publishers import open_publisher

    outbox = settings()
    if not outbox.relay:
        return None
    relay = Relay(engine, open_publisher(settings_, broker, timeout=outbox.publish_timeout), outbox)
    relay.task = asyncio.create_task(relay.run(), name="outbox-relay")
    return relay


async def stop(relay: Relay | None) -> None:
    if relay is None:
        return
    relay.stop()
    try:
        if relay.task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(relay.task, relay.outbox.publish_timeout + 5)
    finally:
        await relay.publisher.close()


__all__ = [
    "OUTBOX_CONSTRAINT",
    "PARKED",
    "PENDING",
    "SENT",
    "OutboxMessage",
    "OutboxSettings",
    "Relay",
    "add",
    "outgoing_id",
]
