"""The handler side of the outbox: what ``ctx.publish`` does, and nothing more.

:func:`add` writes one row through the pump's own session, so the event commits with
the inbox marker and the business writes, or rolls back with them. Nothing is sent
from here. When that session commits, this process's relays are woken
(:func:`waking`), so an event does not wait for the relay's next poll.

This module knows the message being handled only through :class:`Incoming`; it
imports nothing of the pump, the registry or the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from pydantic import BaseModel
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession

from worker.brokers.publishers import encode_headers
from worker.db import insert_ignoring_conflicts
from worker.outbox.model import OutboxMessage, settings

NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:idempotent-worker:outbox")
"""The uuid5 namespace of outgoing ids: change it and every re-run gets new ids."""


class Incoming(Protocol):
    """What :func:`add` reads of the message being handled (a ``Context`` has all of it)."""

    @property
    def session(self) -> AsyncSession: ...

    @property
    def message_id(self) -> str: ...

    @property
    def consumer(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, Any] | None: ...


def outgoing_id(incoming_id: str, consumer: str, sequence: int) -> str:
    """The id of the ``sequence``-th message a handler publishes for ``incoming_id``."""
    return str(uuid.uuid5(NAMESPACE, f"{incoming_id}\0{consumer}\0{sequence}"))


async def add(
    incoming: Incoming,
    sequence: int,
    message_type: str,
    body: BaseModel | Mapping[str, Any] | bytes | str,
    *,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    destination: str | None = None,
) -> str:
    """Add the outbox row for the ``sequence``-th publish of ``incoming``; returns its id."""
    outbox = settings()
    message_id = outgoing_id(incoming.message_id, incoming.consumer, sequence)
    all_headers: dict[str, Any] = dict(headers or {})
    all_headers.update(_trace_headers(incoming.headers))
    all_headers.update(
        {
            "ce-specversion": "1.0",
            "ce-id": message_id,
            "ce-type": message_type,
            "ce-source": outbox.source,
        }
    )
    session = incoming.session
    row = {
        "message_id": message_id,
        "message_type": message_type,
        "body": _encode_body(body),
        "headers": json.dumps(encode_headers(all_headers), separators=(",", ":")),
        "key": key,
        "destination": destination or outbox.destination_for(message_type),
        "source_message_id": incoming.message_id,
        "consumer": incoming.consumer,
    }
    # A handler without the inbox may run again after committing: its ids are the same,
    # and the event already went out (or will), so a second row would be a second event.
    await session.execute(insert_ignoring_conflicts(session, OutboxMessage).values(row))
    _wake_after_commit(session)
    return message_id


def _encode_body(body: BaseModel | Mapping[str, Any] | bytes | str) -> bytes:
    if isinstance(body, BaseModel):
        return body.model_dump_json().encode()
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return json.dumps(body, separators=(",", ":"), default=str).encode()


def _trace_headers(incoming: Mapping[str, Any] | None) -> dict[str, str]:
    """The W3C trace context: the consuming span's when tracing is on, else the incoming one."""
    carrier: dict[str, str] = {}
    try:
        from opentelemetry import propagate  # optional: only with the tracing extra

        propagate.inject(carrier)
    except Exception:  # no usable OpenTelemetry: fall back to what came in
        carrier = {}
    if "traceparent" not in carrier and incoming:
        for name in ("traceparent", "tracestate"):
            value = incoming.get(name)
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            if isinstance(value, str) and value:
                carrier[name] = value
    return {k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")}


# -- in-process wake-up --------------------------------------------------------------

_wakers: set[asyncio.Event] = set()


def wake() -> None:
    """Tell this process's relays that rows were committed."""
    for waker in _wakers:
        waker.set()


@contextlib.contextmanager
def waking(waker: asyncio.Event) -> Iterator[None]:
    """Set ``waker`` whenever a session that published commits, until the block ends."""
    _wakers.add(waker)
    try:
        yield
    finally:
        _wakers.discard(waker)


def _after_commit(_session: Any) -> None:
    wake()


def _wake_after_commit(session: AsyncSession) -> None:
    sync = session.sync_session
    if not sync.info.get("outbox_wake"):
        sync.info["outbox_wake"] = True
        event.listen(sync, "after_commit", _after_commit, once=True)
