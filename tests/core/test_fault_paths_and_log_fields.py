"""Pump-level fault paths: bugs that must fail loudly, errors that must be counted or poison,
and the fields every log line about a message carries. Memory broker; SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import MutableMapping, Sequence
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm.attributes import set_committed_value
from structlog.testing import capture_logs

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.credits import credit_registry
from tests.support.database import ACCOUNTS
from tests.support.processes import free_port
from tests.support.pumps import MakeSettings, RunPumps
from tests.support.waiting import wait_for
from worker.brokers.memory import MemoryBroker, MemoryConsumer
from worker.delivery import Delivery, ack_each
from worker.errors import AlreadySettled, Poison
from worker.inbox import InboxMarker
from worker.registry import Context, Registry

BODY = {"account_id": "a", "amount": "1.50"}


def verbs(broker: MemoryBroker, message_id: str) -> list[str]:
    return [verb for verb, mid, _ in broker.history if mid == message_id]


def counts(broker: MemoryBroker, message_id: str) -> list[int]:
    return [count for _, mid, count in broker.history if mid == message_id]


async def row_count(engine: AsyncEngine, model: Any) -> int:
    async with engine.connect() as connection:
        return int(await connection.scalar(select(func.count()).select_from(model)) or 0)


class Faulty:
    """A memory-broker connection behind an adapter with bugs in it.

    Each delivery is re-wrapped with this adapter as its settler (the memory broker's
    own delivery as the handle), so the faults sit where an adapter's would:

    - ``twice``: the same Delivery object is handed to the pump a second time;
    - ``guard``: the adapter settles, then its own settle-once guard fires anyway;
    - ``keep_alive_fails``: the adapter's ``keep_alive`` raises on the first delivery (a bug
      outside any handler, met inside the unit of work);
    - ``nack_fails`` / ``ack_fails``: the verb gives the message back / acks, then raises.
    """

    name = "faulty"
    destination = "faulty"
    watches = True  # its keep_alive has a bug to meet
    writes_in_commit = False

    def __init__(self, inner: MemoryConsumer, **faults: set[str]) -> None:
        self.inner = inner
        self.stats: Counter[str] = Counter()
        self.faults = faults
        self.again: list[Delivery] = []

    def _has(self, fault: str, handle: Delivery) -> bool:
        return handle.message_id in self.faults.get(fault, set()) and handle.delivery_count == 1

    @property
    def ready(self) -> bool:
        return self.inner.ready

    async def start(self, prefetch: int) -> None:
        await self.inner.start(prefetch)

    async def receive(self) -> Delivery:
        if self.again:
            return self.again.pop()
        inner = await self.inner.receive()
        outer = Delivery(
            inner.message_id,
            inner.type,
            inner.body,
            inner.headers,
            inner.delivery_count,
            self,
            inner,
        )
        if self._has("twice", inner):
            self.again.append(outer)
        return outer

    async def stop_receiving(self) -> None:
        await self.inner.stop_receiving()

    async def close(self) -> None:
        await self.inner.close()

    async def ack(self, handle: Delivery) -> None:
        await handle.ack()
        if self._has("guard", handle):
            raise AlreadySettled(f"adapter: {handle.message_id!r} was acked already")
        if self._has("ack_fails", handle):
            raise RuntimeError("adapter bug in ack")

    async def nack(self, handle: Delivery, delay: float | None, counted: bool) -> None:
        await handle.nack(delay, counted=counted)
        if self._has("nack_fails", handle):
            raise RuntimeError("adapter bug in nack")

    async def dead_letter(self, handle: Delivery, reason: str) -> None:
        await handle.dead_letter(reason)

    async def ack_many(self, handles: Sequence[Delivery]) -> list[Delivery]:
        return await ack_each(self.ack, handles)  # as the adapters that ack one at a time

    def keep_alive(self, handle: Delivery, seconds: float) -> None:
        if self._has("keep_alive_fails", handle):
            raise RuntimeError("adapter bug in keep_alive")
        handle.keep_alive(seconds)

    async def in_commit(self, session: Any, handles: Sequence[Delivery]) -> None:
        return None


# -- (a) a double settlement is a bug, never a lost settlement ------------------------------------


@pytest.mark.parametrize("fault", ["twice", "guard"])
async def test_a_double_settlement_is_logged_as_a_bug_and_counted(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, fault: str
) -> None:
    broker = MemoryBroker()
    faulty = Faulty(broker.connect(), **{fault: {"m-1"}})
    registry = credit_registry("Credit")
    with capture_logs() as logs:
        async with run_pumps([faulty], [engine], registry, make_settings()) as [pump]:
            broker.publish("m-1", "Credit", BODY)
            broker.publish("m-2", "Credit", BODY)
            await wait_for(
                lambda: pump.stats["settled-twice"] == 1, 20.0, "the second settle", step=0.01
            )
            await broker.wait_idle(timeout=10)
    assert verbs(broker, "m-1") == ["ack"] and verbs(broker, "m-2") == ["ack"]
    assert pump.stats["settled-twice"] == 1
    assert pump.stats["settlement-lost"] == 0
    assert [line for line in logs if "settlement lost" in line["event"]] == []
    [bug] = [line for line in logs if line["event"] == "bug: delivery settled twice"]
    assert bug["log_level"] == "error"
    assert bug["message_id"] == "m-1" and bug["outcome"] == "settled-twice"
    assert isinstance(bug["error"], AlreadySettled)


# -- (b) the fallback settlement after an unexpected error is guarded -----------------------------


async def test_an_adapter_whose_nack_raises_does_not_end_the_worker_loop(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    broker = MemoryBroker()
    # an adapter bug makes the unit of work fail unexpectedly; the nack then raises too
    faulty = Faulty(broker.connect(), keep_alive_fails={"bug"}, nack_fails={"bug"})
    settings = make_settings(concurrency=1)  # one worker loop: it must survive
    with capture_logs() as logs:
        async with run_pumps([faulty], [engine], credit_registry("Credit"), settings) as [pump]:
            broker.publish("bug", "Credit", BODY)
            for n in range(3):
                broker.publish(f"after-{n}", "Credit", BODY)
            await broker.wait_idle(timeout=20)
    assert verbs(broker, "bug") == ["nack", "ack"]  # given back, then processed normally
    assert all(verbs(broker, f"after-{n}") == ["ack"] for n in range(3))
    assert pump.stats["settlement-failed"] == 1
    [failed] = [line for line in logs if line["event"].startswith("settlement failed")]
    assert failed["log_level"] == "error" and failed["message_id"] == "bug"
    assert failed["outcome"] == "settlement-failed"


async def test_an_adapter_whose_ack_raises_does_not_end_the_worker_loop(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    broker = MemoryBroker()
    faulty = Faulty(broker.connect(), ack_fails={"m-1"})
    settings = make_settings(concurrency=1)
    with capture_logs() as logs:
        async with run_pumps([faulty], [engine], credit_registry("Credit"), settings) as [pump]:
            broker.publish("m-1", "Credit", BODY)
            broker.publish("m-2", "Credit", BODY)
            await broker.wait_idle(timeout=20)
    assert verbs(broker, "m-1") == ["ack"] and verbs(broker, "m-2") == ["ack"]
    assert pump.stats["committed"] == 2
    [failed] = [line for line in logs if line["event"].startswith("settlement failed")]
    assert failed["message_id"] == "m-1" and failed["outcome"] == "settlement-failed"


# -- (c) a handler's own refused connection is the message's failure ------------------------------


async def test_a_handlers_own_connection_refused_is_counted_not_a_pause(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    port = free_port()
    calls = Counter[str]()
    registry = Registry()

    @registry.handler("Notify", CreditRequested, consumer="notify")
    async def notify(ctx: Context, message: CreditRequested) -> None:
        calls[ctx.message_id] += 1
        await apply_credit(ctx, message)
        # the provider's HTTP endpoint is down: a real refusal, not the database's
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()

    broker = MemoryBroker()
    settings = make_settings(max_deliveries=3, max_attempts=5)
    async with run_pumps([broker.connect()], [engine], registry, settings) as [pump]:
        broker.publish("m-1", "Notify", BODY)
        await broker.wait_idle(timeout=20)
        assert pump.health.available
    assert verbs(broker, "m-1") == ["nack", "nack", "dead-letter"]
    assert counts(broker, "m-1") == [1, 2, 3]  # every delivery counted: the message's failure
    assert calls["m-1"] == 3  # one attempt per delivery: no in-process connection retries
    assert pump.health.outages == 0 and pump.stats["paused"] == 0
    assert pump.stats["retried-connection"] == 0
    [letter] = broker.dead_letters
    assert "ConnectionRefusedError" in letter.reason
    assert await row_count(engine, InboxMarker) == 0 and await row_count(engine, Account) == 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_busy_connection_pool_spends_no_delivery(
    database_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """A pool sized below the concurrency (to fit max_connections) makes an attempt wait
    for a connection; when the wait times out, that is not the message's failure."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=0.1)
    registry = Registry()

    @registry.handler("Slow", CreditRequested, consumer="slow")
    async def slow(ctx: Context, message: CreditRequested) -> None:
        await apply_credit(ctx, message)
        await asyncio.sleep(0.3)  # holds the only connection

    broker = MemoryBroker()
    settings = make_settings(concurrency=2, max_deliveries=1)
    try:
        async with run_pumps([broker.connect()], [engine], registry, settings):
            broker.publish("m-1", "Slow", BODY)
            broker.publish("m-2", "Slow", BODY)
            await broker.wait_idle(timeout=30)
    finally:
        await engine.dispose()
    assert broker.dead_letters == []  # both valid: neither may be dead-lettered
    assert verbs(broker, "m-1")[-1] == "ack" and verbs(broker, "m-2")[-1] == "ack"


