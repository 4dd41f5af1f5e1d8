"""The pump's settlement table and its rules, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm.attributes import set_committed_value

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.database import ACCOUNTS, INBOX
from tests.support.pumps import MakeSettings, RunPumps
from worker import inbox
from worker.brokers.memory import MemoryBroker
from worker.db import insert_ignoring_conflicts
from worker.errors import Poison, Retry, TransactionOwnedByPump
from worker.inbox import InboxMarker
from worker.registry import Context, Registry


def verbs(broker: MemoryBroker, message_id: str) -> list[str]:
    return [verb for verb, mid, _ in broker.history if mid == message_id]


async def balance(engine: AsyncEngine, account: str) -> Decimal | None:
    async with engine.connect() as connection:
        return await connection.scalar(select(Account.balance).where(Account.id == account))


async def markers(engine: AsyncEngine, **where: str) -> int:
    stmt = select(func.count()).select_from(InboxMarker)
    for column, value in where.items():
        stmt = stmt.where(getattr(InboxMarker, column) == value)
    async with engine.connect() as connection:
        return int(await connection.scalar(stmt) or 0)


async def make_conflict(ctx: Context, account_id: str) -> Account:
    """Load the account and make its token stale, as if another writer had committed."""
    account = await ctx.session.get(Account, account_id)
    if account is None:
        account = Account(id=account_id, balance=Decimal(0))
        ctx.session.add(account)
        await ctx.session.flush()
    set_committed_value(account, "version", account.version - 1)
    return account


def table_registry(calls: Counter[str]) -> Registry:
    registry = Registry()
    registry.handler("Credit", CreditRequested, consumer="credit")(apply_credit)

    @registry.handler("Fails", CreditRequested, consumer="fails")
    async def fails(ctx: Context, message: CreditRequested) -> None:
        raise RuntimeError("boom")

    @registry.handler("Poison", CreditRequested, consumer="poison")
    async def poison(ctx: Context, message: CreditRequested) -> None:
        raise Poison("amount is not allowed")

    @registry.handler("AskRetry", CreditRequested, consumer="ask-retry")
    async def ask_retry(ctx: Context, message: CreditRequested) -> None:
        raise Retry("not yet", delay=0.0)

    @registry.handler("Stale", CreditRequested, consumer="stale")
    async def stale(ctx: Context, message: CreditRequested) -> None:
        """Loses every race on its first delivery: another writer always committed first."""
        calls["stale"] += 1
        calls["stale-deliveries"] += ctx.attempt == 1
        account = await ctx.session.get(Account, message.account_id)
        assert account is not None
        if calls["stale-deliveries"] == 1:
            set_committed_value(account, "version", account.version - 1)
        account.balance += message.amount

    @registry.handler("OrderNumberTaken", CreditRequested, consumer="orders")
    async def order_taken(ctx: Context, message: CreditRequested) -> None:
        await ctx.session.execute(text("INSERT INTO orders (id, number) VALUES (2, 'A-1')"))

    @registry.handler("Commits", CreditRequested, consumer="commits")
    async def commits(ctx: Context, message: CreditRequested) -> None:
        await ctx.session.commit()

    return registry


BODY = b'{"account_id": "a", "amount": "1.50"}'

# (message id, type, body, what the broker must see)
TABLE: list[tuple[str | None, str, bytes, list[str]]] = [
    ("ok", "Credit", BODY, ["ack"]),
    ("dup", "Credit", BODY, ["ack"]),  # its marker exists already: a duplicate
    ("fails", "Fails", BODY, ["nack", "nack", "dead-letter"]),
    ("poison", "Poison", BODY, ["dead-letter"]),
    ("ask-retry", "AskRetry", BODY, ["nack", "nack", "nack", "dead-letter"]),
    # its own, existing account: a first credit racing "ok" on account "a" would make this
    # a primary-key violation instead of a version conflict
    # contention is not the message's fault: the budget runs out, it is given back
    # uncounted, and its next delivery (still the first by count) commits
    ("stale", "Stale", b'{"account_id": "s", "amount": "1"}', ["nack", "ack"]),
    ("order", "OrderNumberTaken", BODY, ["nack", "nack", "dead-letter"]),
    ("commits", "Commits", BODY, ["nack", "nack", "dead-letter"]),
    ("not-json", "Credit", b"{not json", ["dead-letter"]),
    ("schema", "Credit", b'{"account_id": "a"}', ["dead-letter"]),
    ("extra", "Credit", b'{"account_id": "a", "amount": "1", "x": 1}', ["dead-letter"]),
    (None, "Credit", BODY, ["dead-letter"]),
    ("x" * 256, "Credit", BODY, ["dead-letter"]),  # a key the inbox cannot store
    ("unknown", "NoSuchType", BODY, ["dead-letter"]),
]


async def test_settlement_table(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            text("CREATE TABLE orders (id INTEGER PRIMARY KEY, number VARCHAR(20) UNIQUE)")
        )
        await connection.execute(text("INSERT INTO orders (id, number) VALUES (1, 'A-1')"))
        await connection.execute(INBOX.insert().values(message_id="dup", consumer="credit"))
        await connection.execute(ACCOUNTS.insert().values(id="s", balance=0, version=1))
    calls: Counter[str] = Counter()
    settings = make_settings(max_deliveries=3, max_attempts=2, retry_budget=2.0)
    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], table_registry(calls), settings) as pumps:
        for message_id, type_, body, _ in TABLE:
            broker.publish(message_id, type_, body)
        await broker.wait_idle(timeout=30)

    for message_id, _, _, expected in TABLE:
        assert verbs(broker, message_id) == expected, message_id  # type: ignore[arg-type]
    reasons = {d.message.message_id: d.reason for d in broker.dead_letters}
    assert reasons[None] == "no message id"
    assert reasons["x" * 256] == "message id longer than 255 characters"
    assert "no handler for message type 'NoSuchType'" in reasons["unknown"]
    assert reasons["not-json"].startswith("invalid body for Credit")
    assert "amount" in reasons["schema"] and "Field required" in reasons["schema"]
    assert "Extra inputs are not permitted" in reasons["extra"]
    assert reasons["poison"] == "poison: amount is not allowed"
    assert "RuntimeError: boom" in reasons["fails"]
    assert "IntegrityError" in reasons["order"]
    assert "TransactionOwnedByPump" in reasons["commits"]
    assert "stale" not in reasons
    assert calls["stale"] >= 3  # retried in process, then once more on its redelivery
    assert [c for v, mid, c in broker.history if mid == "stale"] == [1, 1]  # count unspent
    # the only credit applied is "ok"; the duplicate never ran the handler
    assert await balance(engine, "a") == Decimal("1.50")
    assert await markers(engine, consumer="credit") == 2
    assert await markers(engine, message_id="order") == 0  # all or nothing
    assert pumps[0].stats["duplicate"] == 1
    assert pumps[0].stats["committed"] == 2  # "ok", and "stale" on its second delivery


async def test_business_unique_violation_is_never_a_duplicate(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """Another table with the very same column names and its own unique constraint."""
    async with engine.begin() as connection:
        await connection.execute(
            text(
                "CREATE TABLE audit (id INTEGER PRIMARY KEY, message_id VARCHAR(255), "
                "consumer VARCHAR(255), CONSTRAINT uq_audit_message_consumer "
                "UNIQUE (message_id, consumer))"
            )
        )
        await connection.execute(text("INSERT INTO audit VALUES (1, 'm1', 'audited')"))
    registry = Registry()

    @registry.handler("Audit", CreditRequested, consumer="audited")
    async def audited(ctx: Context, message: CreditRequested) -> None:
        await ctx.session.execute(
            text("INSERT INTO audit (message_id, consumer) VALUES (:m, :c)"),
            {"m": ctx.message_id, "c": ctx.consumer},
        )

    broker = MemoryBroker()
    settings = make_settings(max_deliveries=2)
    async with run_pumps([broker.connect()], [engine], registry, settings) as pumps:
        broker.publish("m1", "Audit", BODY)
        await broker.wait_idle(timeout=10)
    assert verbs(broker, "m1") == ["nack", "dead-letter"]
    assert pumps[0].stats["duplicate"] == 0
    assert await markers(engine) == 0


async def test_handler_cannot_end_the_pumps_transaction(engine: AsyncEngine) -> None:
    from worker.context import session_factory

    session = session_factory(engine)()
    try:
        for method in (session.commit, session.rollback, session.close):
            with pytest.raises(TransactionOwnedByPump):
                await method()
    finally:
        from sqlalchemy.ext.asyncio import AsyncSession

        await AsyncSession.close(session)


async def test_retry_runs_on_a_fresh_session(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """After a failed flush the old session still holds its pending objects; the retry
    must not see them (MassTransit#4474)."""
    sessions: list[Any] = []
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        sessions.append(ctx.session)
        if len(sessions) == 1:
            ctx.session.add(Account(id="ghost", balance=Decimal(99)))
            account = await make_conflict(ctx, message.account_id)
            account.balance += message.amount
            return
        assert not ctx.session.new, "the retry inherited pending objects"
        await apply_credit(ctx, message)

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings()) as pumps:
        broker.publish("m1", "Credit", BODY)
        await broker.wait_idle(timeout=10)
    assert len(sessions) == 2 and sessions[0] is not sessions[1]
    assert verbs(broker, "m1") == ["ack"]
    assert pumps[0].stats["retried-conflict"] == 1
    assert await balance(engine, "ghost") is None
    assert await balance(engine, "a") == Decimal("1.50")


