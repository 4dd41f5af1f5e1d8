"""``worker demo``: the at-least-once race and its cure, end to end, in seconds.

Two replicas (two pumps, each with its own engine) share one SQLite file and one
memory broker. The broker duplicates messages (producer retries), hands some to
both replicas at once, and loses some acks (a replica "crashing" between its
commit and its ack). The same stream runs twice: through a naive
check-then-insert handler without a unique constraint or a version token, and
through the real pump.

A second table does the same for events a handler publishes ("credit applied"):
published from inside the handler, published right after the commit, and through
the outbox. Some messages fail for good after publishing (dead-lettered), some
replicas "crash" right after a commit, and the outbox relays crash after the
broker confirmed a batch but before marking it sent.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Integer, MetaData, Numeric, String, Table, func, select

from handlers.credit import Account, CreditRequested, apply_credit, apply_credit_and_announce
from worker.brokers.memory import MemoryBroker, MemoryPublisher
from worker.context import Context
from worker.db import create_engine
from worker.errors import Poison
from worker.histories import application_histories
from worker.inbox import InboxMarker
from worker.migrate import upgrade
from worker.outbox import model as outbox
from worker.outbox.relay import Relay
from worker.pump import Pump
from worker.registry import Registry
from worker.settings import Settings

ACCOUNTS = 5
REPLICAS = 2

_naive_metadata = MetaData()
naive_accounts = Table(
    "naive_accounts",
    _naive_metadata,
    Column("id", String, primary_key=True),
    Column("balance", Numeric(18, 2)),
)
naive_inbox = Table(  # no unique constraint: the check below is all it has
    "naive_inbox",
    _naive_metadata,
    Column("id", Integer, primary_key=True),
    Column("message_id", String),
)


def _migrate(url: str) -> None:
    """The worker's tables and the example application's (the credit handler's accounts)."""
    upgrade(url, applications=application_histories(["handlers"]))


def naive_registry(caught: Counter[str]) -> Registry:
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="naive", inbox=False)
    async def naive_credit(ctx: Context, message: CreditRequested) -> None:
        session = ctx.session
        seen = select(naive_inbox.c.id).where(naive_inbox.c.message_id == ctx.message_id)
        if (await session.execute(seen)).first() is not None:
            caught["duplicates"] += 1
            return
        await asyncio.sleep(0.002)  # the work between check and save: where the race lives
        account = naive_accounts.c.id == message.account_id
        balance = await session.scalar(select(naive_accounts.c.balance).where(account)) or 0
        await session.execute(
            naive_accounts.update().where(account).values(balance=balance + message.amount)
        )
        await session.execute(naive_inbox.insert().values(message_id=ctx.message_id))

    return registry


def real_registry() -> Registry:
    registry = Registry()
    registry.handler("CreditRequested", CreditRequested, consumer="credit")(apply_credit)
    return registry


def make_stream(messages: int, seed: int = 7) -> list[tuple[str, str, Decimal, dict[str, Any]]]:
    rng = random.Random(seed)
    stream = []
    for n in range(messages):
        amount = Decimal(rng.randint(1, 10_000)) / 100
        roll = rng.random()
        misbehaviour: dict[str, Any] = {}
        if roll < 0.25:
            misbehaviour = {"copies": 2}  # the producer's retry
        elif roll < 0.35:
            misbehaviour = {"to_all": True}  # one message at both replicas at once
        elif roll < 0.40:
            misbehaviour = {"lose_acks": 1}  # commit, then die before the ack
        stream.append((f"msg-{n:05d}", f"acct-{n % ACCOUNTS}", amount, misbehaviour))
    return stream


async def run_replicas(database_url: str, registry: Registry, stream: list[Any]) -> dict[str, Any]:
    settings = Settings(database_url=database_url, concurrency=8, max_attempts=10)
    broker = MemoryBroker()
    engines = [create_engine(database_url, pool_size=10) for _ in range(REPLICAS)]
    pumps = [
        Pump(broker.connect(), engine, registry, settings, name=f"replica-{i}")
        for i, engine in enumerate(engines)
    ]
    tasks = [asyncio.create_task(pump.run()) for pump in pumps]
    await asyncio.gather(*(pump.started.wait() for pump in pumps))
    for message_id, account, amount, misbehaviour in stream:
        body = {"account_id": account, "amount": str(amount)}
        broker.publish(message_id, "CreditRequested", body, **misbehaviour)
    await broker.wait_idle(timeout=120)
    for pump in pumps:
        pump.stop()
    await asyncio.gather(*tasks)
    stats: Counter[str] = Counter()
    for pump in pumps:
        stats.update(pump.stats)
    for engine in engines[1:]:
        await engine.dispose()
    return {"broker": broker, "stats": stats, "engine": engines[0]}