# -- (d) values the database refuses are poison ---------------------------------------------------


class Counted(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    n: int


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("body", "what"),
    [
        pytest.param({"account_id": "a", "amount": "9" * 40}, "overflow", id="numeric-overflow"),
        pytest.param({"account_id": "x" * 1000, "amount": "1"}, "too long", id="varchar-64"),
        pytest.param({"account_id": "a\x00b", "amount": "1"}, "0x00", id="nul-byte"),
    ],
)
async def test_data_the_database_refuses_is_dead_lettered_at_once_on_postgresql(
    postgres_only_url: str,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    body: dict[str, str],
    what: str,
) -> None:
    from worker.db import create_engine

    engine = create_engine(postgres_only_url, pool_size=8)
    broker = MemoryBroker()
    settings = make_settings(database_url=postgres_only_url, max_deliveries=5)
    registry = credit_registry("Credit")
    try:
        async with run_pumps([broker.connect()], [engine], registry, settings) as [pump]:
            broker.publish("m-1", "Credit", body)
            broker.publish("m-2", "Credit", BODY)  # the valid one behind it
            await broker.wait_idle(timeout=20)
        assert verbs(broker, "m-1") == ["dead-letter"]
        assert counts(broker, "m-1") == [1]  # the first delivery: no retry ladder
        [letter] = broker.dead_letters
        assert letter.reason.startswith("credit: the database refuses a value")
        assert what in letter.reason
        assert verbs(broker, "m-2") == ["ack"]
        assert await row_count(engine, InboxMarker) == 1  # m-2's only
        assert pump.stats["committed"] == 1
    finally:
        await engine.dispose()


