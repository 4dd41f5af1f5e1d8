"""Helpers for the concurrency, claims and retention tests (a module name no other folder uses).

:class:`MailServer` is a real HTTP server on 127.0.0.1 standing in for a mail
provider: it counts calls per ``Idempotency-Key``, applies each key's effect
once (as a provider that deduplicates does), and can be told to fail or hang.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web
from sqlalchemy import Table, event, func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.database import INBOX


class MailServer:
    """A mail API: ``calls`` per key, ``effects`` applied once per key."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.effects: dict[str, dict[str, Any]] = {}
        self.fail = 0  # answer the next N calls with ``fail_status``
        self.fail_status = 503
        self.hang = 0  # hold the next N calls for ``hang_for`` seconds before answering
        self.hang_for = 1.5
        self.delay = 0.0  # every successful call takes this long
        self.arrived = asyncio.Event()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        key = request.headers.get("Idempotency-Key", "")
        payload = await request.json()
        self.calls[key] += 1
        self.arrived.set()
        if self.hang > 0:
            self.hang -= 1
            await asyncio.sleep(self.hang_for)
        if self.fail > 0:
            self.fail -= 1
            return web.json_response({"error": "unavailable"}, status=self.fail_status)
        if self.delay:
            await asyncio.sleep(self.delay)
        self.effects.setdefault(key, payload)  # a replay with a known key changes nothing
        return web.json_response({"id": f"mail-{len(self.effects)}"}, status=202)


async def inbox_rows(engine: AsyncEngine, **where: Any) -> list[Any]:
    statement = select(INBOX).order_by(INBOX.c.id)
    for column, value in where.items():
        statement = statement.where(INBOX.c[column] == value)
    async with engine.connect() as connection:
        return list((await connection.execute(statement)).all())


async def add_marker(
    engine: AsyncEngine,
    message_id: str,
    *,
    consumer: str = "c",
    age: timedelta = timedelta(0),
    state: str = "finished",
    lease: timedelta | None = None,
    body: bytes | None = None,
    message_type: str | None = None,
) -> None:
    """A marker processed ``age`` ago, or a claim whose lease ends ``lease`` from now."""
    now = datetime.now(UTC)
    values: dict[str, Any] = {
        "message_id": message_id,
        "consumer": consumer,
        "received_at": now - age,
        "processed_at": now - age if state == "finished" else None,
        "state": state,
        "body": body,
        "message_type": message_type,
    }
    if state == "claimed":
        values["lease_until"] = now + (lease or timedelta(0))
        values["claimed_by"] = "someone-else"
    async with engine.begin() as connection:
        await connection.execute(insert(INBOX).values(values))


async def count(engine: AsyncEngine, table: Table, *where: Any) -> int:
    async with engine.connect() as connection:
        found = await connection.scalar(select(func.count()).select_from(table).where(*where))
    return int(found or 0)


def record_statements(engine: AsyncEngine) -> list[str]:
    """Every SQL statement ``engine`` sends from now on, in order (clear it to start afresh)."""
    statements: list[str] = []
    event.listen(
        engine.sync_engine,
        "before_cursor_execute",
        lambda _c, _cur, sql, *_: statements.append(sql),
    )
    return statements
