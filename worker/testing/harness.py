"""The harness: the user's handlers on the real pump, on the memory broker, on a database
of the kit's own, and what a test reads back.

Two pumps (two replicas, each with its own engine) consume one
:class:`~worker.brokers.memory.MemoryBroker`, exactly as ``worker run`` would with the
memory broker, minus the ops server and the housekeeping. A test delivers a message
(or the same one twice, or to both replicas at once) and waits until the broker holds
nothing unsettled; then it reads the settlements the broker saw, the dead letters with
their reasons, the inbox markers, the side-effect claims, the outbox rows and any table.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from pydantic import BaseModel
from sqlalchemy import MetaData, Table, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.inbox import TABLE as INBOX
from worker.outbox.model import table as OUTBOX
from worker.registry import Registry, Runs, registry
from worker.settings import Settings
from worker.testing.core import Pump
from worker.testing.isolation import Isolation, Replica
from worker.testing.probe import Plan, Probe
from worker.testing.scratch import Scratch, scratch_for
from worker.testing.tables import find_table

DEFAULT_SETTINGS: Mapping[str, Any] = {
    "concurrency": 4,
    "retry_backoff": 0.001,
    "retry_backoff_max": 0.01,
    "grace_period": 5.0,
    "batch_size": 1,
    # a side effect's twin waits for the claim's lease before it sees "finished"
    "claim_lease": 2.0,
    "claim_call_timeout": 1.0,
}
"""What the harness's pumps run with unless a test says otherwise (``WORKER_*`` otherwise)."""

Given = Sequence[tuple[str, Mapping[str, Any]]] | Callable[[AsyncConnection], Awaitable[None]]
"""The state every run starts from: ``(table, row)`` pairs, or a function of a connection."""

Body = Mapping[str, Any] | BaseModel | bytes | str

HarnessFactory = Callable[..., contextlib.AbstractAsyncContextManager["Harness"]]
"""The ``worker_harness`` fixture: ``worker_harness(handlers=None, *, given=(), models=(),
**settings)``, an ``async with`` giving a started :class:`Harness`."""


def encode(body: Body) -> bytes:
    """A message body as the broker carries it: JSON for a mapping or a model."""
    if isinstance(body, BaseModel):
        return body.model_dump_json().encode()
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return json.dumps(body, default=str).encode()


@dataclass(frozen=True, slots=True)
class Settled:
    """One settlement as the broker saw it."""

    verb: str  # "ack", "nack" or "dead-letter"
    delivery_count: int


@dataclass(frozen=True, slots=True)
class Delivered:
    """What became of one delivered message id."""

    message_id: str
    settlements: tuple[Settled, ...]
    outcomes: Counter[str]  # committed, duplicate, failed, ... (every handler, every delivery)
    dead_letter: str | None  # the reason, when it was dead-lettered

    @property
    def acked(self) -> bool:
        """Settled for good with an ack (after any number of nacks)."""
        return bool(self.settlements) and self.settlements[-1].verb == "ack"

    @property
    def dead_lettered(self) -> bool:
        return self.dead_letter is not None


@dataclass(frozen=True, slots=True)
class Marker:
    """An inbox row: a consumer's proof of a message, or a side effect's claim."""

    message_id: str
    consumer: str
    state: str  # "finished"; claims also "claimed" or "abandoned"
    attempts: int
    outcome: str | None
    lease_until: datetime | None


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """An event a handler published (``ctx.publish``), waiting for the relay."""

    message_id: str
    message_type: str
    body: Any  # decoded JSON where it is JSON, else the bytes
    key: str | None
    destination: str | None
    source_message_id: str
    consumer: str
    state: str
    headers: Mapping[str, Any] = field(default_factory=dict)


