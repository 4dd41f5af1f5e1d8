"""The outbox table, its row states, ``WORKER_OUTBOX_*``, and the backlog both sides read.

Shared by the handler side (:mod:`worker.outbox.publish`), the relay
(:mod:`worker.outbox.relay`) and the operator commands (:mod:`worker.outbox.commands`);
it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import cast

from pydantic import Field, ValidationInfo, field_validator
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
    func,
    select,
)
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Mapped, mapped_column

from worker.db import Base
from worker.settings import load

PENDING, SENT, PARKED = "pending", "sent", "parked"
OUTBOX_CONSTRAINT = "uq_outbox_message_id"


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


_settings: OutboxSettings | None = None


def settings() -> OutboxSettings:
    """``WORKER_OUTBOX_*``, read once per process (``configure`` replaces it)."""
    global _settings
    if _settings is None:
        _settings = load(OutboxSettings)
    return _settings


def configure(outbox: OutboxSettings | None) -> None:
    """Use ``outbox`` for publishing defaults from now on (None: read the environment again)."""
    global _settings
    _settings = outbox


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


table = cast(Table, OutboxMessage.__table__)
"""The Core table, for the relay's and the commands' bulk statements."""


def now() -> datetime:
    return datetime.now(UTC)


def aware(value: datetime) -> datetime:
    """SQLite hands timestamps back naive; they were written in UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Backlog:
    pending: int
    parked: int
    oldest_pending_seconds: float


async def backlog_of(engine: AsyncEngine) -> Backlog:
    """Unsent rows by state, and the age of the oldest pending one (0: none)."""
    c = table.c
    async with engine.connect() as connection:
        rows = (
            await connection.execute(
                select(c.state, func.count(), func.min(c.created_at))
                .where(c.state != SENT)
                .group_by(c.state)
            )
        ).all()
    counts = {row[0]: row[1] for row in rows}
    oldest = next((row[2] for row in rows if row[0] == PENDING), None)
    age = (now() - aware(oldest)).total_seconds() if oldest is not None else 0.0
    return Backlog(counts.get(PENDING, 0), counts.get(PARKED, 0), max(age, 0.0))
