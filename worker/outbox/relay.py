"""The relay: committed outbox rows to the broker, at least once.

A :class:`Relay` runs as a task in every ``worker run`` (:func:`start`, :func:`stop`)
or on its own in ``worker relay``. One round::

    claim a batch (a lease: lease_until, claimed_by; SKIP LOCKED on PostgreSQL), commit
    publish, one call per destination, each waiting for the broker's confirmation
    mark the confirmed rows sent (or delete them); count a failure against its own row

A relay that dies after the broker confirmed and before the mark leaves its rows
leased; once the lease runs out another relay (or the same one, restarted) sends
them again, under the same message id. That duplicate is the price of never
losing an event; a downstream inbox absorbs it, because the id is derived from
(incoming message id, consumer, sequence number within the handler) and is the
same on every re-run of the handler.

Each row is decided on its own result. A row the broker refuses (unroutable, no
such exchange or topic, too large) counts an attempt. So does a row whose
destination gave no answer in time while the broker confirmed another destination
of the same round: the broker is serving, that destination is not. When nothing
of the round was confirmed and some destination could not be reached, the broker
may be away: those rows are released without spending an attempt and the relay backs
off. After ``WORKER_OUTBOX_MAX_ATTEMPTS`` a row is parked: kept, listed by ``worker
outbox``, retried by ``worker outbox --retry``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge
from sqlalchemy import any_, delete, exists, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.brokers.publishers import Outgoing, Publisher, open_publisher
from worker.db import classify
from worker.errors import BrokerUnavailable
from worker.logs import get_logger, scrub
from worker.outbox.model import (
    PARKED,
    PENDING,
    SENT,
    Backlog,
    OutboxSettings,
    backlog_of,
    now,
    settings,
    table,
)
from worker.outbox.publish import waking
from worker.retention import exclusive
from worker.retry import backoff

if TYPE_CHECKING:
    from worker.settings import Settings

OUTBOX_PURGE_LOCK = 0x776F726B_6F757462  # "workoutb": one replica purges sent rows at a time
_c = table.c

# -- metrics (prometheus-client's default registry; served by /metrics) ------------

PENDING_ROWS = Gauge("worker_outbox_pending", "Outbox rows not yet confirmed by the broker.")
OLDEST_PENDING = Gauge(
    "worker_outbox_oldest_pending_seconds", "Age of the oldest unsent outbox row (0: none)."
)
PARKED_ROWS = Gauge("worker_outbox_parked", "Outbox rows parked after too many refusals.")
PUBLISHED = Counter("worker_outbox_published", "Outbox rows the broker confirmed.")
FAILED = Counter(
    "worker_outbox_failed",
    "Outbox publishes that failed, by reason (refused and unserved: counted against the "
    "row; unavailable: not).",
    ["reason"],
)


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
    """Some rows were released uncounted: the broker confirmed nothing of this round."""
    unserved: int = 0
    """Rows whose destination did not answer while another destination did (counted)."""
    deferred: int = 0
    """Rows not tried: their call could not have ended inside the lease (released)."""


@dataclass(slots=True)
class _Round:
    """One round's rows, sorted by what the broker did with them."""

    sent: list[Claimed]
    refused: list[tuple[Claimed, str]]
    unreachable: list[tuple[Claimed, BrokerUnavailable]]
    deferred: list[Claimed]


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