async def test_an_integer_beyond_64_bits_is_dead_lettered_at_once(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            text("CREATE TABLE counters (id VARCHAR(64) PRIMARY KEY, n BIGINT)")
        )
    registry = Registry()

    @registry.handler("Count", Counted, consumer="count")
    async def count(ctx: Context, message: Counted) -> None:
        await ctx.session.execute(
            text("INSERT INTO counters (id, n) VALUES (:id, :n)"),
            {"id": ctx.message_id, "n": message.n},
        )

    broker = MemoryBroker()
    settings = make_settings(max_deliveries=5)
    async with run_pumps([broker.connect()], [engine], registry, settings):
        broker.publish("big", "Count", {"n": 2**64})
        broker.publish("small", "Count", {"n": 2**62})
        await broker.wait_idle(timeout=20)
    assert verbs(broker, "big") == ["dead-letter"] and counts(broker, "big") == [1]
    assert broker.dead_letters[0].reason.startswith("count: the database refuses a value")
    assert verbs(broker, "small") == ["ack"]


# -- (e) what every log line about a message carries ---------------------------------------------


LogLines = list[MutableMapping[str, Any]]
"""What structlog's ``capture_logs()`` collects: one mapping per log call."""


def message_lines(logs: LogLines, message_id: str) -> LogLines:
    return [line for line in logs if line.get("message_id") == message_id]


