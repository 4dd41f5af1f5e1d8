"""Delivery counts kept in the database, for brokers that keep none across a crash.

Kafka counts nothing, and a RabbitMQ classic queue only flags a redelivery; an
adapter that counts in memory starts again at 1 after a restart. A message that
kills the process (out of memory, a segfault in a C extension) would then run
for ever. With ``WORKER_DELIVERY_COUNTS=database`` the pump calls :func:`count`
before the handlers run: one upsert, in its own short transaction (autocommit,
one round trip), so the count is durable before anything that may crash starts.

Only a delivery that may be a redelivery pays for it (``delivery.redelivered``:
the broker said so, or the adapter suspects it, as Kafka does for records just
after an assignment); ``WORKER_COUNT_FIRST_DELIVERIES=true`` counts every one,
for brokers that may lose even the redelivered flag. The first delivery of a
message is therefore normally not in the table: a row says "counted deliveries
after the first", and the count a delivery carries is that plus one, never less
than what the broker itself reported.

A failure to count is not the message's fault: the delivery keeps the broker's
count and goes on (its own transaction meets the same database trouble and the
pump pauses).
"""

from __future__ import annotations

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
    from worker.registry import Handler
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


def wanted(delivery: Delivery, settings: Settings) -> bool:
    """Whether this delivery is counted in the database."""
    if settings.delivery_counts != "database":
        return False
    return delivery.redelivered or settings.count_first_deliveries


async def count(
    engine: AsyncEngine,
    delivery: Delivery,
    handlers: tuple[Handler[Any], ...],
    settings: Settings,
) -> None:
    """Count this delivery durably and raise ``delivery.delivery_count`` to the stored count.

    The row is scoped by the first handler's consumer name, as its inbox marker is:
    two deployments consuming the same message ids from one database count apart.
    """
    if delivery.message_id is None or not handlers or not wanted(delivery, settings):
        return
    statement = _UPSERTS.get(engine.dialect.name)
    if statement is None:
        return
    first = 0 if settings.count_first_deliveries else 1  # the uncounted first delivery
    try:
        result = await _autocommitted(
            engine, statement, {"message_id": delivery.message_id, "consumer": handlers[0].consumer}
        )
        stored = result.scalar_one()
    except Exception as exc:  # not the message's fault: keep the broker's count
        get_logger().warning(
            "delivery count not stored",
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            error=exc,
        )
        return
    delivery.delivery_count = max(delivery.delivery_count, int(stored) + first)


_REFUND = (
    update(_table)
    .where(
        _table.c.message_id == bindparam("refunded_id"),
        _table.c.consumer == bindparam("refunded_consumer"),
        _table.c.deliveries > 0,
    )
    .values(deliveries=_table.c.deliveries - 1)
)


async def refund(
    engine: AsyncEngine, delivery: Delivery, handlers: tuple[Handler[Any], ...]
) -> None:
    """Take back this delivery's count: it goes back uncounted (a shutdown, a pause, a
    conflict lost to another writer), and only a message's own failure may spend one.

    Called before the give-back, so a crash in between costs nothing either. A crash
    before it, the case the count is for, never refunds. If the database cannot be
    reached, the count stays spent: one delivery, logged.
    """
    if delivery.message_id is None or not handlers:
        return
    try:
        await _autocommitted(
            engine,
            _REFUND,
            {"refunded_id": delivery.message_id, "refunded_consumer": handlers[0].consumer},
        )
    except Exception as exc:
        get_logger().warning(
            "delivery count not refunded",
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            error=exc,
        )


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
