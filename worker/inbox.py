"""The inbox: one marker per (message id, consumer), unique by a named constraint."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    UniqueConstraint,
    bindparam,
    func,
    insert,
    literal,
    select,
    text,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from worker.db import INBOX_CONSTRAINT, Base

MESSAGE_ID_LENGTH = 255
"""Longer dedup keys cannot be stored: the pump dead-letters such a message at once."""


class InboxMarker(Base):
    """Proof that ``consumer`` processed ``message_id``.

    A surrogate, increasing bigint key keeps inserts at the right edge of the
    primary-key index; the dedup key lives in the named unique constraint.
    """

    __tablename__ = "inbox"
    __table_args__ = (
        UniqueConstraint("message_id", "consumer", name=INBOX_CONSTRAINT),
        # The purge walks finished markers by age; the sweeper finds expired claims.
        # Only claims have a lease, so the partial index costs regular markers nothing.
        Index("ix_inbox_processed_at", "processed_at"),
        Index(
            "ix_inbox_lease_until",
            "lease_until",
            postgresql_where=text("lease_until IS NOT NULL"),
            sqlite_where=text("lease_until IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), Identity(), primary_key=True
    )
    message_id: Mapped[str] = mapped_column(String(MESSAGE_ID_LENGTH))
    consumer: Mapped[str] = mapped_column(String(255))
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    processed_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    # Two-phase claims (worker.claims). Server defaults only: a regular marker's
    # INSERT names two columns and is "finished" the moment it commits.
    state: Mapped[str] = mapped_column(String(16), server_default="finished")
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    claimed_by: Mapped[str | None] = mapped_column(String(128))
    attempts: Mapped[int] = mapped_column(Integer, server_default="1")
    outcome: Mapped[str | None] = mapped_column(String(255))
    message_type: Mapped[str | None] = mapped_column(String(255))
    body: Mapped[bytes | None] = mapped_column(LargeBinary)


_table = InboxMarker.__table__
assert isinstance(_table, Table)
_MARK = insert(_table).values(message_id=bindparam("m"), consumer=bindparam("c"))
_EXISTS = (
    select(literal(1))
    .where(_table.c.message_id == bindparam("m"), _table.c.consumer == bindparam("c"))
    .limit(1)
)


async def mark(session: AsyncSession, message_id: str, consumer: str) -> None:
    """Insert the marker in the session's transaction; a duplicate raises IntegrityError.

    The pump calls this *before* the handler: on PostgreSQL a concurrent
    replica inserting the same key then waits for this transaction, and gets
    the unique violation without running the handler at all.
    """
    await session.execute(_MARK, {"m": message_id, "c": consumer})


async def seen(session: AsyncSession, message_id: str, consumer: str) -> bool:
    """The fast path for redeliveries. Never the guarantee: the constraint is."""
    return (await session.execute(_EXISTS, {"m": message_id, "c": consumer})).first() is not None
