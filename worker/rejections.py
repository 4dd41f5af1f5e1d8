"""Rejections: messages the pump did not apply on purpose, recorded before it acks.

A :class:`~worker.errors.Rejected` outcome (the sender's expected version no
longer matches, the row is gone, a merge found both sides changed one field) is
final: retrying would fail forever or apply the change over newer data. So the
pump acks it, but only after :func:`record_rejection` has committed the inbox
marker and a ``rejections`` row together: the operator can see what was dropped
and why, and a redelivery of the message is a duplicate.

:func:`deleted_row` finds the one rejection a handler does not raise itself:
after the mapper's ``StaleDataError`` it tells a row another writer deleted (a
:class:`~worker.errors.RowDeleted`) from one it changed (the pump retries that).

This is the pump's machinery, apart from the handler API in
:mod:`worker.concurrency`: a handler raises ``Rejected`` and never calls these.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    DateTime,
    Identity,
    Index,
    Integer,
    String,
    Table,
    Text,
    func,
    insert,
    inspect,
    select,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Mapped, Mapper, mapped_column
from sqlalchemy.orm.exc import StaleDataError

from worker import inbox
from worker.concurrency import WRITTEN, RowChanged, format_pk, keys_in, stats
from worker.db import Base, is_inbox_violation
from worker.errors import Rejected, RowDeleted
from worker.logs import scrub

_STALE_TABLE = re.compile(r"^(?:UPDATE|DELETE) statement on table '([^']+)'")


async def deleted_row(
    session: AsyncSession, exc: BaseException, sessions: async_sessionmaker[Any]
) -> RowDeleted | None:
    """After a mapper's ``StaleDataError``: a :class:`RowDeleted` when the row is gone.

    The failed flush has rolled the session's changes back, so this takes the
    versioned rows of that table the flush tried to write (remembered by
    :func:`prepare_models`' listener) and asks a fresh session which still
    exist. Anything unclear returns None: the pump then retries, always safe.
    """
    if isinstance(exc, RowChanged) or not isinstance(exc, StaleDataError):
        return None
    match = _STALE_TABLE.match(str(exc))
    if match is None:
        return None
    loaded: dict[Mapper[Any], list[tuple[Any, ...]]] = {}
    for target in session.info.get(WRITTEN, ()):
        state = inspect(target)
        mapper = state.mapper
        if state.key is not None and mapper.local_table.name == match.group(1):
            loaded.setdefault(mapper, []).append(tuple(state.key[1]))
    try:
        for mapper, pks in loaded.items():
            pk_cols = list(mapper.primary_key)
            lookup: AsyncSession = sessions()
            try:
                present = await lookup.execute(select(*pk_cols).where(keys_in(pk_cols, pks)))
                found = {tuple(row) for row in present.all()}
            finally:
                await AsyncSession.close(lookup)
            gone = [pk for pk in pks if pk not in found]
            if gone:
                subject = f"{match.group(1)}:{format_pk(gone[0])}"
                stats["deleted"] += 1
                return RowDeleted(f"{subject} was deleted by another writer", subject=subject)
    except Exception:  # a lookup that fails says nothing; the retry decides
        return None
    return None


# -- rejections: recorded, then acked -----------------------------------------------------


class Rejection(Base):
    """A message that was not applied on purpose, and why (precondition failed, deleted, ...)."""

    __tablename__ = "rejections"
    __table_args__ = (Index("ix_rejections_rejected_at", "rejected_at"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), Identity(), primary_key=True
    )
    message_id: Mapped[str] = mapped_column(String(255))
    consumer: Mapped[str] = mapped_column(String(255))
    message_type: Mapped[str | None] = mapped_column(String(255))
    reason: Mapped[str] = mapped_column(String(32))
    subject: Mapped[str | None] = mapped_column(String(255))
    expected_version: Mapped[int | None] = mapped_column(BigInteger)
    actual_version: Mapped[int | None] = mapped_column(BigInteger)
    detail: Mapped[str | None] = mapped_column(Text)
    rejected_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )


async def record_rejection(
    sessions: async_sessionmaker[Any],
    message_id: str,
    consumer: str,
    message_type: str | None,
    exc: Rejected,
    *,
    with_marker: bool = True,
) -> bool:
    """Insert the inbox marker and the rejection in one commit; False if it was a duplicate.

    The marker makes a redelivery of the rejected message a duplicate, so it is
    recorded once however often the broker hands it back.
    """
    session: AsyncSession = sessions()
    try:
        if with_marker:
            await inbox.mark(session, message_id, consumer)
        await session.execute(
            insert(cast(Table, Rejection.__table__)).values(
                message_id=message_id,
                consumer=consumer,
                message_type=message_type,
                reason=exc.outcome,
                subject=exc.subject,
                expected_version=exc.expected,
                actual_version=exc.actual,
                # kept for operators to read: no secret a quoted URL or error carried
                detail=scrub(exc.detail or str(exc))[:2000],
            )
        )
        await AsyncSession.commit(session)
        return True
    except IntegrityError as error:
        if is_inbox_violation(error):
            return False
        raise
    finally:
        await AsyncSession.close(session)
