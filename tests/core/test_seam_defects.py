"""The defects found at the old attachment points of batch mode, lanes and durable counts,
each against the unit-of-work seam (intake -> middleware -> runner -> settle)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import pytest
from pydantic import BaseModel, field_validator
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.credits import credit_body
from tests.support.pumps import MakeSettings, RunPumps, learned, running_pump
from tests.support.waiting import wait_for
from worker.brokers.memory import MemoryBroker, MemoryConsumer, MemoryMessage
from worker.context import BatchContext, Context
from worker.delivery import Delivery
from worker.intake import Work
from worker.middleware import NextWork
from worker.registry import Registry
from worker.verdict import Verdict


def verbs(broker: MemoryBroker, message_id: str | None) -> list[str]:
    return [verb for verb, mid, _ in broker.history if mid == message_id]


async def balance(engine: AsyncEngine, account: str) -> Decimal | None:
    async with engine.connect() as connection:
        found = await connection.execute(select(Account.balance).where(Account.id == account))
        return found.scalar()


def credits() -> Registry:
    registry = Registry()
    registry.handler("Credit", CreditRequested, consumer="credit")(apply_credit)
    return registry


# -- 1. a message id that is empty or not a string --------------------------------------------


@pytest.mark.parametrize("bad_id", ["", 42])
async def test_an_empty_or_non_string_message_id_is_dead_lettered_with_the_reason(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, bad_id: Any
) -> None:
    """Five credits whose id function says ``""`` (the ``headers.get("x-id", "")`` habit)
    would share one marker and four would be acked as duplicates unapplied; an integer id
    looped past WORKER_MAX_DELIVERIES. Both are refused once, at the seam."""

    def identity(message: MemoryMessage) -> Any:
        return bad_id

    broker = MemoryBroker(identity=identity)
    for n in range(5):
        broker.publish(f"m-{n}", "Credit", credit_body("a", "1.00"))
    settings = make_settings(max_deliveries=3)
    async with run_pumps([broker.connect()], [engine], credits(), settings) as [pump]:
        await broker.wait_idle(timeout=10)
    assert len(broker.dead_letters) == 5
    assert [verb for verb, _, _ in broker.history] == ["dead-letter"] * 5  # no loop
    reason = broker.dead_letters[0].reason
    assert ("empty message id" if bad_id == "" else "message id is a int, not a string") in reason
    assert pump.stats["duplicate"] == 0
    assert await balance(engine, "a") is None


# -- 2. one bad delivery must not end batch intake ----------------------------------------------


async def test_one_bad_delivery_does_not_end_batch_intake(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """An integer id, and a key function that raises, among 20 valid messages in batch mode:
    every message is settled and the pump stays ready."""

    def identity(message: MemoryMessage) -> Any:
        return 7 if message.message_id == "int-id" else message.message_id

    registry = Registry()
    registry.handler("Credit", CreditRequested, consumer="credit")(apply_credit)

    def picky(message: CreditRequested) -> str:
        if message.account_id == "boom":
            raise TypeError("unsupported account")
        return message.account_id

    registry.handler("Keyed", CreditRequested, consumer="keyed", key=picky)(apply_credit)
    broker = MemoryBroker(identity=identity)
    broker.publish("int-id", "Credit", credit_body("a", "1"))
    broker.publish("bad-key", "Keyed", credit_body("boom", "1"))
    for n in range(20):
        broker.publish(f"m-{n}", "Credit" if n % 2 else "Keyed", credit_body("a", "1"))
    settings = make_settings(batch_size=8)
    async with run_pumps([broker.connect()], [engine], registry, settings) as [pump]:
        await broker.wait_idle(timeout=20)
        assert pump.ready
    # each ends acked, on its first delivery by count (a turn-away from the busy key's
    # lane is an uncounted give-back)
    assert all(verbs(broker, f"m-{n}")[-1:] == ["ack"] for n in range(20))
    assert all(count == 1 for _, mid, count in broker.history if str(mid).startswith("m-"))
    assert {letter.message.message_id: letter.reason for letter in broker.dead_letters} == {
        "int-id": "message id is a int, not a string",
        "bad-key": "keyed: key function failed: TypeError: unsupported account",
    }
    assert await balance(engine, "a") == 20


# -- 3. errors before the delivery-limit check ----------------------------------------------


class Strict(BaseModel):
    account_id: str
    amount: Decimal

    @field_validator("amount")
    @classmethod
    def cents(cls, value: Decimal) -> Decimal:
        return value.quantize(Decimal("0.01"))  # "1e40" raises decimal.InvalidOperation


@pytest.mark.parametrize("batch_size", [1, 8])
async def test_errors_in_decoding_or_the_key_function_are_poison_not_a_loop(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, batch_size: int
) -> None:
    """An unhashable key and a validator raising InvalidOperation (not a ValidationError)
    looped for ever as counted nacks; in batch mode the second also nacked its batch."""
    registry = Registry()

    def unhashable(message: Strict) -> Any:
        return [message.account_id]  # the [m.src, m.dst] habit

    @registry.handler("Transfer", Strict, consumer="transfer", key=unhashable)
    async def transfer(ctx: Context, message: Strict) -> None:
        pytest.fail("never runs: its key is unhashable")

    @registry.handler("Credit", Strict, consumer="credit")
    async def credit(ctx: Context, message: Strict) -> None:
        await apply_credit(
            ctx, CreditRequested(account_id=message.account_id, amount=message.amount)
        )

    broker = MemoryBroker()
    broker.publish("list-key", "Transfer", credit_body("a", "1"))
    broker.publish("huge", "Credit", json.dumps({"account_id": "a", "amount": "1e40"}).encode())
    for n in range(5):
        broker.publish(f"ok-{n}", "Credit", credit_body("a", "1"))
    settings = make_settings(max_deliveries=3, batch_size=batch_size)
    async with run_pumps([broker.connect()], [engine], registry, settings):
        await broker.wait_idle(timeout=20)
    assert verbs(broker, "list-key") == ["dead-letter"]
    assert verbs(broker, "huge") == ["dead-letter"]
    reasons = {letter.message.message_id: letter.reason for letter in broker.dead_letters}
    assert "key function failed: TypeError: unhashable type: 'list'" in reasons["list-key"]
    assert "InvalidOperation" in reasons["huge"]
    assert all(verbs(broker, f"ok-{n}") == ["ack"] for n in range(5))  # no innocent nacks
    assert await balance(engine, "a") == 5


async def test_an_unexpected_error_on_the_last_allowed_delivery_dead_letters(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    """A bug outside any handler (here a work middleware that fails on one message) is a
    counted nack, and on the last allowed delivery a dead letter with its reason: a
    delivery that always meets it still ends. The others pass through untouched."""

    async def failing(work: Work, call_next: NextWork) -> list[Verdict]:
        if any(item.delivery.message_id == "bug" for item in work.items):
            raise RuntimeError("a middleware bug")
        return await call_next(work)

    broker = MemoryBroker()
    broker.publish("bug", "Credit", credit_body("a", "1"))
    for n in range(3):
        broker.publish(f"ok-{n}", "Credit", credit_body("a", "1"))
    settings = make_settings(max_deliveries=3)
    async with running_pump(broker.connect(), engine, credits(), settings, middleware=[failing]):
        await broker.wait_idle(timeout=20)
    assert [(verb, count) for verb, mid, count in broker.history if mid == "bug"] == [
        ("nack", 1),
        ("nack", 2),
        ("dead-letter", 3),
    ]
    (letter,) = broker.dead_letters
    assert "failed 3 deliveries: unexpected error: RuntimeError: a middleware bug" in (
        letter.reason
    )
    assert all(verbs(broker, f"ok-{n}") == ["ack"] for n in range(3))
    assert await balance(engine, "a") == 3


# -- 4. batch mode keeps a group's order across types --------------------------------------------


class Grouped(MemoryConsumer):
    """Deliveries grouped by a ``p`` header, as the Kafka adapter groups a partition's."""

    def accept(self, flight: Any) -> None:
        super().accept(flight)
        delivery: Delivery = flight.delivery
        delivery.group = delivery.headers.get("p")


