"""Batch mode (worker/batch.py) on SQLite and PostgreSQL with the memory broker: exactly once,
one message's failure stays its own, whole-transaction failures retry then fall back without
spending innocent messages' delivery counts, and the settings and registrations it refuses."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, defaultdict
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Numeric, bindparam, event, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from handlers.credit import Account, CreditRequested, apply_credit
from tests.support.pumps import LEARNED, MakeSettings, RunPumps, learned, running_pump
from tests.support.waiting import wait_for
from worker.brokers.memory import MemoryBroker, MemoryConsumer
from worker.delivery import Delivery
from worker.errors import ConfigurationError, Poison, PreconditionFailed
from worker.inbox import InboxMarker
from worker.intake import Work
from worker.middleware import NextWork
from worker.registry import BatchContext, Context, Registry
from worker.settings import Settings, load, unknown_variables
from worker.verdict import Verdict

ACCOUNTS = 40


def body(account: str, amount: str | Decimal) -> bytes:
    return f'{{"account_id": "{account}", "amount": "{amount}"}}'.encode()


async def balances(engine: AsyncEngine) -> dict[str, Decimal]:
    async with engine.connect() as connection:
        rows = await connection.execute(select(Account.id, Account.balance))
        return {row[0]: Decimal(row[1]) for row in rows}


async def marker_counts(engine: AsyncEngine) -> Counter[str]:
    async with engine.connect() as connection:
        rows = await connection.execute(select(InboxMarker.message_id))
        return Counter(rows.scalars())


def history(broker: MemoryBroker, message_id: str) -> list[tuple[str, int]]:
    return [(verb, count) for verb, mid, count in broker.history if mid == message_id]


_UPSERT = text(
    "INSERT INTO accounts (id, balance, version) VALUES (:a, :x, 1) "
    "ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + excluded.balance, "
    "version = accounts.version + 1"
).bindparams(bindparam("x", type_=Numeric(18, 2)))


async def upsert_credits(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
    """A set-based batch handler: one atomic upsert per account, accounts in a fixed order."""
    totals: dict[str, Decimal] = defaultdict(Decimal)
    for message in messages:
        totals[message.account_id] += message.amount
    for account, amount in sorted(totals.items()):
        await ctx.session.execute(_UPSERT, {"a": account, "x": amount})


def credit_registry(shape: str) -> Registry:
    registry = Registry()
    if shape == "orm":  # the reference handler, unchanged, without a key: one savepoint each
        registry.handler("Credit", CreditRequested, consumer="credit")(apply_credit)
    else:
        registry.handler("Credit", CreditRequested, consumer="credit", batch=True)(upsert_credits)
    return registry


# -- exactly once ----------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["orm", "set-based"])
async def test_two_batch_pumps_apply_every_credit_once(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, shape: str
) -> None:
    settings = make_settings(batch_size=8, concurrency=3)
    broker = MemoryBroker()
    expected: dict[str, Decimal] = defaultdict(Decimal)
    ids = []
    async with run_pumps(
        [broker.connect(), broker.connect()], [engine], credit_registry(shape), settings
    ) as pumps:
        for n in range(120):
            account, amount = f"acct-{n % ACCOUNTS}", Decimal(n % 7 + 1)
            expected[account] += amount
            ids.append(f"m-{n}")
            raw = body(account, amount)
            if n % 10 == 0:  # a producer retry: both copies in the same batch, most likely
                broker.publish(f"m-{n}", "Credit", raw, copies=2)
            elif n % 10 == 1:  # one copy to each pump at once
                broker.publish(f"m-{n}", "Credit", raw, to_all=True)
            elif n % 10 == 2:  # the ack after the commit is lost: a redelivery later
                broker.publish(f"m-{n}", "Credit", raw, lose_acks=1)
            else:
                broker.publish(f"m-{n}", "Credit", raw)
        for n in range(3, 120, 10):  # the same ids again, long after: across batches
            broker.publish(f"m-{n}", "Credit", body(f"acct-{n % ACCOUNTS}", Decimal(n % 7 + 1)))
        await broker.wait_idle(30)
    assert await balances(engine) == expected
    assert await marker_counts(engine) == Counter(ids)  # one marker per message
    assert broker.dead_letters == []
    committed = sum(p.stats["committed"] for p in pumps)
    assert committed == 120
    assert sum(p.stats["duplicates-batch"] for p in pumps) > 0
    assert all(verb == "ack" for verb, _, _ in broker.history)


# -- keyed handlers: key-affinity batches ------------------------------------------------


class KeySpans:
    """A work middleware: the keys of every unit of work a worker ran, and when it ran."""

    def __init__(self) -> None:
        self.spans: list[tuple[frozenset[Any], float, float]] = []

    async def __call__(self, work: Work, call_next: NextWork) -> list[Verdict]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            return await call_next(work)
        finally:
            keys = frozenset(item.key for item in work.items)
            self.spans.append((keys, started, loop.time()))


async def test_keyed_handlers_batch_by_key_in_arrival_order_in_one_transaction(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    """The shipped handler's shape (ORM read-modify-write, keyed by account) in batch
    mode: same-key deliveries share a batch, in arrival order, in the batch's session
    (with no savepoint of their own while nothing fails: the shared pass), where the
    identity map hands each credit the row the one before it changed (one read per key
    and batch, no conflict); batches running at the same time hold disjoint keys."""
    keys, per_key = 8, 8
    async with engine.begin() as connection:  # rows exist: a read per key, never an insert
        for k in range(keys):
            await connection.execute(text(f"INSERT INTO accounts VALUES ('acct-{k}', 0, 1)"))
    calls: list[tuple[Any, str, int, bool]] = []  # (session, key, sequence, in a savepoint)
    rows: dict[tuple[int, str], Account] = {}
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", key=lambda m: m.account_id)
    async def credit(ctx: Context, message: CreditRequested) -> None:
        session, key = ctx.session, message.account_id
        calls.append((session, key, int(ctx.message_id[2:]), session.in_nested_transaction()))
        await apply_credit(ctx, message)
        account = await session.get_one(Account, key)  # the identity map: no statement
        first = rows.setdefault((id(session), key), account)
        assert first is account
        await asyncio.sleep(0.005)  # long enough for the other workers' batches to overlap

    reads: list[str] = []

    def count_reads(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "FROM accounts" in statement:
            reads.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", count_reads)
    broker = MemoryBroker()
    for n in range(keys * per_key):
        broker.publish(f"m-{n}", "Credit", body(f"acct-{n % keys}", "1.00"))
    spans = KeySpans()
    settings = make_settings(batch_size=8, concurrency=3)
    try:
        async with running_pump(
            broker.connect(), engine, registry, settings, middleware=[spans]
        ) as pump:
            await broker.wait_idle(30)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", count_reads)
    assert await balances(engine) == {f"acct-{k}": Decimal(per_key) for k in range(keys)}
    assert sorted(broker.history) == sorted(("ack", f"m-{n}", 1) for n in range(keys * per_key))
    assert pump.stats["batch-deferred"] == pump.stats["batch-fallback"] == 0
    assert not any(name.startswith("retried-") for name in pump.stats)  # no conflict at all
    # nothing failed: no savepoint per delivery; a key's credits in arrival order
    assert not any(nested for *_, nested in calls)
    assert pump.stats["batch-isolated"] == 0
    for k in range(keys):
        sequence = [n for _, key, n, _ in calls if key == f"acct-{k}"]
        assert sequence == sorted(sequence) == list(range(k, keys * per_key, keys))
    sessions: dict[int, list[str]] = defaultdict(list)
    for session, key, _, _ in calls:
        sessions[id(session)].append(key)
    batched = [ks for ks in sessions.values() if len(ks) > len(set(ks))]
    assert batched, "no batch held two deliveries of one key"
    # one read per key and batch: the second credit of a key took the row from the map
    assert len(reads) == sum(len(set(ks)) for ks in sessions.values())
    # batches that ran at the same time held disjoint keys (and some did run at once)
    overlapping = [
        (a, b) for a, b in itertools.combinations(spans.spans, 2) if a[1] < b[2] and b[1] < a[2]
    ]
    assert overlapping, "no two batches ran at once: the check below proves nothing"
    assert all(not (a[0] & b[0]) for a, b in overlapping)


async def test_a_deferred_message_takes_its_twin_along(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """A message deferred inside its group (here: a rejection, recorded on its own after
    the group commits) runs again alone. A copy of it that arrived with it (a producer
    retry) never shares its group (intake keeps one id per group): it runs as its own unit
    and must end acked as its duplicate, never unsettled."""
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        if message.account_id == "closed":
            raise PreconditionFailed("account closed", subject=message.account_id)
        await apply_credit(ctx, message)

    settings = make_settings(batch_size=8, concurrency=1)
    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, settings):
        broker.publish("m-open", "Credit", body("acct-1", "1.00"))
        broker.publish("m-closed", "Credit", body("closed", "1.00"), copies=2)
        broker.publish("m-open-2", "Credit", body("acct-1", "2.00"))
        await broker.wait_idle(10)
    assert history(broker, "m-closed") == [("ack", 1), ("ack", 1)]  # recorded, and its twin
    assert await balances(engine) == {"acct-1": Decimal("3.00")}
    assert await marker_counts(engine) == Counter(["m-open", "m-open-2", "m-closed"])


# -- one message's failure stays its own ------------------------------------------------


def failing_registry(sessions: list[Any]) -> Registry:
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        sessions.append(ctx.session)  # kept alive: an id() could be reused
        await apply_credit(ctx, message)  # written first, so a rollback has something to undo
        account = message.account_id
        if account == "poison":
            raise Poison("amount not allowed")
        if account == "fails":
            raise RuntimeError("boom")
        if account == "order":  # a business unique violation, not the inbox's
            await ctx.session.execute(text("INSERT INTO orders (id, number) VALUES (2, 'A-1')"))

    return registry


async def test_failures_inside_a_batch_stay_their_own(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            text("CREATE TABLE orders (id INTEGER PRIMARY KEY, number VARCHAR(20) UNIQUE)")
        )
        await connection.execute(text("INSERT INTO orders (id, number) VALUES (1, 'A-1')"))
    settings = make_settings(batch_size=5, concurrency=1, max_deliveries=2)
    broker = MemoryBroker()
    sessions: list[Any] = []
    async with run_pumps([broker.connect()], [engine], failing_registry(sessions), settings) as [
        pump
    ]:
        await learned(broker)
        del sessions[:]
        for n, account in enumerate(["ok-1", "poison", "fails", "order", "ok-2"]):
            broker.publish(f"m-{account}", "Credit", body(account, f"{n + 1}.00"))
        await broker.wait_idle(20)
    # A shared pass stops at a failure: the first at poison (judged on that failure, not
    # run again), the second at fails; then the other four ran in savepoints of one
    # transaction, each failure its own.
    first, second, third = sessions[0], sessions[2], sessions[4]
    assert sessions[1] is first and sessions[3] is second
    assert first is not second and second is not third and third is not first
    assert all(session is third for session in sessions[4:8])
    assert pump.stats["batch-isolated"] == 2
    assert await balances(engine) == {
        "ok-1": Decimal("1.00"),
        "ok-2": Decimal("5.00"),
        LEARNED: Decimal(0),
    }
    assert set(await marker_counts(engine)) == {"m-ok-1", "m-ok-2", "learn-Credit"}
    assert history(broker, "m-ok-1") == [("ack", 1)]
    assert history(broker, "m-ok-2") == [("ack", 1)]
    assert history(broker, "m-poison") == [("dead-letter", 1)]
    assert history(broker, "m-fails") == [("nack", 1), ("dead-letter", 2)]
    assert history(broker, "m-order") == [("nack", 1), ("dead-letter", 2)]
    reasons = {d.message.message_id: d.reason for d in broker.dead_letters}
    assert "amount not allowed" in reasons["m-poison"]
    assert "RuntimeError: boom" in reasons["m-fails"]
    assert "IntegrityError" in reasons["m-order"]
    assert pump.stats["batch-fallback"] == 0  # handled inside the batch, not by falling back


async def test_a_write_flushed_late_in_the_shared_pass_fails_its_own_message(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """In the shared pass a message's pending write is flushed by the next message's
    query, so the database error shows in the next handler, which may wrap it in an
    error of its own. That error is not the next message's: the batch goes round with a
    savepoint each, where the write fails in the message that made it."""
    async with engine.begin() as connection:
        await connection.execute(text("INSERT INTO accounts VALUES ('taken', 0, 1)"))
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        if message.account_id == "taken":  # a new account that is not new: fails at a flush
            ctx.session.add(Account(id="taken", balance=message.amount, version=1))
            return
        try:
            await ctx.session.scalars(select(Account).where(Account.id == message.account_id))
        except IntegrityError as exc:
            raise RuntimeError("could not look the account up") from exc
        await apply_credit(ctx, message)

    settings = make_settings(batch_size=2, concurrency=1, max_deliveries=1)
    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, settings) as [pump]:
        await learned(broker)
        broker.publish("m-taken", "Credit", body("taken", "5.00"))
        broker.publish("m-free", "Credit", body("free", "1.00"))
        await broker.wait_idle(20)
    assert history(broker, "m-free") == [("ack", 1)]  # not blamed for the other's write
    assert history(broker, "m-taken") == [("dead-letter", 1)]
    assert await balances(engine) == {"taken": Decimal(0), "free": Decimal(1), LEARNED: 0}
    assert pump.stats["batch-isolated"] == 1


# -- whole-transaction failures: retry once, then one at a time ---------------------------


@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
async def test_a_failing_batch_retries_then_falls_back_without_spending_counts(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps, sqlstate: str
) -> None:
    from worker.db import create_engine

    engine = create_engine(postgres_only_url, pool_size=5)
    calls: list[int] = []
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", batch=True)
    async def credit(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
        calls.append(len(messages))
        await upsert_credits(ctx, messages)
        if len(messages) > 1:  # every batch loses, as if to another transaction
            await ctx.session.execute(
                text(f"DO $$ BEGIN RAISE EXCEPTION 'lost' USING ERRCODE = '{sqlstate}'; END $$")
            )

    settings = make_settings(database_url=postgres_only_url, batch_size=4, concurrency=1)
    broker = MemoryBroker()
    try:
        async with run_pumps([broker.connect()], [engine], registry, settings) as [pump]:
            await learned(broker)
            del calls[:]
            for n in range(4):
                broker.publish(f"m-{n}", "Credit", body(f"acct-{n % 2}", "1.00"))
            await broker.wait_idle(20)
        assert calls == [4, 4, 1, 1, 1, 1]  # the batch, its retry, then one at a time
        assert pump.stats["batch-retried"] == 1 and pump.stats["batch-fallback"] == 1
        assert sorted(broker.history) == [("ack", "learn-Credit", 1)] + [
            ("ack", f"m-{n}", 1) for n in range(4)
        ]
        assert await balances(engine) == {"acct-0": 2, "acct-1": 2, LEARNED: 0}
        assert set(await marker_counts(engine)) == {"learn-Credit", *(f"m-{n}" for n in range(4))}
    finally:
        await engine.dispose()


async def test_a_savepoint_that_loses_a_deadlock_runs_again_on_its_own(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    from worker.db import create_engine

    engine = create_engine(postgres_only_url, pool_size=5)
    lost: set[str] = set()
    sessions: dict[str, list[Any]] = defaultdict(list)
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        sessions[ctx.message_id].append(ctx.session)  # kept alive: ids could be reused
        await apply_credit(ctx, message)
        # m-2 loses in the shared pass (the batch goes round with savepoints) and in its
        # savepoint (it is deferred), then wins on its own
        if ctx.message_id == "m-2" and len(sessions["m-2"]) < 3:
            lost.add("m-2")
            await ctx.session.execute(
                text("DO $$ BEGIN RAISE EXCEPTION 'deadlock' USING ERRCODE = '40P01'; END $$")
            )

    settings = make_settings(database_url=postgres_only_url, batch_size=4, concurrency=1)
    broker = MemoryBroker()
    try:
        async with run_pumps([broker.connect()], [engine], registry, settings) as [pump]:
            await learned(broker)
            for n in range(4):
                broker.publish(f"m-{n}", "Credit", body(f"acct-{n}", "1.00"))
            await broker.wait_idle(20)
        assert sorted(broker.history) == [("ack", "learn-Credit", 1)] + [
            ("ack", f"m-{n}", 1) for n in range(4)
        ]
        assert await balances(engine) == {LEARNED: 0, **{f"acct-{n}": 1 for n in range(4)}}
        shared, savepoints, alone = sessions["m-2"]  # and once more on its own
        assert sessions["m-0"] == [shared, savepoints] and shared is not savepoints
        assert alone is not savepoints and alone is not shared
        assert pump.stats["batch-deferred"] == 1 and pump.stats["batch-fallback"] == 0
        assert pump.stats["batch-isolated"] == 1
    finally:
        await engine.dispose()


# -- refusals ------------------------------------------------------------------------------


def test_a_batch_handler_cannot_be_a_side_effect_or_keyed() -> None:
    registry = Registry()
    with pytest.raises(ConfigurationError, match=r"'notify'.*side_effect"):
        registry.handler("N", CreditRequested, consumer="notify", batch=True, side_effect=True)(
            upsert_credits
        )
    with pytest.raises(ConfigurationError, match=r"'keyed'.*key="):
        registry.handler(
            "K", CreditRequested, consumer="keyed", batch=True, key=lambda m: m.account_id
        )(upsert_credits)
    assert list(registry) == []


@pytest.mark.parametrize(
    ("variable", "value"),
    [("WORKER_BATCH_SIZE", "0"), ("WORKER_BATCH_SIZE", "many"), ("WORKER_BATCH_SIZE", "1001")],
)
def test_bad_batch_settings_are_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError) as refused:
        load(Settings, check=False)
    message = str(refused.value)
    assert message.startswith(f"{variable}=") and "\n" not in message


def test_batch_settings_are_known_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_BATCH_SIZE", "64")
    settings = load(Settings, check=False)
    assert settings.batch_size == 64
    assert unknown_variables(Settings, {"WORKER_BATCH_SIZE": "64"}) == []
    # a group never waits for company: there is nothing to wait for, so nothing to set
    [unknown] = unknown_variables(Settings, {"WORKER_BATCH_WAIT": "1"})
    assert unknown.startswith("WORKER_BATCH_WAIT")
    monkeypatch.delenv("WORKER_BATCH_SIZE")
    assert Settings().batch_size == 32  # group commit by default; 1 turns it off


async def test_a_batch_handler_outside_batch_mode_gets_one_message(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    sizes: list[int] = []
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", batch=True)
    async def credit(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
        sizes.append(len(messages))
        assert ctx.message_ids == [ctx.message(0).message_id]
        await upsert_credits(ctx, messages)

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings(batch_size=1)):
        for n in range(3):
            broker.publish(f"m-{n}", "Credit", body("a", "1"))
        await broker.wait_idle(10)
    assert sizes == [1, 1, 1]
    assert await balances(engine) == {"a": Decimal(3)}


async def test_the_prefetch_holds_two_groups_and_a_delivery_per_worker(
    make_settings: MakeSettings,
) -> None:
    """Two full groups (one running, one filling) at least; a delivery per worker, three
    when keys serialize; no more, so what one replica holds another could run."""
    from worker.db import create_engine
    from worker.pump import Pump

    engine = create_engine("sqlite+aiosqlite:///unused.db")
    keyed = Registry()
    keyed.handler("Credit", CreditRequested, consumer="credit", key=lambda m: m.account_id)(
        apply_credit
    )

    def prefetch(registry: Registry, **values: Any) -> int:
        settings = make_settings(**values)
        return Pump(MemoryBroker().connect(), engine, registry, settings).prefetch

    try:
        plain = credit_registry("orm")
        assert prefetch(plain, concurrency=64, batch_size=64) == 65 * 64
        assert prefetch(plain, concurrency=16, batch_size=32) == 17 * 32  # the defaults
        assert prefetch(plain, concurrency=64, batch_size=1) == 64
        assert prefetch(keyed, concurrency=64, batch_size=32) == 65 * 32
        assert prefetch(keyed, concurrency=16, batch_size=1) == 3 * 16
        assert prefetch(keyed, concurrency=1024, batch_size=1000) == 8192  # the most
    finally:
        await engine.dispose()


# -- adapter seams: group and in_transaction ------------------------------------------------


class PartitionedConsumer(MemoryConsumer):
    """Deliveries grouped by a ``p`` header (a Kafka partition), each storing its "offset"
    in the handler's transaction, as the Kafka adapter does."""

    writes_in_commit = True

    def __init__(self, broker: MemoryBroker, stored: list[str]) -> None:
        super().__init__(broker)
        self.stored = stored

    def accept(self, flight: Any) -> None:
        super().accept(flight)
        delivery: Delivery = flight.delivery
        delivery.group = delivery.headers.get("p")

    async def in_commit(self, session: Any, handles: Sequence[Any]) -> None:
        assert session.in_transaction()
        self.stored.extend(str(handle.delivery.message_id) for handle in handles)