class Harness:
    """Two pumps on one memory broker over one database; see the module docstring.

    ``isolation``: each replica runs the handlers on a copy of their modules' state of
    its own (:mod:`worker.testing.isolation`), ``amnesia`` forgetting it before every
    stage; without it every replica shares the modules as they are.
    """

    def __init__(
        self,
        handlers: Registry,
        database_url: str,
        settings: Settings,
        *,
        replicas: int = 2,
        plan: Plan | None = None,
        settle_within: float = 30.0,
        models: Sequence[MetaData] = (),
        isolation: Isolation | None = None,
        amnesia: bool = False,
    ) -> None:
        self.registry = handlers
        self.models = tuple(models)
        self.database_url = database_url
        self.settings = settings
        self.settle_within = settle_within
        self.broker = MemoryBroker()
        self.engines = [create_engine(database_url, pool_size=8) for _ in range(replicas)]
        self.engine: AsyncEngine = self.engines[0]
        """The first replica's engine: read the database through it."""
        self.probe = Probe((e.sync_engine for e in self.engines), database_url, plan)
        self.replicas: list[Replica | None] = [
            isolation.replica(amnesia=amnesia) if isolation is not None else None
            for _ in self.engines
        ]
        self.pumps = [
            Pump(
                self.broker.connect(),
                engine,
                replica.registry if replica is not None else handlers,
                settings,
                name=f"replica-{n + 1}",
                stage_middleware=[self.probe.middleware(replica)],
            )
            for n, (engine, replica) in enumerate(zip(self.engines, self.replicas, strict=True))
        ]
        self._ids = itertools.count(1)
        self._stack = contextlib.AsyncExitStack()

    async def start(self) -> None:
        try:
            for pump in self.pumps:
                await self._stack.enter_async_context(pump.running())
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        try:
            await self._stack.aclose()
        finally:
            for engine in self.engines:
                await engine.dispose()
            for replica in self.replicas:
                if replica is not None:
                    replica.keep()

    # -- delivering ------------------------------------------------------------------

    async def deliver(
        self,
        type: str,
        body: Body,
        *,
        id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        concurrently: bool = False,
        lose_acks: int = 0,
    ) -> Delivered:
        """Publish one message and wait until the broker holds nothing unsettled.

        ``concurrently``: one copy to each replica at the same moment (twins);
        ``lose_acks``: the first acks are lost, as if the worker died between its
        commit and its ack, so the message comes back.
        """
        message_id = id if id is not None else f"message-{next(self._ids)}"
        history, outcomes = len(self.broker.history), self._outcomes()
        self.broker.publish(
            message_id,
            type,
            encode(body),
            dict(headers or {}),
            to_all=concurrently,
            lose_acks=lose_acks,
        )
        await self.settled()
        return self._delivered(message_id, history, outcomes)

    async def deliver_twice(
        self, type: str, body: Body, *, id: str | None = None, **options: Any
    ) -> Delivered:
        """The same message (one id) twice, one after the other: a producer's retry."""
        first = await self.deliver(type, body, id=id, **options)
        second = await self.deliver(type, body, id=first.message_id, **options)
        return Delivered(
            first.message_id,
            first.settlements + second.settlements,
            first.outcomes + second.outcomes,
            second.dead_letter or first.dead_letter,
        )

    async def deliver_concurrently(
        self, type: str, body: Body, *, id: str | None = None, **options: Any
    ) -> Delivered:
        """The same message to both replicas at the same moment."""
        return await self.deliver(type, body, id=id, concurrently=True, **options)

    async def settled(self) -> None:
        """Wait (at most ``settle_within`` seconds) until every message is settled for good."""
        try:
            await self.broker.wait_idle(self.settle_within)
        except TimeoutError:
            waiting = len(self.broker.ready) + self.broker.in_flight
            raise TimeoutError(
                f"{waiting} messages not settled within {self.settle_within}s"
            ) from None

    def _outcomes(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for pump in self.pumps:
            for (_, outcome), count in pump.outcomes.items():
                total[outcome] += count
        return total

    def _delivered(self, message_id: str, since: int, before: Counter[str]) -> Delivered:
        settlements = tuple(
            Settled(verb, count)
            for verb, mid, count in self.broker.history[since:]
            if mid == message_id
        )
        reasons = [d.reason for d in self.broker.dead_letters if d.message.message_id == message_id]
        outcomes = self._outcomes()
        outcomes.subtract(before)
        return Delivered(message_id, settlements, +outcomes, reasons[-1] if reasons else None)

    # -- reading ---------------------------------------------------------------------

    @property
    def settlements(self) -> list[tuple[str, str | None, int]]:
        """Every settlement so far, as (verb, message id, delivery count)."""
        return list(self.broker.history)

    @property
    def dead_letters(self) -> dict[str | None, str]:
        """Dead-lettered message ids and their reasons."""
        return {d.message.message_id: d.reason for d in self.broker.dead_letters}

    async def markers(self) -> list[Marker]:
        """The inbox, in insertion order."""
        c = INBOX.c
        query = select(
            c.message_id, c.consumer, c.state, c.attempts, c.outcome, c.lease_until
        ).order_by(c.id)
        async with self.engine.connect() as connection:
            rows = (await connection.execute(query)).all()
        return [Marker(*row) for row in rows]

    async def claims(self) -> list[Marker]:
        """The inbox rows of side-effect handlers (``@side_effect``): their claims."""
        claiming = {h.consumer for h in self.registry if h.runs is Runs.CLAIM}
        return [marker for marker in await self.markers() if marker.consumer in claiming]

    async def outbox(self) -> list[OutboxRow]:
        """The events handlers published, in the order they were written."""
        c = OUTBOX.c
        query = select(
            c.message_id,
            c.message_type,
            c.body,
            c.key,
            c.destination,
            c.source_message_id,
            c.consumer,
            c.state,
            c.headers,
        ).order_by(c.id)
        async with self.engine.connect() as connection:
            rows = (await connection.execute(query)).all()
        return [
            OutboxRow(*row[:2], _decoded(row[2]), *row[3:8], headers=json.loads(row[8] or "{}"))
            for row in rows
        ]

    async def rows(self, table: str | Table) -> list[dict[str, Any]]:
        """Every row of ``table`` (a model's table or any table's name), as dicts."""
        async with self.engine.connect() as connection:
            target = (
                table
                if isinstance(table, Table)
                else await find_table(connection, table, self.models)
            )
            order = list(target.primary_key.columns) or list(target.columns)
            result = await connection.execute(select(target).order_by(*order))
            return [dict(row._mapping) for row in result]


def _decoded(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body


async def seed(engine: AsyncEngine, given: Given, models: Sequence[MetaData] = ()) -> None:
    """Write ``given`` (rows or a function of a connection) in one transaction."""
    async with engine.begin() as connection:
        if callable(given):
            await given(connection)
            return
        for name, row in given:
            table = await find_table(connection, name, models)
            await connection.execute(insert(table).values(_typed(table, row)))


def _typed(table: Table, row: Mapping[str, Any]) -> dict[str, Any]:
    """JSON values as the columns' Python types (a Decimal from "9.99", a datetime from
    an ISO string): asyncpg binds only the type a column takes."""
    values: dict[str, Any] = {}
    for name, value in row.items():
        column = table.columns.get(name)
        if column is None:
            raise KeyError(f"table {table.name!r} has no column {name!r}")
        try:
            python = column.type.python_type
        except NotImplementedError:
            python = object
        if isinstance(value, str) and python is Decimal:
            value = Decimal(value)
        elif isinstance(value, str) and python is datetime:
            value = datetime.fromisoformat(value)
        elif isinstance(value, int | float | str) and python is bytes:
            value = str(value).encode()
        values[name] = value
    return values


def harness_settings(database_url: str, overrides: Mapping[str, Any]) -> Settings:
    values = {**DEFAULT_SETTINGS, **overrides, "database_url": database_url}
    return Settings(**values)


@contextlib.asynccontextmanager
async def harness(
    handlers: Registry | None = None,
    *,
    database: str | Scratch | None = None,
    given: Given = (),
    models: Sequence[MetaData] = (),
    replicas: int = 2,
    settle_within: float = 30.0,
    **settings: Any,
) -> AsyncIterator[Harness]:
    """``async with harness() as worker:`` the registered handlers on two running pumps.

    ``handlers``: the registry to serve (default: the one ``@handler`` fills).
    ``database``: None for a SQLite file of its own, a ``postgresql+asyncpg://`` URL of
    a server to create a throwaway database on, or a scratch from the ``worker_database``
    fixture. ``given``: rows to start from. ``models``: metadata beyond ``worker.Base``'s
    whose tables to create. ``settings``: Settings fields (``max_deliveries=3``).
    """
    async with scratch_for(database) as scratch:
        url = await scratch.fresh(models)
        await seeded(url, given, models)
        worker = Harness(
            handlers if handlers is not None else registry,
            url,
            harness_settings(url, settings),
            replicas=replicas,
            settle_within=settle_within,
            models=models,
        )
        await worker.start()
        try:
            yield worker
        finally:
            await worker.stop()


async def seeded(url: str, given: Given, models: Sequence[MetaData] = ()) -> None:
    """The database at ``url`` with ``given`` written into it."""
    if not callable(given) and not given:
        return
    engine = create_engine(url, pool_size=1)
    try:
        await seed(engine, given, models)
    finally:
        await engine.dispose()
