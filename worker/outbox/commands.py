"""The operator's side of the outbox: ``worker outbox`` and ``worker relay``.

``worker outbox`` lists the unsent rows (pending and parked) with their last error,
``--retry`` moves the parked ones back to pending; ``worker relay`` runs a relay on
its own, with ``/healthz``, ``/readyz`` and ``/metrics`` when ``WORKER_OPS_PORT`` is set.
A database that cannot serve them propagates to the CLI, which says so in one line.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.brokers.publishers import open_publisher
from worker.db import create_engine
from worker.logs import scrub
from worker.ops import start_ops
from worker.outbox.model import PARKED, PENDING, aware, backlog_of, now, settings, table
from worker.outbox.relay import Relay
from worker.settings import Settings

_c = table.c


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
            "created_at": aware(self.created_at).isoformat(),
            # stored scrubbed; scrubbed again for rows an older relay wrote
            "error": scrub(self.last_error) if self.last_error is not None else None,
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
                update(table)
                .where(and_(_c.id.in_(ids), _c.state == PARKED))
                .values(state=PENDING, attempts=0, available_at=now(), lease_until=None)
            )
            await connection.commit()
            moved += result.rowcount
    return moved


async def outbox_command(settings_: Settings, *, retry: bool, limit: int) -> int:
    """``worker outbox``: list pending and parked rows; ``--retry``: re-queue the parked ones."""
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