def assert_fields(line: MutableMapping[str, Any], *, consumer: str | None) -> None:
    where = f"{line['event']!r} line: {line}"
    assert "attempt" in line and isinstance(line["attempt"], int), where
    assert isinstance(line.get("outcome"), str) and line["outcome"], where
    if consumer is not None:
        assert line.get("consumer") == consumer, where


def fault_registry(calls: Counter[str]) -> Registry:
    registry = credit_registry("Credit")

    @registry.handler("Fails", CreditRequested, consumer="fails")
    async def fails(ctx: Context, message: CreditRequested) -> None:
        raise RuntimeError("boom")

    @registry.handler("Poison", CreditRequested, consumer="poison")
    async def poison(ctx: Context, message: CreditRequested) -> None:
        raise Poison("amount is not allowed")

    @registry.handler("Stale", CreditRequested, consumer="stale")
    async def stale(ctx: Context, message: CreditRequested) -> None:
        """Loses every race on its first delivery (another writer always committed first)."""
        calls["stale"] += 1
        calls["stale-deliveries"] += ctx.attempt == 1
        account = await ctx.session.get_one(Account, message.account_id)
        if calls["stale-deliveries"] == 1:
            set_committed_value(account, "version", account.version - 1)
        account.balance += message.amount

    return registry


async def run_logged(
    engine: AsyncEngine,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    *messages: tuple[str, str, Any],
) -> tuple[LogLines, MemoryBroker]:
    async with engine.begin() as connection:  # the account "stale" credits exists already
        await connection.execute(ACCOUNTS.insert().values(id="s", balance=0, version=1))
    broker = MemoryBroker()
    settings = make_settings(max_deliveries=2, retry_budget=0.05)
    calls: Counter[str] = Counter()
    with capture_logs() as logs:
        async with run_pumps([broker.connect()], [engine], fault_registry(calls), settings):
            for message_id, kind, body in messages:
                broker.publish(message_id, kind, body)
            await broker.wait_idle(timeout=30)
    return logs, broker