async def test_batch_mode_runs_a_groups_records_in_order_when_types_alternate(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """Two types alternating in one partition ran as [0, 2, 1, 3, ...]: a group's open batch
    is cut when a record of another type arrives in the group."""
    ran: list[int] = []
    registry = Registry()

    async def record(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
        ran.extend(int(m.split("-")[1]) for m in ctx.message_ids)

    registry.handler("A", CreditRequested, consumer="a", batch=True)(record)
    registry.handler("B", CreditRequested, consumer="b", batch=True)(record)
    broker = MemoryBroker()
    for n in range(8):
        broker.publish(f"r-{n}", "A" if n % 2 == 0 else "B", credit_body("x", "1"), {"p": 0})
    consumer = Grouped(broker)
    broker.consumers.append(consumer)
    settings = make_settings(batch_size=4, concurrency=4)
    async with run_pumps([consumer], [engine], registry, settings):
        await broker.wait_idle(timeout=20)
    assert ran == list(range(8))
    assert [mid for verb, mid, _ in broker.history] == [f"r-{n}" for n in range(8)]


# -- 5. a hot key must not starve the other keys ------------------------------------------------


async def test_a_hot_key_does_not_starve_the_other_keys(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """100 deliveries of one key ahead of 8 of other keys, at concurrency 4: the prefetch
    (3 x 4) filled with deliveries parked behind the hot key and three workers sat idle.
    One key may now park ``concurrency`` deliveries; the excess goes back uncounted."""
    done: dict[str, float] = {}
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", key=lambda m: m.account_id)
    async def credit(ctx: Context, message: CreditRequested) -> None:
        await asyncio.sleep(0.02)
        done[ctx.message_id] = time.monotonic()

    broker = MemoryBroker()
    for n in range(100):
        broker.publish(f"hot-{n}", "Credit", credit_body("hot", "1"))
    for n in range(8):
        broker.publish(f"cold-{n}", "Credit", credit_body(f"c{n}", "1"))
    started = time.monotonic()
    # one delivery per transaction: what this holds is the lanes' bound, not group commit's
    # (a hot key's group holds SQLite's one write lock for the whole group, and that lock,
    # not the lanes, would decide when the other keys' deliveries commit)
    settings = make_settings(concurrency=4, batch_size=1)
    async with run_pumps([broker.connect()], [engine], registry, settings):
        await wait_for(lambda: len([m for m in done if m.startswith("cold")]) == 8, 20, "cold")
        cold_done = max(t for m, t in done.items() if m.startswith("cold"))
        await broker.wait_idle(timeout=30)
    # counted by the handlers' own clock, not when the poll above happened to look
    hot_then = len([m for m, t in done.items() if m.startswith("hot") and t < cold_done])
    cold_done -= started
    # the other keys finish while the hot key has most of its work still ahead
    assert hot_then < 60, (cold_done, hot_then)
    assert sorted(done) == sorted(
        [f"hot-{n}" for n in range(100)] + [f"cold-{n}" for n in range(8)]
    )
    assert broker.dead_letters == []
    assert all(count == 1 for verb, _, count in broker.history if verb == "ack")  # uncounted


# -- 6. a unit of work tells the adapter each phase it starts ----------------------------


class Watched(MemoryConsumer):
    """Records ``keep_alive`` per message id: what a watchdog (Kafka) or a lock follows."""

    watches = True

    def __init__(self, broker: MemoryBroker) -> None:
        super().__init__(broker)
        self.kept: dict[str, list[float]] = {}

    def keep_alive(self, handle: Any, seconds: float) -> None:
        self.kept.setdefault(str(handle.message.message_id), []).append(seconds)


async def test_a_batch_tells_the_adapter_of_its_retry_and_of_each_fallback_step(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """The Kafka watchdog counted neither a batch's retry nor its fallback, left the group
    and its committed records came back. Each phase now says how long it may take."""
    calls = 0
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", batch=True)
    async def credit(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
        nonlocal calls
        calls += 1
        if len(messages) > 1:  # both batch attempts fail; one at a time they commit
            raise RuntimeError("the batch fails")

    broker = MemoryBroker()
    consumer = Watched(broker)
    broker.consumers.append(consumer)
    settings = make_settings(batch_size=3, handler_timeout=7.0, concurrency=1)
    async with run_pumps([consumer], [engine], registry, settings):
        await learned(broker)
        calls = 0
        for n in range(3):
            broker.publish(f"m-{n}", "Credit", credit_body("a", "1"))
        await broker.wait_idle(timeout=20)
    assert calls == 1 + 3  # one batch call (not retried: an ordinary error), then one each
    for n in range(3):
        kept = consumer.kept[f"m-{n}"]
        # the batch's transaction, then the fallback: once per step still ahead of it, then
        # its own transaction attempt
        assert kept[0] == 7.0 and len(kept) == 1 + (n + 1) + 1
    assert all(verb == "ack" for verb, _, _ in broker.history)


# -- 7. a refund only of what was counted ---------------------------------------------------


async def test_a_parked_redelivery_given_back_at_shutdown_keeps_its_stored_count(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    """Parked behind its key and given back at shutdown, a redelivery was refunded although
    its start was never counted (stored 1 -> 0): each graceful stop loosened the bound on a
    message that kills the process."""
    from worker.pump import Pump

    release = asyncio.Event()
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", key=lambda m: m.account_id)
    async def credit(ctx: Context, message: CreditRequested) -> None:
        await release.wait()

    async with engine.begin() as connection:
        await connection.execute(
            text(
                "INSERT INTO delivery_counts (message_id, consumer, deliveries) "
                "VALUES ('parked', 'credit', 1)"
            )
        )
    broker = MemoryBroker()
    broker.publish("first", "Credit", credit_body("a", "1"))
    broker.publish("parked", "Credit", credit_body("a", "1"))
    failed = broker.connect()  # both failed once (counted): they come back as redeliveries
    await failed.start(prefetch=2)
    taken = [await failed.receive() for _ in range(2)]
    await failed.stop_receiving()  # so that they go to the pump's consumer, not back here
    for delivery in taken:
        await delivery.nack(0.0)
    settings = make_settings(grace_period=0.2)
    pump = Pump(broker.connect(), engine, registry, settings)
    async with pump.running():
        await wait_for(lambda: pump.stats["parked"] == 1, 10, "'parked' behind its key")
    release.set()
    async with engine.connect() as connection:
        stored = await connection.execute(
            text("SELECT message_id, deliveries FROM delivery_counts ORDER BY message_id")
        )
        counts: dict[str, int] = {row[0]: row[1] for row in stored.all()}
    # "first" started (counted), was cancelled by the stop and refunded; "parked" never started
    assert counts == {"first": 0, "parked": 1}