def destination_of(message: Outgoing) -> str:
    """Where a row goes, as the publishers read it: its destination, else its type."""
    return message.destination if message.destination is not None else message.type


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
        self.stats: dict[str, int] = {"published": 0, "refused": 0, "unserved": 0, "parked": 0}
        self._log = get_logger(component="outbox-relay", relay=self.name)
        self.task: asyncio.Task[None] | None = None  # set by :func:`start`
        self.running = False
        self._wakeup = asyncio.Event()
        self._stop = asyncio.Event()
        self._unanswered: set[str] = set()  # destinations whose last call got no answer

    @property
    def ready(self) -> bool:
        """Running and not stopping: the readiness of a dedicated ``worker relay``."""
        return self.running and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()

    # -- one batch -------------------------------------------------------------------

    def _claimable(self, at: datetime) -> Any:
        query = select(_c.id).where(
            _c.state == PENDING,
            _c.available_at <= at,
            or_(_c.lease_until.is_(None), _c.lease_until < at),
        )
        if self.outbox.ordered:
            # Only the oldest unsent row of a key may go: the next waits for its confirm.
            earlier = table.alias("earlier")
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
        at = now()
        lease = {"lease_until": at + timedelta(seconds=self.outbox.lease), "claimed_by": self.name}
        if self.postgres:
            # SKIP LOCKED: a row another relay is claiming right now is not waited for.
            ids = self._claimable(at).with_for_update(skip_locked=True, of=table)
            statement = update(table).where(_c.id == any_(func.array(ids.scalar_subquery())))
        else:
            # SQLite: a read of its own first (an idle relay takes no write lock, and a
            # write transaction that began with a read fails when another writer got in
            # between), then a conditional claim: SQLite runs one writer at a time, and
            # the lease condition rechecks what the read saw, so no two relays lease a row.
            async with self.engine.connect() as connection:
                candidates = list((await connection.execute(self._claimable(at))).scalars())
            if not candidates:
                return []
            statement = update(table).where(
                _c.id.in_(candidates),
                _c.state == PENDING,
                or_(_c.lease_until.is_(None), _c.lease_until < at),
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

    async def _publish(self, batch: Sequence[Claimed], started: float) -> _Round:
        """One publish call per destination, one call at a time (a publisher connects on
        its first call and promises nothing about calls that overlap).

        A destination that hangs or fails takes only its own rows with it, and the
        others' confirmations still count. A destination whose last call got no answer
        goes last, so it cannot keep the others from being tried. A call that could no
        longer end inside the lease is not started, nor one after :meth:`stop`: its rows
        are released for the next round.
        """
        groups: dict[str, list[Claimed]] = {}
        for claimed in batch:
            groups.setdefault(destination_of(claimed.message), []).append(claimed)
        order = sorted(groups, key=lambda destination: destination in self._unanswered)
        done = _Round([], [], [], [])
        for tried, destination in enumerate(order):
            rows = groups[destination]
            elapsed = time.perf_counter() - started
            too_late = elapsed + self.outbox.publish_timeout >= self.outbox.lease
            if tried and (too_late or self._stop.is_set()):  # stopping: within its grace
                done.deferred.extend(rows)
                continue
            try:
                results = await self.publisher.publish([c.message for c in rows])
            except BrokerUnavailable as exc:
                self._unanswered.add(destination)
                done.unreachable.extend((c, exc) for c in rows)
                continue
            self._unanswered.discard(destination)
            for claimed, refusal in zip(rows, results, strict=True):
                if refusal is None:
                    done.sent.append(claimed)
                else:
                    done.refused.append((claimed, refusal))
        return done

    async def run_once(self) -> BatchResult:
        """Claim, publish and settle one batch; ``claimed == 0``: nothing was due."""
        started = time.perf_counter()  # the lease runs from the claim
        batch = await self.claim()
        if not batch:
            return BatchResult(0, 0, 0, 0)
        done = await self._publish(batch, started)
        took = time.perf_counter() - started
        if took > self.outbox.lease:  # another relay may have taken the rows over meanwhile
            self._log.warning(
                "outbox batch outlived its lease: its rows may go out twice",
                rows=len(batch),
                seconds=round(took, 2),
                lease=self.outbox.lease,
            )
        await self.mark_sent([c.id for c in done.sent])
        refused = list(done.refused)
        unserved: list[tuple[Claimed, str]] = []
        released = list(done.deferred)
        if done.unreachable and done.sent:
            # The broker confirmed other rows of this round: it is serving, this row's
            # destination is not (a topic it won't serve, an entity that hangs).
            unserved = [
                (c, f"destination {destination_of(c.message)!r}: {exc}")
                for c, exc in done.unreachable
            ]
        elif done.unreachable:  # nothing confirmed: the broker may be away, nobody's attempt
            released += [c for c, _ in done.unreachable]
            FAILED.labels("unavailable").inc(len(done.unreachable))
            self._log.warning(
                "outbox broker unavailable",
                rows=len(done.unreachable),
                error=str(done.unreachable[0][1]),
            )
        if released:
            await self._release(released)
        failed = refused + unserved
        parked = await self._count_failures(failed) if failed else 0
        FAILED.labels("refused").inc(len(refused))
        FAILED.labels("unserved").inc(len(unserved))
        PUBLISHED.inc(len(done.sent))
        self.stats["published"] += len(done.sent)
        self.stats["refused"] += len(refused)
        self.stats["unserved"] += len(unserved)
        self.stats["parked"] += parked
        self._log.debug(
            "outbox batch",
            sent=len(done.sent),
            refused=len(refused),
            unserved=len(unserved),
            released=len(released),
            s=took,
        )
        return BatchResult(
            len(batch),
            len(done.sent),
            len(refused),
            parked,
            unavailable=bool(done.unreachable) and not done.sent,
            unserved=len(unserved),
            deferred=len(done.deferred),
        )

    async def mark_sent(self, ids: Sequence[int]) -> None:
        """The broker confirmed these: mark them sent (or delete them), in one statement."""
        if not ids:
            return
        if self.outbox.delete_sent:
            statement: Any = delete(table).where(_c.id.in_(ids))
        else:
            statement = (
                update(table)
                .where(_c.id.in_(ids))
                .values(state=SENT, sent_at=now(), lease_until=None, last_error=None)
            )
        async with self.engine.begin() as connection:
            await connection.execute(statement)

    async def _release(self, batch: Sequence[Claimed]) -> None:
        """Give rows back without spending an attempt: the broker, not the row, failed."""
        async with self.engine.begin() as connection:
            await connection.execute(
                update(table)
                .where(_c.id.in_([c.id for c in batch]), _c.claimed_by == self.name)
                .values(lease_until=None)
            )

    async def _count_failures(self, failed: Sequence[tuple[Claimed, str]]) -> int:
        """One attempt each, a jittered wait before the next, parked at the limit."""
        outbox = self.outbox
        at = now()
        parked = 0
        async with self.engine.begin() as connection:
            for claimed, reason in failed:
                attempts = claimed.attempts + 1
                park = attempts >= outbox.max_attempts
                parked += park
                delay = backoff(attempts, outbox.retry_backoff, outbox.retry_backoff_max)
                await connection.execute(
                    update(table)
                    .where(_c.id == claimed.id, _c.claimed_by == self.name)
                    .values(
                        attempts=attempts,
                        state=PARKED if park else PENDING,
                        available_at=at + timedelta(seconds=delay),
                        lease_until=None,
                        # kept, and printed by `worker outbox`: no secret of a quoted URL
                        last_error=scrub(reason)[:2000],
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
        failures = unavailable = 0
        next_gauges = next_purge = time.monotonic()
        if outbox.purge_interval > 0:
            next_purge += outbox.purge_interval
        self._log.info("outbox relay started", ordered=outbox.ordered, batch=outbox.batch)
        self.running = True
        try:
            with waking(self._wakeup):
                while not self._stop.is_set():
                    self._wakeup.clear()
                    delay = outbox.poll_interval
                    try:
                        result = await self.run_once()
                        failures = 0
                        if result.unavailable:  # the broker: wait longer, a commit won't fix it
                            unavailable += 1
                            delay = max(delay, backoff(unavailable, 0.5, outbox.retry_backoff_max))
                        elif result.claimed == outbox.batch or result.deferred:
                            unavailable = 0
                            delay = 0.0  # a full batch, or rows left over: more is due
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
                        self._log.warning(
                            "outbox relay failed", error=exc, failure=classify(exc).value
                        )
                    if self._stop.is_set() or delay <= 0:
                        continue
                    # After a failure a commit's wake-up must not cut the backoff short;
                    # stop may.
                    waiting = self._stop if failures or unavailable else self._wakeup
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(waiting.wait(), delay)
                    if self._wakeup.is_set() and not self._stop.is_set() and outbox.linger > 0:
                        # Woken by a commit: let the commits right behind it join the batch,
                        # or a busy pump would pay two relay transactions per message.
                        await asyncio.sleep(outbox.linger)
        finally:
            self.running = False
            self._log.info("outbox relay stopped", **self.stats)

    async def update_gauges(self) -> Backlog:
        backlog = await backlog_of(self.engine)
        PENDING_ROWS.set(backlog.pending)
        PARKED_ROWS.set(backlog.parked)
        OLDEST_PENDING.set(backlog.oldest_pending_seconds)
        return backlog


# -- retention -----------------------------------------------------------------------


async def purge(engine: AsyncEngine, outbox: OutboxSettings, *, log: Any = None) -> int | None:
    """Delete sent rows older than the retention in bounded batches; None: another purges."""
    cutoff = now() - outbox.retention
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
            statement = delete(table).where(_c.id == any_(func.array(oldest.scalar_subquery())))
        else:
            statement = delete(table).where(_c.id.in_(oldest.scalar_subquery()))
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


# -- beside the pump in `worker run` ---------------------------------------------------


def start(settings_: Settings, engine: AsyncEngine, broker: Any) -> Relay | None:
    """The relay inside ``worker run`` (unless ``WORKER_OUTBOX_RELAY=false``), started as a task.

    It runs next to the pump, never in its way: readiness is the pump's alone, so a
    broker that refuses publishes shows as a backlog, not as a pod taken out of service.
    """
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
