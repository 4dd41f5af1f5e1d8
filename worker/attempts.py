"""Delivery counts kept in the database: attempts that started, not deliveries returned.

A broker counts returns: every delivery a dead process held comes back counted,
whether it was running or only prefetched, or parked behind a key or a partition.
Kafka counts nothing at all, and an adapter that counts in memory starts
again at 1 after a restart. With ``WORKER_DELIVERY_COUNTS=database`` (the default)
the worker counts instead what actually started: :func:`count` runs when a
redelivery's unit of work starts (never while it is only held), one upsert in its
own short transaction (autocommit, one round trip), so the count is durable before
anything that may crash starts. A message that kills the process is therefore
bounded, and the deliveries it took down with it spend nothing for the time they
were only held.

Only a redelivery pays for it (``delivery.redelivered``: the broker's count says
so, or the adapter suspects it); a first delivery costs nothing extra.
``WORKER_COUNT_FIRST_DELIVERIES=true`` counts every start, first ones included, at
one round trip per message: then even a first delivery that was only held when its
process died starts again at 1. Without it a row says "started deliveries after the
first", and the count a delivery carries is that plus one (its first delivery is
taken to have started).

A failure to count is not the message's fault: the delivery keeps the broker's
count and goes on (its own transaction meets the same database trouble and the
pump pauses).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import (
    DateTime,
    Index,
    Integer,
    String,
    Table,
    bindparam,
    delete,
    func,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Mapped, mapped_column

from worker.db import Base
from worker.logs import get_logger

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

    from worker.delivery import Delivery
    from worker.settings import Settings


class DeliveryCount(Base):
    """How many deliveries of ``message_id`` were counted for ``consumer``."""

    __tablename__ = "delivery_counts"
    __table_args__ = (Index("ix_delivery_counts_updated_at", "updated_at"),)

    message_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    consumer: Mapped[str] = mapped_column(String(255), primary_key=True)
    deliveries: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )


_table = cast(Table, DeliveryCount.__table__)


def _upsert(dialect: str) -> Any:
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(_table).values(deliveries=1)
    return statement.on_conflict_do_update(
        index_elements=[_table.c.message_id, _table.c.consumer],
        set_={
            "deliveries": _table.c.deliveries + 1,
            "updated_at": func.current_timestamp(),
        },
    ).returning(_table.c.deliveries)


_UPSERTS = {name: _upsert(name) for name in ("postgresql", "sqlite")}


async def _autocommitted(engine: AsyncEngine, statement: Any, params: dict[str, Any]) -> Any:
    """One statement in its own short transaction: one round trip, durable on return."""
    async with engine.connect() as connection:
        connection = await connection.execution_options(isolation_level="AUTOCOMMIT")
        return await connection.execute(statement, params)


def every_start(settings: Settings) -> bool:
    """Whether first deliveries' starts are counted too (WORKER_COUNT_FIRST_DELIVERIES; a
    group counts its members' in one statement)."""
    return settings.count_first_deliveries


def wanted(delivery: Delivery, settings: Settings) -> bool:
    """Whether this delivery's start is counted in the database."""
    if settings.delivery_counts != "database":
        return False
    return delivery.redelivered or every_start(settings)


async def count(engine: AsyncEngine, delivery: Delivery, consumer: str, settings: Settings) -> bool:
    """Count this start durably and set ``delivery.delivery_count`` to the started count;
    True when the row moved (so an uncounted give-back of this delivery refunds it).

    The row is scoped by the consumer name of the type's first handler, as its inbox
    marker is: two deployments consuming the same message ids from one database count
    apart. The broker's own count is not used: it counts returns, and a delivery that
    was only held when its process died has not failed.
    """
    if delivery.message_id is None or not wanted(delivery, settings):
        return False
    statement = _UPSERTS.get(engine.dialect.name)
    if statement is None:
        return False
    first = 0 if every_start(settings) else 1  # the uncounted first delivery
    try:
        result = await _autocommitted(
            engine, statement, {"message_id": delivery.message_id, "consumer": consumer}
        )
        stored = result.scalar_one()
    except Exception as exc:  # not the message's fault: keep the broker's count
        get_logger().warning(
            "delivery count not stored",
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            error=exc,
        )
        return False
    delivery.delivery_count = int(stored) + first
    return True


_STORED = select(_table.c.deliveries).where(
    _table.c.message_id == bindparam("m"), _table.c.consumer == bindparam("c")
)