async def test_redelivery_uses_the_fast_path_and_first_delivery_does_not(
    engine: AsyncEngine,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks: list[str] = []
    real_seen, real_probe = inbox.seen, inbox.mark_redelivery

    async def counting_seen(session: Any, message_id: str, consumer: str) -> bool:
        checks.append(message_id)
        return await real_seen(session, message_id, consumer)

    async def counting_probe(session: Any, message_id: str, *args: Any, **kwargs: Any) -> bool:
        checks.append(message_id)  # PostgreSQL: the check that also bounds the marker's wait
        return await real_probe(session, message_id, *args, **kwargs)

    monkeypatch.setattr(inbox, "seen", counting_seen)
    monkeypatch.setattr(inbox, "mark_redelivery", counting_probe)
    registry = Registry()
    registry.handler("Credit", CreditRequested, consumer="credit")(apply_credit)
    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings()) as pumps:
        broker.publish("fresh", "Credit", BODY)
        broker.publish("crashed-before-ack", "Credit", BODY, lose_acks=1)
        await broker.wait_idle(timeout=10)
    assert checks == ["crashed-before-ack"]  # only the redelivery looked first
    assert pumps[0].stats["committed"] == 2 and pumps[0].stats["duplicate"] == 1
    assert await balance(engine, "a") == Decimal("3.00")