async def test_duplicate_lines_carry_the_message_fields(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    broker = MemoryBroker()
    with capture_logs() as logs:
        async with run_pumps(
            [broker.connect()], [engine], credit_registry("Credit"), make_settings()
        ):
            broker.publish("dup", "Credit", BODY, copies=2)  # a producer retry
            broker.publish("lost-ack", "Credit", BODY, lose_acks=1)  # the fast path
            await broker.wait_idle(timeout=20)
    for message_id in ("dup", "lost-ack"):
        [line] = [x for x in message_lines(logs, message_id) if x["event"] == "duplicate"]
        assert_fields(line, consumer="credit")
        assert line["outcome"] == "duplicate" and line["attempt"] == 1


async def test_failure_and_retry_lines_carry_the_message_fields(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    logs, broker = await run_logged(
        engine,
        make_settings,
        run_pumps,
        ("fails", "Fails", BODY),
        ("stale", "Stale", {"account_id": "s", "amount": "1"}),
    )
    assert verbs(broker, "fails") == ["nack", "dead-letter"]
    assert verbs(broker, "stale") == ["nack", "ack"]
    failed = [x for x in message_lines(logs, "fails") if x["event"] == "handler failed"]
    assert [x["outcome"] for x in failed] == ["nacked", "dead-lettered"]
    exhausted = [x for x in message_lines(logs, "stale") if x["event"] == "attempts-exhausted"]
    assert len(exhausted) == 1
    for line in [*failed, *exhausted]:
        assert_fields(line, consumer="fails" if line in failed else "stale")
    assert exhausted[0]["attempt"] > 1


async def test_dead_letter_lines_name_the_consumer_and_attempt(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """The dead-letter line is the one an operator greps for: it must say which handler
    gave up, on which attempt, not only the message id."""
    logs, broker = await run_logged(
        engine,
        make_settings,
        run_pumps,
        ("fails", "Fails", BODY),
        ("poison", "Poison", BODY),
    )
    assert verbs(broker, "fails") == ["nack", "dead-letter"]
    assert verbs(broker, "poison") == ["dead-letter"]
    for message_id, consumer in (("fails", "fails"), ("poison", "poison")):
        [line] = [x for x in message_lines(logs, message_id) if x["event"] == "dead-lettered"]
        assert_fields(line, consumer=consumer)
        assert line["attempt"] == 1


async def test_lines_about_a_message_no_handler_took_carry_attempt_and_outcome(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    logs, broker = await run_logged(
        engine,
        make_settings,
        run_pumps,
        ("unknown", "NoSuchType", BODY),
        ("invalid", "Credit", {"account_id": "a"}),
    )
    for message_id in ("unknown", "invalid"):
        assert verbs(broker, message_id) == ["dead-letter"]
        [line] = [x for x in message_lines(logs, message_id) if x["event"] == "dead-lettered"]
        assert_fields(line, consumer=None)
        assert line["attempt"] == 0 and line["outcome"] == "poison"


async def test_unexpected_error_lines_carry_attempt_and_outcome(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    broker = MemoryBroker()
    faulty = Faulty(broker.connect(), keep_alive_fails={"bug"})
    with capture_logs() as logs:
        async with run_pumps([faulty], [engine], credit_registry("Credit"), make_settings()):
            broker.publish("bug", "Credit", BODY)
            await broker.wait_idle(timeout=20)
    [line] = [x for x in message_lines(logs, "bug") if x["event"] == "unexpected error"]
    assert_fields(line, consumer=None)


@pytest.mark.postgres
async def test_paused_lines_carry_the_message_fields(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    from worker.db import create_engine

    engine = create_engine(postgres_only_url, pool_size=8)
    registry = Registry()
    runs = Counter[str]()

    @registry.handler("Report", CreditRequested, consumer="report")
    async def report(ctx: Context, message: CreditRequested) -> None:
        runs[ctx.message_id] += 1
        if runs[ctx.message_id] == 1:  # deployed before its migration ran
            await ctx.session.execute(text("SELECT * FROM reports_from_the_next_migration"))

    broker = MemoryBroker()
    settings = make_settings(database_url=postgres_only_url)
    try:
        with capture_logs() as logs:
            async with run_pumps([broker.connect()], [engine], registry, settings):
                broker.publish("m-1", "Report", BODY)
                await broker.wait_idle(timeout=30)
    finally:
        await engine.dispose()
    assert verbs(broker, "m-1") == ["nack", "ack"] and counts(broker, "m-1") == [1, 1]
    [line] = [x for x in message_lines(logs, "m-1") if x["event"] == "schema-behind"]
    assert_fields(line, consumer="report")
    assert line["outcome"] == "schema-behind"


async def test_settlement_trouble_lines_carry_attempt_and_outcome(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """The lines about a settlement that went wrong: settled twice, fallback failed, lost."""
    registry = credit_registry("Credit")

    @registry.handler("Slow", CreditRequested, consumer="slow")
    async def slow(ctx: Context, message: CreditRequested) -> None:
        if ctx.delivery_count == 1:
            await asyncio.sleep(0.6)  # past the broker's lock: the ack is refused

    broker = MemoryBroker(visibility_timeout=0.3)
    faulty = Faulty(broker.connect(), twice={"twice"}, keep_alive_fails={"bug"}, nack_fails={"bug"})
    with capture_logs() as logs:
        async with run_pumps([faulty], [engine], registry, make_settings()) as [pump]:
            broker.publish("twice", "Credit", BODY)
            broker.publish("bug", "Credit", BODY)
            broker.publish("slow", "Slow", BODY)
            await wait_for(
                lambda: pump.stats["settled-twice"] == 1, 20.0, "the second settle", step=0.01
            )
            await broker.wait_idle(timeout=20)
    assert pump.stats["settlement-lost"] >= 1 and pump.stats["settlement-failed"] >= 1
    for message_id, event in (
        ("twice", "bug: delivery settled twice"),
        ("bug", "settlement failed, broker will redeliver"),
        ("slow", "settlement lost, broker will redeliver"),
    ):
        [line, *_] = [x for x in message_lines(logs, message_id) if x["event"] == event]
        assert_fields(line, consumer="slow" if message_id == "slow" else None)