async def balances(engine: Any, table: Any) -> dict[str, Decimal]:
    async with engine.connect() as connection:
        rows = await connection.execute(select(table.c.id, table.c.balance))
        return {row.id: Decimal(row.balance) for row in rows}


async def demo(messages: int = 400) -> int:
    stream = make_stream(messages)
    expected: dict[str, Decimal] = Counter()  # type: ignore[assignment]
    for _, account, amount, _ in stream:
        expected[account] += amount
    with tempfile.TemporaryDirectory(prefix="worker-demo-") as tmp:
        naive_url = f"sqlite+aiosqlite:///{Path(tmp) / 'naive.db'}"
        real_url = f"sqlite+aiosqlite:///{Path(tmp) / 'worker.db'}"
        await asyncio.to_thread(_migrate, real_url)
        naive_engine = create_engine(naive_url)
        async with naive_engine.begin() as connection:
            await connection.run_sync(_naive_metadata.create_all)
            accounts = [{"id": f"acct-{n}", "balance": 0} for n in range(ACCOUNTS)]
            await connection.execute(naive_accounts.insert(), accounts)
        await naive_engine.dispose()

        caught: Counter[str] = Counter()
        started = time.perf_counter()
        naive = await run_replicas(naive_url, naive_registry(caught), stream)
        naive_s = time.perf_counter() - started
        naive_balances = await balances(naive["engine"], naive_accounts)
        await naive["engine"].dispose()

        started = time.perf_counter()
        real = await run_replicas(real_url, real_registry(), stream)
        real_s = time.perf_counter() - started
        real_balances = await balances(real["engine"], Account.__table__)
        async with real["engine"].connect() as connection:
            markers = await connection.scalar(
                select(func.count()).select_from(Table("inbox", MetaData()))
            )
        await real["engine"].dispose()

    def exact(actual: dict[str, Decimal]) -> int:
        return sum(actual.get(a) == e for a, e in expected.items())

    rows = [
        ("messages sent (unique ids)", messages, messages),
        ("deliveries", naive["broker"].stats["delivered"], real["broker"].stats["delivered"]),
        ("duplicates caught", caught["duplicates"], real["stats"]["duplicate"]),
        ("credits applied (commits)", naive["stats"]["committed"], real["stats"]["committed"]),
        ("version conflicts retried", 0, real["stats"]["retried-conflict"]),
        ("inbox markers", "-", markers),
        ("expected total", sum(expected.values()), sum(expected.values())),
        ("actual total", sum(naive_balances.values()), sum(real_balances.values())),
        (f"accounts exact (of {ACCOUNTS})", exact(naive_balances), exact(real_balances)),
        ("seconds", f"{naive_s:.2f}", f"{real_s:.2f}"),
    ]
    print(f"{'':30} {'naive':>12} {'worker':>12}")
    for label, left, right in rows:
        print(f"{label:30} {left!s:>12} {right!s:>12}")
    ok = real_balances == expected and markers == messages and not real["broker"].dead_letters
    print("\nworker: every balance exact" if ok else "\nworker: BALANCES WRONG")
    if naive_balances != expected:
        print("naive: double-credited or lost updates, as the design notes predict")
    events_ok = await events_demo(stream)
    return 0 if ok and events_ok else 1


# -- events: publishing from a handler ---------------------------------------------

DOOMED_EVERY = 25  # every 25th credit publishes, then fails for good (dead-lettered)


def _doomed(message_id: str) -> bool:
    return int(message_id.rsplit("-", 1)[1]) % DOOMED_EVERY == DOOMED_EVERY - 1


def _event_body(ctx: Context, message: CreditRequested) -> dict[str, Any]:
    return {"credit_id": ctx.message_id, "account_id": message.account_id}


def in_handler_registry(events: MemoryBroker) -> Registry:
    """Publish straight to the broker from the handler, before the pump commits."""
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        await apply_credit(ctx, message)
        events.publish(f"applied-{ctx.message_id}", "CreditApplied", _event_body(ctx, message))
        if _doomed(ctx.message_id):
            raise Poison("credit limit exceeded")

    return registry