async def test_each_consumer_keeps_its_own_marker(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """Two handlers of one type: the second fails once; on the redelivery the first
    is deduplicated by its own marker and only the second runs again."""
    runs: Counter[str] = Counter()
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="ledger")
    async def ledger(ctx: Context, message: CreditRequested) -> None:
        runs["ledger"] += 1
        await apply_credit(ctx, message)

    @registry.handler("Credit", CreditRequested, consumer="flaky-audit")
    async def flaky(ctx: Context, message: CreditRequested) -> None:
        runs["audit"] += 1
        if runs["audit"] == 1:
            raise RuntimeError("audit store hiccup")

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings()):
        broker.publish("m1", "Credit", BODY)
        await broker.wait_idle(timeout=10)
    assert verbs(broker, "m1") == ["nack", "ack"]
    assert runs == {"ledger": 1, "audit": 2}
    assert await markers(engine, message_id="m1", consumer="ledger") == 1
    assert await markers(engine, message_id="m1", consumer="flaky-audit") == 1
    assert await balance(engine, "a") == Decimal("1.50")


async def test_opt_out_handler_writes_no_marker(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    registry = Registry()

    @registry.handler("SetBalance", CreditRequested, consumer="set-balance", inbox=False)
    async def set_balance(ctx: Context, message: CreditRequested) -> None:
        row = {"id": message.account_id, "balance": message.amount, "version": 1}
        await ctx.session.execute(insert_ignoring_conflicts(ctx.session, Account).values(row))
        account = await ctx.session.get_one(Account, message.account_id)
        account.balance = message.amount  # absolute: idempotent by nature

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings()):
        broker.publish("m1", "SetBalance", BODY, copies=3)
        await broker.wait_idle(timeout=10)
    assert verbs(broker, "m1") == ["ack", "ack", "ack"]
    assert await markers(engine) == 0
    assert await balance(engine, "a") == Decimal("1.50")