async def test_a_batch_keeps_to_one_group_in_receive_order_and_stores_each_commit(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    batches: list[list[tuple[str, str]]] = []
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", batch=True)
    async def credit(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
        if len(messages) > 1 and any(m.account_id == "bad" for m in messages):
            raise RuntimeError("the batch fails; one at a time, only 'bad' fails")
        if messages[0].account_id == "bad":
            raise RuntimeError("bad")
        batches.append([(ctx.headers[i]["p"], ctx.message_ids[i]) for i in range(len(messages))])
        await upsert_credits(ctx, messages)

    broker = MemoryBroker()
    stored: list[str] = []
    for n in range(12):
        account = "bad" if n == 7 else "a"
        broker.publish(f"m-{n}", "Credit", body(account, "1"), {"p": n % 2})
    broker.publish("m-0", "Credit", body("a", "1"), {"p": 0})  # a duplicate: stores nothing
    settings = make_settings(batch_size=4, concurrency=1, max_deliveries=1)
    consumer = PartitionedConsumer(broker, stored)
    broker.consumers.append(consumer)
    async with run_pumps([consumer], [engine], registry, settings):
        await broker.wait_idle(20)
    for batch in batches:  # groups share a transaction; each group's records in order
        for group in {p for p, _ in batch}:
            ids = [int(m.split("-")[1]) for p, m in batch if p == group]
            assert ids == sorted(ids)  # receive order
    assert sorted(stored, key=lambda m: int(m.split("-")[1])) == [
        f"m-{n}" for n in range(12) if n != 7
    ]  # each committed delivery's hook ran in its commit, once; the failed one's did not
    assert [d.message.message_id for d in broker.dead_letters] == ["m-7"]
    assert await balances(engine) == {"a": Decimal(11)}


async def test_keyed_batches_keep_each_group_in_receive_order(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """A keyed handler in batch mode on a partitioned transport: a record whose key a
    running batch of its partition holds must not fall behind the partition's later
    records (a Kafka partition runs in offset order, whatever the keys)."""
    order: list[tuple[int, int]] = []  # (group, sequence) in the order the handler ran them
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", key=lambda m: m.account_id)
    async def credit(ctx: Context, message: CreditRequested) -> None:
        order.append((ctx.headers["p"], int(ctx.message_id[2:])))
        await apply_credit(ctx, message)
        await asyncio.sleep(0.002)

    broker = MemoryBroker()
    stored: list[str] = []
    total = 48
    for n in range(total):  # keys k0, k2, k4 in group 0; k1, k3, k5 in group 1
        broker.publish(f"m-{n}", "Credit", body(f"k{n % 6}", "1"), {"p": n % 2})
    settings = make_settings(batch_size=4, concurrency=2)
    consumer = PartitionedConsumer(broker, stored)
    broker.consumers.append(consumer)
    async with run_pumps([consumer], [engine], registry, settings):
        await broker.wait_idle(30)
    for group in (0, 1):
        sequence = [n for g, n in order if g == group]
        assert sequence == list(range(group, total, 2)), f"group {group} out of order"
    assert await balances(engine) == {f"k{k}": Decimal(total // 6) for k in range(6)}


async def test_what_batch_mode_leaves_to_the_per_message_path(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """First deliveries share batches; a suspect (taken back from a consumer that died
    holding it) runs with nothing beside it."""
    calls: list[list[str]] = []
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", batch=True)
    async def credit(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
        calls.append(list(ctx.message_ids))
        await upsert_credits(ctx, messages)

    broker = MemoryBroker()
    broker.publish("suspect", "Credit", body("a", "1"))
    crashed = broker.connect()
    await crashed.start(prefetch=1)
    await crashed.receive()
    crashed.crash()  # died holding it: it comes back a suspect
    for n in range(4):
        broker.publish(f"m-{n}", "Credit", body("a", "1"))
    settings = make_settings(batch_size=8, concurrency=2)
    async with run_pumps([broker.connect()], [engine], registry, settings):
        await broker.wait_idle(20)
    assert ["suspect"] in calls  # alone
    assert sorted(m for call in calls for m in call if m != "suspect") == [
        f"m-{n}" for n in range(4)
    ]
    assert [call for call in calls if "suspect" in call] == [["suspect"]]
    assert await balances(engine) == {"a": Decimal(5)}


async def test_one_group_runs_one_batch_at_a_time_in_order_while_groups_overlap(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """A Kafka partition's order holds across batches: a ripe batch released while its
    group's previous one still runs waits for it; other groups use the other workers."""
    spans: list[tuple[Any, list[int], float, float]] = []
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit", batch=True)
    async def credit(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
        started = asyncio.get_running_loop().time()
        await asyncio.sleep(0.05)  # long enough for the next batch of the group to ripen
        await upsert_credits(ctx, messages)
        ids = [int(m.split("-")[1]) for m in ctx.message_ids]
        group = ctx.headers[0]["p"]
        spans.append((group, ids, started, asyncio.get_running_loop().time()))

    broker = MemoryBroker()
    stored: list[str] = []
    for n in range(40):
        broker.publish(f"m-{n}", "Credit", body("a" if n % 2 else "b", "1"), {"p": n % 2})
    settings = make_settings(batch_size=3, concurrency=4)
    consumer = PartitionedConsumer(broker, stored)
    broker.consumers.append(consumer)
    async with run_pumps([consumer], [engine], registry, settings):
        await broker.wait_idle(20)
    assert await balances(engine) == {"a": Decimal(20), "b": Decimal(20)}
    for group in (0, 1):
        mine = sorted((s for s in spans if s[0] == group), key=lambda s: s[2])
        assert len(mine) > 2
        for earlier, later in itertools.pairwise(mine):
            assert earlier[3] <= later[2]  # never two of one group at once
            assert max(earlier[1]) < min(later[1])  # and in the order they arrived
    if engine.dialect.name == "postgresql":  # SQLite's one writer serializes the batches
        assert any(  # the groups did not wait for each other
            a[0] != b[0] and a[2] < b[3] and b[2] < a[3] for a in spans for b in spans
        )


async def test_a_row_held_elsewhere_sends_its_message_around_not_the_batch_waiting(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """Batches that wait on each other's rows deadlock; a savepoint waits 50 ms at most.
    The group commits the others while the row is still held, and runs the held one on
    its own after its commit; the group is settled when that one is done."""
    from worker.db import create_engine

    engine = create_engine(postgres_only_url, pool_size=6)
    registry = credit_registry("orm")
    settings = make_settings(database_url=postgres_only_url, batch_size=3, concurrency=1)
    broker = MemoryBroker()
    async with engine.begin() as connection:
        await connection.execute(text("INSERT INTO accounts VALUES ('held', 0, 1)"))
    try:
        async with engine.connect() as holder:
            transaction = await holder.begin()
            await holder.execute(
                text("UPDATE accounts SET balance = 100, version = 2 WHERE id = 'held'")
            )
            async with run_pumps([broker.connect()], [engine], registry, settings) as [pump]:
                await learned(broker)
                for n, account in enumerate(["free-1", "held", "free-2"]):
                    broker.publish(f"m-{n}", "Credit", body(account, "1"))
                # the free ones commit while the row is still held: nobody waited on it
                await wait_for(lambda: pump.stats["committed"] >= 3, 10, "the free credits")
                assert sorted(await marker_counts(engine)) == ["learn-Credit", "m-0", "m-2"]
                assert len(broker.history) == 1  # settled with the group, after the held one
                await transaction.commit()  # the held row is free: its message runs alone
                await broker.wait_idle(10)
        assert pump.stats["batch-deferred"] == 1 and pump.stats["batch-fallback"] == 0
        assert sorted(broker.history) == [("ack", "learn-Credit", 1)] + [
            ("ack", f"m-{n}", 1) for n in range(3)
        ]
        assert await balances(engine) == {
            "free-1": Decimal(1),
            "free-2": Decimal(1),
            "held": Decimal(101),
            LEARNED: Decimal(0),
        }
    finally:
        await engine.dispose()