async def started(engine: AsyncEngine, delivery: Delivery, consumer: str) -> bool:
    """Whether a start of this message was already recorded (read only; the start it is
    about to have is counted by :func:`count` when it starts). Where every start is
    recorded (:func:`every_start`), no row means it was only ever held. A failed read
    says yes: running alone is the safe side."""
    try:
        async with engine.connect() as connection:
            found = await connection.execute(_STORED, {"m": delivery.message_id, "c": consumer})
            stored = found.scalar()
    except Exception:
        return True
    return bool(stored and stored > 0)


_COUNT_MANY = {
    "postgresql": text(
        "INSERT INTO delivery_counts (message_id, consumer, deliveries) "
        "SELECT m, :c, 1 FROM unnest(CAST(:ids AS varchar[])) AS m "
        "ON CONFLICT (message_id, consumer) DO UPDATE SET "
        "deliveries = delivery_counts.deliveries + 1, updated_at = current_timestamp "
        "RETURNING message_id, deliveries"
    ),
    # SQLite: "WHERE true" tells the parser the ON CONFLICT is the upsert, not a join's ON
    "sqlite": text(
        "INSERT INTO delivery_counts (message_id, consumer, deliveries) "
        "SELECT value, :c, 1 FROM json_each(:ids) WHERE true "
        "ON CONFLICT (message_id, consumer) DO UPDATE SET "
        "deliveries = delivery_counts.deliveries + 1, updated_at = current_timestamp "
        "RETURNING message_id, deliveries"
    ),
}


async def count_many(
    engine: AsyncEngine, deliveries: Sequence[Delivery], consumer: str, settings: Settings
) -> bool:
    """A group's starts, counted in one statement (ids sorted: two groups sharing ids take
    their rows in one order); False when they could not be (each keeps its count)."""
    statement = _COUNT_MANY.get(engine.dialect.name)
    if settings.delivery_counts != "database" or statement is None or not deliveries:
        return False
    ids = sorted({str(d.message_id) for d in deliveries})
    params = {"c": consumer, "ids": ids if engine.dialect.name == "postgresql" else json.dumps(ids)}
    try:
        result = await _autocommitted(engine, statement, params)
        stored = {row[0]: int(row[1]) for row in result.all()}
    except Exception as exc:  # not the messages' fault: they keep the broker's counts
        get_logger().warning("delivery counts not stored", size=len(ids), error=exc)
        return False
    for delivery in deliveries:
        delivery.delivery_count = stored.get(str(delivery.message_id), delivery.delivery_count)
    return True


_REFUND = (
    update(_table)
    .where(
        _table.c.message_id == bindparam("refunded_id"),
        _table.c.consumer == bindparam("refunded_consumer"),
        _table.c.deliveries > 0,
    )
    .values(deliveries=_table.c.deliveries - 1)
)


async def refund(engine: AsyncEngine, delivery: Delivery, consumer: str) -> bool:
    """Take back the start :func:`count` recorded: the delivery goes back uncounted (a
    shutdown, a pause, a conflict lost to another writer), and only a message's own
    failure may spend one. Only a start that was counted is refunded.

    Called before the give-back, so a crash in between costs nothing either. A crash
    before it, the case the count is for, never refunds. False when the database could
    not take it (worker.settle waits for it to answer, then tries again).
    """
    if delivery.message_id is None:
        return True
    try:
        await _autocommitted(
            engine, _REFUND, {"refunded_id": delivery.message_id, "refunded_consumer": consumer}
        )
    except Exception as exc:
        get_logger().debug("refund failed", message_id=delivery.message_id, error=exc)
        return False
    return True


# Oldest first along ix_delivery_counts_updated_at, a bounded number of rows per statement.
_PURGE = delete(_table).where(
    tuple_(_table.c.message_id, _table.c.consumer).in_(
        select(_table.c.message_id, _table.c.consumer)
        .where(_table.c.updated_at < bindparam("cutoff"))
        .order_by(_table.c.updated_at)
        .limit(bindparam("batch"))
    )
)


async def purge(connection: AsyncConnection, cutoff: datetime, batch: int, batches: int) -> int:
    """Delete counts not touched since ``cutoff`` (the inbox's retention cutoff: no broker
    redelivers the message any more), each batch its own short transaction."""
    deleted = 0
    for _ in range(batches):
        result: Any = await connection.execute(_PURGE, {"cutoff": cutoff, "batch": batch})
        await connection.commit()
        deleted += result.rowcount
        if result.rowcount < batch:
            break
    return deleted