async def held(broker: MemoryBroker, times: int) -> None:
    """``times`` consumers take the next message and die holding it, never starting it."""
    for _ in range(times):
        crasher = broker.connect()
        await crasher.start(prefetch=1)
        await crasher.receive()
        crasher.crash()


async def test_past_max_deliveries_by_the_brokers_count_is_dead_lettered_before_running(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """WORKER_DELIVERY_COUNTS=broker trusts the broker's count, returns included."""
    runs: list[int] = []
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        runs.append(ctx.delivery_count)

    broker = MemoryBroker()
    broker.publish("m1", "Credit", BODY)
    await held(broker, 3)  # three workers died while holding it
    settings = make_settings(max_deliveries=3, delivery_counts="broker")
    async with run_pumps([broker.connect()], [engine], registry, settings):
        await broker.wait_idle(timeout=10)
    assert runs == []
    assert verbs(broker, "m1") == ["dead-letter"]
    assert "delivered 4 times" in broker.dead_letters[0].reason


async def test_a_delivery_only_held_when_its_process_died_spends_no_count(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """Counted in the database (the default), a delivery's count is the starts it had: three
    deaths while it was only held leave it where its first delivery put it."""
    runs: list[int] = []
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        runs.append(ctx.delivery_count)

    broker = MemoryBroker()
    broker.publish("m1", "Credit", BODY)
    await held(broker, 3)
    async with run_pumps([broker.connect()], [engine], registry, make_settings(max_deliveries=3)):
        await broker.wait_idle(timeout=10)
    assert runs == [2]  # the broker says 4; its first delivery is taken to have started
    assert verbs(broker, "m1") == ["ack"]


async def test_past_max_started_deliveries_is_dead_lettered_before_running(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """A message whose starts killed the process three times never runs a fourth."""
    runs: list[int] = []
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        runs.append(ctx.delivery_count)

    async with engine.begin() as connection:  # three starts after the first were recorded
        await connection.execute(
            text(
                "INSERT INTO delivery_counts (message_id, consumer, deliveries) "
                "VALUES ('m1', 'credit', 3)"
            )
        )
    broker = MemoryBroker()
    broker.publish("m1", "Credit", BODY)
    await held(broker, 1)  # the last death: it comes back a suspect
    async with run_pumps([broker.connect()], [engine], registry, make_settings(max_deliveries=3)):
        await broker.wait_idle(timeout=10)
    assert runs == []
    assert verbs(broker, "m1") == ["dead-letter"]
    assert "delivered 5 times" in broker.dead_letters[0].reason


@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
async def test_serialization_failure_and_deadlock_are_retried(
    postgres_only_url: str, sqlstate: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    from worker.db import create_engine

    engine = create_engine(postgres_only_url)
    attempts: list[int] = []
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        attempts.append(ctx.attempt)
        await apply_credit(ctx, message)
        if ctx.attempt == 1:  # a real server error carrying the SQLSTATE
            await ctx.session.execute(
                text(
                    f"DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '{sqlstate}'; END $$"
                )
            )

    broker = MemoryBroker()
    settings = make_settings(database_url=postgres_only_url)
    try:
        async with run_pumps([broker.connect()], [engine], registry, settings) as pumps:
            broker.publish("m1", "Credit", BODY)
            await broker.wait_idle(timeout=10)
        assert attempts == [1, 2]
        assert verbs(broker, "m1") == ["ack"]
        assert pumps[0].stats["retried-transient"] == 1
        assert await balance(engine, "a") == Decimal("1.50")
    finally:
        await engine.dispose()


async def test_in_process_attempts_exhausted_nack_then_succeed(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """A hot row that keeps conflicting: retries until the time budget is spent, then the
    broker redelivers it with its delivery count unspent (contention is no fault of its own)."""
    registry = Registry()
    deliveries = Counter[str]()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        deliveries["m"] += ctx.attempt == 1
        if deliveries["m"] == 1:
            account = await make_conflict(ctx, message.account_id)
            account.balance += message.amount
        else:
            await apply_credit(ctx, message)

    broker = MemoryBroker()
    settings = make_settings(max_attempts=1, retry_budget=1.0)
    async with run_pumps([broker.connect()], [engine], registry, settings) as pumps:
        broker.publish("m1", "Credit", BODY)
        await broker.wait_idle(timeout=10)
    assert broker.history == [("nack", "m1", 1), ("ack", "m1", 1)]
    assert pumps[0].stats["retried-conflict"] > 1  # beyond max_attempts: the budget bounds it
    assert pumps[0].stats["attempts-exhausted"] == 1
    assert await balance(engine, "a") == Decimal("1.50")


@pytest.mark.parametrize("group", [1, 2])
async def test_graceful_stop_settles_in_flight_and_leaves_the_rest(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, group: int
) -> None:
    """The unit of work in flight (one delivery, or a group of ``group``) finishes and is
    acked; what was only prefetched is left to the broker untouched."""
    started = asyncio.Event()
    registry = Registry()

    @registry.handler("Slow", CreditRequested, consumer="slow")
    async def slow(ctx: Context, message: CreditRequested) -> None:
        started.set()
        await asyncio.sleep(0.05)  # fast enough to share a group (worker/intake.py)
        await apply_credit(ctx, message)

    broker = MemoryBroker()
    settings = make_settings(concurrency=1, batch_size=group)
    async with run_pumps([broker.connect()], [engine], registry, settings):
        if group > 1:  # a type's first unit runs alone, until its deliveries' time is known
            broker.publish("learn", "Slow", BODY)
            await broker.wait_idle(10)
            started.clear()
            del broker.history[:]
        for n in range(5):
            broker.publish(f"m{n}", "Slow", BODY)
        await asyncio.wait_for(started.wait(), 5)
    # the in-flight work finished and was acked; the others never ran: left to the broker,
    # or (prefetched) given back uncounted
    assert [verb for verb, _, _ in broker.history if verb != "nack"] == ["ack"] * group
    assert broker.stats["nacked"] == broker.stats["nacked_uncounted"]
    assert len(broker.ready) == 5 - group and broker.in_flight == 0
    assert all(message.delivery_count == 0 for message in broker.ready)  # nothing spent
    assert await markers(engine) == group + (group > 1)


async def test_a_failing_receive_does_not_retire_the_worker(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    broker = MemoryBroker()
    consumer = broker.connect()
    real_receive = consumer.receive
    calls = 0

    async def flaky_receive() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("adapter bug")
        return await real_receive()

    consumer.receive = flaky_receive  # type: ignore[method-assign]
    registry = Registry()
    registry.handler("Credit", CreditRequested, consumer="credit")(apply_credit)
    async with run_pumps([consumer], [engine], registry, make_settings(concurrency=1)):
        broker.publish("m1", "Credit", BODY)
        await broker.wait_idle(timeout=10)
    assert verbs(broker, "m1") == ["ack"]


@pytest.mark.parametrize("door", ["run_sync", "sync_session", "connection"])
async def test_side_doors_to_commit_are_closed_too(
    door: str, engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """A commit inside a handler would keep its writes although the message then fails."""
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def sneaky(ctx: Context, message: CreditRequested) -> None:
        await apply_credit(ctx, message)
        if door == "run_sync":
            await ctx.session.run_sync(lambda session: session.commit())
        elif door == "sync_session":
            ctx.session.sync_session.commit()
        else:
            await (await ctx.session.connection()).commit()
        raise RuntimeError("failed after committing")

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings(max_deliveries=1)):
        broker.publish("m1", "Credit", BODY)
        await broker.wait_idle(timeout=10)
    assert "TransactionOwnedByPump" in broker.dead_letters[0].reason
    assert await balance(engine, "a") is None
    assert await markers(engine) == 0
