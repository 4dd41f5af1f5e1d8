"""The explorer's workload: its tables, its messages and the handlers that act out a plan.

Two message types: ``Op``, an ordinary handler keyed by the message's ``key`` (and, in an
``audit`` schedule, a second handler under its own consumer name), and ``Bulk``, a batch
handler. Every handler writes one row per message into ``explorer_effects`` (no unique
constraint there: a message applied twice shows as two rows), after doing what the
message's plan says for this call: raise, fail a statement with a SQLSTATE, make the
database unreachable, let the process die, or leave its connection in another isolation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Column, Integer, LargeBinary, MetaData, String, Table, insert, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from tests.explorer.faults import Outages, fail_statement, unreachable
from tests.explorer.recording import Journal
from tests.explorer.schedule import Action, Message, Schedule
from worker import BatchContext, Context, Registry

metadata = MetaData()
effects = Table(
    "explorer_effects",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("message_id", String(64), nullable=False),
    Column("consumer", String(64), nullable=False),
    Column("pump", String(16), nullable=False),
)
unique = Table("explorer_unique", metadata, Column("code", String(16), primary_key=True))
blobs = Table(
    "explorer_blobs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("data", LargeBinary),
)

OP, BULK, AUDIT = "op", "bulk", "audit"


async def create_tables(connection: AsyncConnection) -> None:
    await connection.run_sync(metadata.create_all)
    await connection.execute(insert(unique).values(code="taken"))


class Op(BaseModel):
    n: int
    key: str | None = None


class Bulk(BaseModel):
    n: int


class Abort(BaseException):
    """A BaseException that is neither a cancellation nor an exit: a handler's own."""


def consumers(message_type: str, audit: bool) -> tuple[str, ...]:
    if message_type == "Op":
        return (OP, AUDIT) if audit else (OP,)
    return (BULK,)


def publish_args(message: Message, n: int) -> dict[str, Any]:
    body: dict[str, Any] = {"n": n}
    if message.type == "Op":
        body["key"] = message.key
    headers = {} if message.group is None else {"group": message.group}
    return {"body": body, "headers": headers}


Die = Callable[[], Awaitable[None]]
"""Kill the pump the calling handler runs in; raises (nothing after it reaches the broker)."""


class Plans:
    """The schedule's plans, acted out by the handlers of every pump."""

    def __init__(self, schedule: Schedule, journal: Journal, outages: Outages) -> None:
        self.schedule = schedule
        self.journal = journal
        self.outages = outages
        self.acting = False
        self._messages = {m.id: m for m in schedule.messages}

    async def act(
        self, pump: str, die: Die, session: AsyncSession, ids: Sequence[str], keys: Sequence[Any]
    ) -> None:
        """One call of a primary handler for ``ids``: journal it, then do the first action
        any of these messages has planned for this call of its own."""
        journal = self.journal
        chosen: tuple[str, Action] | None = None
        for message_id, key in zip(ids, keys, strict=True):
            journal.invoked(pump, message_id, key)
            journal.invocations[message_id] += 1
            message = self._messages.get(message_id)
            if message is None or not self.acting:
                continue
            action = message.action(journal.invocations[message_id])
            if action is not None and chosen is None:
                chosen = (message_id, action)
        if chosen is None:
            return
        message_id, action = chosen
        if action.own:
            journal.own_failures[message_id] += 1
        await self._perform(action, die, session)

    async def _perform(self, action: Action, die: Die, session: AsyncSession) -> None:
        if action.kind == "raise":
            if action.code == "CancelledError":
                raise asyncio.CancelledError("explorer: a handler's own cancellation")
            if action.code == "Abort":
                raise Abort("explorer: a handler's own BaseException")
            raise RuntimeError("explorer: the handler fails")
        if action.kind == "sqlstate":
            await fail_statement(session, action.code, self.schedule.database)
        elif action.kind == "outage":
            await unreachable(session, self.outages, action.code, action.seconds)
        elif action.kind == "session":  # a handler that changes its pooled connection for good
            await session.execute(
                text(f"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {action.code}")
            )
        else:
            await die()


def registry(plans: Plans, pump: str, die: Die, audit: bool) -> Registry:
    """The handlers of one pump (one process): the same consumer names in every pump."""
    handlers = Registry()

    @handlers.handler("Op", Op, consumer=OP, key=lambda m: m.key)
    async def op(ctx: Context, message: Op) -> None:
        await plans.act(pump, die, ctx.session, [ctx.message_id], [message.key])
        await ctx.session.execute(
            insert(effects).values(message_id=ctx.message_id, consumer=ctx.consumer, pump=pump)
        )

    @handlers.handler("Bulk", Bulk, consumer=BULK, batch=True)
    async def bulk(ctx: BatchContext, messages: Sequence[Bulk]) -> None:
        await plans.act(pump, die, ctx.session, ctx.message_ids, [None] * len(messages))
        rows = [{"message_id": m, "consumer": ctx.consumer, "pump": pump} for m in ctx.message_ids]
        await ctx.session.execute(insert(effects), rows)

    if audit:

        @handlers.handler("Op", Op, consumer=AUDIT)
        async def audit_op(ctx: Context, message: Op) -> None:
            await ctx.session.execute(
                insert(effects).values(message_id=ctx.message_id, consumer=ctx.consumer, pump=pump)
            )

    return handlers
