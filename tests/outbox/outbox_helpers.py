"""Outbox test helpers: fast settings, a recording publisher, row queries."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.brokers.publishers import Outgoing
from worker.errors import BrokerUnavailable
from worker.outbox.model import OutboxMessage, OutboxSettings
from worker.outbox.relay import Relay

RunningRelays = Callable[[list[Relay]], AbstractAsyncContextManager[list[Relay]]]
"""The ``running_relays`` fixture (tests/outbox/conftest.py): ``running_relays(relays)``."""


def fast_outbox(**overrides: Any) -> OutboxSettings:
    values: dict[str, Any] = {
        "lease": 5.0,
        "publish_timeout": 2.0,
        "poll_interval": 0.05,
        "retry_backoff": 0.0,
        "retry_backoff_max": 0.0,
        "metrics_interval": 0.1,
        "purge_interval": 0,
        **overrides,
    }
    return OutboxSettings(**values)


class RecordingPublisher:
    """A broker that confirms everything, records it, and can refuse or be unreachable."""

    name = "recording"

    def __init__(self, *, delay: float = 0.0) -> None:
        self.sent: list[Outgoing] = []
        self.delay = delay
        self.unreachable = 0  # this many publish calls raise BrokerUnavailable
        self.refuse: Callable[[Outgoing], str | None] = lambda _m: None
        self.in_flight: set[str] = set()
        self.overlaps = 0  # one id published by two relays at the same time

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        if self.unreachable > 0:
            self.unreachable -= 1
            raise BrokerUnavailable("test broker down")
        ids = [m.message_id for m in messages]
        self.overlaps += sum(i in self.in_flight for i in ids)
        self.in_flight.update(ids)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            results = [self.refuse(m) for m in messages]
            self.sent.extend(m for m, r in zip(messages, results, strict=True) if r is None)
            return results
        finally:
            self.in_flight.difference_update(ids)

    async def close(self) -> None:
        return None


async def outbox_rows(engine: AsyncEngine) -> list[Any]:
    async with engine.connect() as connection:
        result = await connection.execute(
            select(OutboxMessage.__table__).order_by(OutboxMessage.id)
        )
        return list(result)


async def publish_rows(
    engine: AsyncEngine,
    incoming_id: str,
    events: Sequence[tuple[str, dict[str, Any], str | None, str | None]],
    *,
    consumer: str = "test",
    headers: dict[str, Any] | None = None,
) -> list[str]:
    """``ctx.publish`` each (type, body, key, destination) as one handler would, and commit."""
    from sqlalchemy.ext.asyncio import AsyncSession

    from worker.context import session_factory
    from worker.registry import Context

    session = session_factory(engine)()
    try:
        ctx = Context(session, incoming_id, consumer, 1, 1, headers or {})
        ids = [
            await ctx.publish(t, body, key=key, destination=destination)
            for t, body, key, destination in events
        ]
        await AsyncSession.commit(session)
    finally:
        await AsyncSession.close(session)
    return ids