def after_commit_registry(events: MemoryBroker, crashes: set[str]) -> Registry:
    """Publish once the commit is done; a replica that dies right then never publishes."""
    from sqlalchemy import event

    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        await apply_credit(ctx, message)
        if _doomed(ctx.message_id):
            raise Poison("credit limit exceeded")
        body, message_id = _event_body(ctx, message), ctx.message_id

        def publish(_session: Any) -> None:
            if message_id in crashes:  # the first commit of these is followed by a crash
                crashes.discard(message_id)
                return
            events.publish(f"applied-{message_id}", "CreditApplied", body)

        event.listen(ctx.session.sync_session, "after_commit", publish, once=True)

    return registry


def outbox_registry() -> Registry:
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        await apply_credit_and_announce(ctx, message)
        if _doomed(ctx.message_id):
            raise Poison("credit limit exceeded")

    return registry


class CrashingRelay(Relay):
    """Dies (leaves its lease) after the broker confirmed a batch, ``crashes`` times."""

    def __init__(self, *args: Any, crashes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.crashes = crashes

    async def mark_sent(self, ids: Any) -> None:
        if self.crashes > 0 and ids:
            self.crashes -= 1
            return  # confirmed, never marked: the rows go out again after the lease
        await super().mark_sent(ids)


async def _events_run(
    url: str, registry: Registry, stream: list[Any], events: MemoryBroker, *, relays: bool
) -> dict[str, Any]:
    await asyncio.to_thread(_migrate, url)
    settings = outbox.OutboxSettings(
        lease=0.5, publish_timeout=0.2, poll_interval=0.05, batch=20, purge_interval=0
    )
    outbox.configure(settings)
    engine = create_engine(url, pool_size=4)
    running = [
        CrashingRelay(engine, MemoryPublisher(events), settings, crashes=1, name=f"relay-{i}")
        for i in range(REPLICAS if relays else 0)
    ]
    tasks = [asyncio.create_task(relay.run()) for relay in running]
    try:
        result = await run_replicas(url, registry, stream)
        if relays:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                backlog = await outbox.backlog_of(engine)
                if backlog.pending == 0:
                    break
                await asyncio.sleep(0.05)
        async with result["engine"].connect() as connection:
            committed = set((await connection.execute(select(InboxMarker.message_id))).scalars())
        await result["engine"].dispose()
    finally:
        for relay in running:
            relay.stop()
        await asyncio.gather(*tasks)
        await engine.dispose()
        outbox.configure(None)
    return {"committed": committed, "events": events, "stats": result["stats"]}


def _event_ids(events: MemoryBroker) -> list[str]:
    ids = []
    while events.ready:
        message = events.ready.popleft()
        body = json.loads(message.body)
        ids.append(str(body["credit_id"]))
    return ids


async def events_demo(stream: list[Any]) -> bool:
    """The second table: every applied credit, and only those, yields one event?"""
    crashes = {
        message_id for message_id, _, _, misbehaviour in stream if misbehaviour.get("lose_acks")
    }
    columns = []
    with tempfile.TemporaryDirectory(prefix="worker-demo-events-") as tmp:
        for name in ("in handler", "after commit", "outbox"):
            events = MemoryBroker()
            if name == "in handler":
                registry = in_handler_registry(events)
            elif name == "after commit":
                registry = after_commit_registry(events, set(crashes))
            else:
                registry = outbox_registry()
            url = f"sqlite+aiosqlite:///{Path(tmp) / (name.replace(' ', '-') + '.db')}"
            run = await _events_run(url, registry, stream, events, relays=name == "outbox")
            received = _event_ids(events)
            committed = run["committed"]
            distinct = set(received)
            columns.append(
                {
                    "credits applied": len(committed),
                    "events delivered": len(received),
                    "distinct event ids": len(distinct),
                    "applied, no event (lost)": len(committed - distinct),
                    "event, never applied": len(distinct - committed),
                    "duplicates (same id)": len(received) - len(distinct),
                }
            )
    labels = list(columns[0])
    print(
        f"\n{'events per applied credit':30} {'in handler':>12} {'after commit':>12} {'outbox':>12}"
    )
    for label in labels:
        print(f"{label:30} " + " ".join(f"{c[label]!s:>12}" for c in columns))
    real = columns[2]
    ok = real["applied, no event (lost)"] == 0 and real["event, never applied"] == 0
    ok = ok and real["distinct event ids"] == real["credits applied"]
    print(
        "\noutbox: exactly one event id per applied credit; the repeats carry the same id, "
        "so a downstream inbox applies each once"
        if ok
        else "\noutbox: EVENTS WRONG"
    )
    return ok
