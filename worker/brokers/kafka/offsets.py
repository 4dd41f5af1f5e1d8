"""Kafka offsets kept in the database: one row per (group, topic, partition).

``next_offset`` is the next record to read. With ``WORKER_KAFKA_OFFSETS=database``
it is written in the handler's own transaction, with the inbox marker, so a
record's effects and the offset past it commit together or not at all; the
broker's committed offsets become advisory (lag monitoring).

Fencing. A member that gets a partition *claims* its row: ``epoch`` goes up by
one and the member keeps the new value. Every later write of that member carries
``AND epoch = :mine``. A member that lost the partition (a rebalance it has not
noticed, a handler still running after the revocation grace) holds an older
epoch, its write matches no row, and :class:`Fenced` rolls its transaction back,
the business change and the inbox marker with it. The claim itself is an upsert
that waits for the row lock, so it reads the offset of whatever transaction of
the previous owner was committing at that moment: never an older one.

``started_through`` serves ``WORKER_DELIVERY_COUNTS=database``: before records are
handed out, the owner records (ahead, a block at a time) the highest offset it
may start, so the next owner knows which records may have been started before,
and counts those deliveries in the database.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import BigInteger, DateTime, Integer, String, Table, and_, bindparam, case, func
from sqlalchemy import update as sql_update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Mapped, mapped_column

from worker.db import Base
from worker.errors import SettlementLost

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession


class ConsumerOffset(Base):
    """Where a consumer group stands in one partition, and who may move it."""

    __tablename__ = "consumer_offsets"

    group_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    topic: Mapped[str] = mapped_column(String(255), primary_key=True)
    partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    next_offset: Mapped[int | None] = mapped_column(BigInteger)
    epoch: Mapped[int] = mapped_column(BigInteger, server_default="0")
    started_through: Mapped[int | None] = mapped_column(BigInteger)
    owner: Mapped[str | None] = mapped_column(String(255))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )


class Fenced(SettlementLost):
    """Another member claimed the partition since this one did: its write must not land."""


@dataclass(frozen=True, slots=True)
class Claim:
    epoch: int
    next_offset: int | None  # None: the group never stored one (start where Kafka says)
    started_through: int | None  # None: nothing recorded as possibly started


_t = cast(Table, ConsumerOffset.__table__)
_KEY = and_(
    _t.c.group_id == bindparam("g"),
    _t.c.topic == bindparam("t"),
    _t.c.partition == bindparam("p"),
    _t.c.epoch == bindparam("e"),
)


def _claim(dialect: str) -> Any:
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(_t).values(
        group_id=bindparam("g"),
        topic=bindparam("t"),
        partition=bindparam("p"),
        epoch=1,
        owner=bindparam("o"),
    )
    return statement.on_conflict_do_update(
        index_elements=[_t.c.group_id, _t.c.topic, _t.c.partition],
        set_={
            "epoch": _t.c.epoch + 1,
            "owner": statement.excluded.owner,
            "updated_at": func.current_timestamp(),
        },
    ).returning(_t.c.epoch, _t.c.next_offset, _t.c.started_through)


_CLAIMS = {name: _claim(name) for name in ("postgresql", "sqlite")}


def _forward(column: Any, value: Any) -> Any:
    """``column`` moved up to ``value``, never down (portable GREATEST, NULL-safe)."""
    return case((column.is_(None), value), (column < value, value), else_=column)


# The offset moves forward only: with key ordering or batches several transactions of one
# partition commit in any order, and each writes the contiguous prefix it saw.
_STORE = (
    sql_update(_t)
    .where(_KEY)
    .values(next_offset=_forward(_t.c.next_offset, bindparam("n")))
    .execution_options(synchronize_session=False)
)
_RESERVE = (
    sql_update(_t)
    .where(_KEY)
    .values(started_through=_forward(_t.c.started_through, bindparam("s")))
    .execution_options(synchronize_session=False)
)
# A clean hand-over: nothing beyond ``s`` was started, whatever was reserved ahead.
_HAND_OVER = (
    sql_update(_t)
    .where(_KEY)
    .values(started_through=bindparam("s"))
    .execution_options(synchronize_session=False)
)


@dataclass(frozen=True, slots=True)
class Slot:
    """One partition's row as one owner holds it."""

    group: str
    topic: str
    partition: int
    epoch: int

    @property
    def label(self) -> str:
        return f"{self.topic}/{self.partition}"

    def params(self, **extra: Any) -> dict[str, Any]:
        return {"g": self.group, "t": self.topic, "p": self.partition, "e": self.epoch, **extra}


async def claim(engine: AsyncEngine, group: str, topic: str, partition: int, owner: str) -> Claim:
    """Take the partition's row over (epoch + 1), creating it; one autocommitted round trip."""
    statement = _CLAIMS["postgresql" if engine.dialect.name == "postgresql" else "sqlite"]
    async with engine.connect() as connection:
        connection = await connection.execution_options(isolation_level="AUTOCOMMIT")
        params = {"g": group, "t": topic, "p": partition, "o": owner}
        row = (await connection.execute(statement, params)).one()
    return Claim(int(row[0]), row[1], row[2])


def _fenced(slot: Slot) -> Fenced:
    return Fenced(
        f"{slot.label}: claimed by another member since epoch {slot.epoch}; "
        "this transaction is rolled back and the record is the new owner's"
    )


async def store(session: AsyncSession, slot: Slot, next_offset: int | None) -> None:
    """In the handler's transaction: the offset past this work, or :class:`Fenced`.

    ``None`` moves nothing and only checks (and locks) the row.
    """
    result: Any = await session.execute(_STORE, slot.params(n=next_offset))
    if result.rowcount != 1:
        raise _fenced(slot)


async def _write(engine: AsyncEngine, statement: Any, params: dict[str, Any]) -> bool:
    async with engine.begin() as connection:
        result: Any = await connection.execute(statement, params)
    return bool(result.rowcount == 1)


async def advance(engine: AsyncEngine, slot: Slot, next_offset: int) -> bool:
    """Outside a handler: move the offset over records settled without a commit of
    their own (duplicates, dead letters). False: fenced."""
    return await _write(engine, _STORE, slot.params(n=next_offset))


async def reserve(engine: AsyncEngine, slot: Slot, through: int) -> bool:
    """Record that offsets up to ``through`` may be started. False: fenced."""
    return await _write(engine, _RESERVE, slot.params(s=through))


async def hand_over(engine: AsyncEngine, slot: Slot, through: int) -> bool:
    """At a clean revocation: only offsets up to ``through`` were ever started."""
    return await _write(engine, _HAND_OVER, slot.params(s=through))
