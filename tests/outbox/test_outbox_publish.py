"""``ctx.publish``: rows that commit and roll back with the inbox marker; deterministic ids."""

from __future__ import annotations

import json
from collections import Counter
from decimal import Decimal

import pytest
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm.attributes import set_committed_value

from handlers.credit import Account, CreditRequested, apply_credit
from tests.outbox.outbox_helpers import outbox_rows
from tests.support.pumps import MakeSettings, RunPumps
from worker.brokers.memory import MemoryBroker
from worker.outbox.publish import outgoing_id
from worker.registry import Context, Registry

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Note(BaseModel):
    text: str


def publishing_registry(calls: Counter[str], *, fail_first: bool = False) -> Registry:
    registry = Registry()

    @registry.handler("Note", Note, consumer="notes")
    async def note(ctx: Context, message: Note) -> None:
        calls[ctx.message_id] += 1
        await ctx.publish("Noted", {"text": message.text}, key="k1")
        await ctx.publish("Noted", Note(text=message.text.upper()))
        if fail_first and calls[ctx.message_id] == 1:
            raise RuntimeError("boom after publishing")

    return registry


async def test_rows_commit_with_the_marker(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    broker = MemoryBroker()
    calls: Counter[str] = Counter()
    async with run_pumps([broker.connect()], [engine], publishing_registry(calls), make_settings()):
        broker.publish("m-1", "Note", {"text": "hi"}, {"traceparent": TRACEPARENT})
        await broker.wait_idle(timeout=10)
    rows = await outbox_rows(engine)
    assert [r.message_id for r in rows] == [
        outgoing_id("m-1", "notes", 0),
        outgoing_id("m-1", "notes", 1),
    ]
    first = rows[0]
    assert (first.message_type, first.key, first.state, first.attempts) == (
        "Noted",
        "k1",
        "pending",
        0,
    )
    assert json.loads(first.body) == {"text": "hi"}
    assert json.loads(rows[1].body) == {"text": "HI"}
    headers = json.loads(first.headers)
    assert headers["ce-id"] == first.message_id
    assert headers["ce-type"] == "Noted"
    assert headers["ce-source"] == "urn:worker"
    assert headers["traceparent"] == TRACEPARENT
    assert (first.source_message_id, first.consumer) == ("m-1", "notes")


async def test_a_failed_handler_leaves_no_row_and_its_rerun_the_same_ids(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    broker = MemoryBroker()
    calls: Counter[str] = Counter()
    registry = publishing_registry(calls, fail_first=True)
    async with run_pumps([broker.connect()], [engine], registry, make_settings()):
        broker.publish("m-2", "Note", {"text": "x"})
        await broker.wait_idle(timeout=10)
    assert calls["m-2"] == 2  # failed after publishing, then redelivered and committed
    assert [verb for verb, *_ in broker.history] == ["nack", "ack"]
    rows = await outbox_rows(engine)
    assert [r.message_id for r in rows] == [outgoing_id("m-2", "notes", i) for i in (0, 1)]


async def test_a_duplicate_delivery_adds_no_second_row(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    broker = MemoryBroker()
    calls: Counter[str] = Counter()
    consumers = [broker.connect(), broker.connect()]
    async with run_pumps(consumers, [engine], publishing_registry(calls), make_settings()):
        broker.publish("m-3", "Note", {"text": "a"}, copies=3)
        broker.publish("m-4", "Note", {"text": "b"}, to_all=True)
        broker.publish("m-5", "Note", {"text": "c"}, lose_acks=1)
        await broker.wait_idle(timeout=10)
    rows = await outbox_rows(engine)
    assert Counter(r.source_message_id for r in rows) == {"m-3": 2, "m-4": 2, "m-5": 2}
    assert len({r.message_id for r in rows}) == 6


@pytest.mark.parametrize("group", [1, 32])
async def test_a_conflict_rerun_publishes_the_same_ids(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, group: int
) -> None:
    """Every first attempt publishes, then loses a version conflict; the re-run's ids match:
    one delivery on its own is run again on a fresh session, a group again in savepoints."""
    registry = Registry()
    attempts: Counter[str] = Counter()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        attempts[ctx.message_id] += 1
        account = await ctx.session.get(Account, message.account_id)
        if ctx.attempt == 1 and account is not None:  # as if another writer had committed
            set_committed_value(account, "version", account.version - 1)
        await apply_credit(ctx, message)
        await ctx.publish("CreditApplied", {"account_id": message.account_id}, key="acct")

    broker = MemoryBroker()
    settings = make_settings(concurrency=8, max_attempts=50, batch_size=group)
    messages = [f"c-{n}" for n in range(40)]
    async with run_pumps([broker.connect()], [engine], registry, settings) as pumps:
        for message_id in messages:
            broker.publish(message_id, "Credit", {"account_id": "acct", "amount": "1"})
        await broker.wait_idle(timeout=60)
    reruns = pumps[0].stats["retried-conflict"] + pumps[0].stats["batch-isolated"]
    assert reruns > 0, "the test needs real conflicts"
    assert sum(attempts.values()) > len(messages)
    rows = await outbox_rows(engine)
    assert sorted(r.message_id for r in rows) == sorted(
        outgoing_id(m, "credit", 0) for m in messages
    )
    async with engine.connect() as connection:
        balance = await connection.scalar(select(Account.balance).where(Account.id == "acct"))
    assert balance == Decimal(len(messages))


async def test_a_handler_without_inbox_publishes_once_however_often_it_runs(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    registry = Registry()
    runs: Counter[str] = Counter()

    @registry.handler("Upsert", Note, consumer="upsert", inbox=False)
    async def upsert(ctx: Context, message: Note) -> None:
        runs[ctx.message_id] += 1
        await ctx.publish("Upserted", {"text": message.text})

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings()):
        broker.publish("u-1", "Upsert", {"text": "v"}, copies=3)
        await broker.wait_idle(timeout=10)
    assert runs["u-1"] == 3
    assert [r.message_id for r in await outbox_rows(engine)] == [outgoing_id("u-1", "upsert", 0)]


async def test_the_consuming_span_is_the_parent_of_the_event(engine: AsyncEngine) -> None:
    """With tracing on, ``traceparent`` names the consuming span, not the incoming one."""
    from opentelemetry.sdk.trace import TracerProvider

    from tests.outbox.outbox_helpers import publish_rows

    tracer = TracerProvider().get_tracer("outbox-test")  # not installed globally
    with tracer.start_as_current_span("consume") as span:
        await publish_rows(engine, "t-1", [("Traced", {}, None, None)], headers={
            "traceparent": TRACEPARENT
        })  # fmt: skip
    headers = json.loads((await outbox_rows(engine))[0].headers)
    context = span.get_span_context()
    version, trace_id, parent_id, _flags = headers["traceparent"].split("-")
    assert (version, trace_id, parent_id) == (
        "00",
        f"{context.trace_id:032x}",
        f"{context.span_id:016x}",
    )
