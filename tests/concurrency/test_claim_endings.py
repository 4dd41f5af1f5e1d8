"""How a side-effect claim ends: one finish commits, a hopeless claim is abandoned (side effects
that can't join the transaction get a two-phase claim).

- A replica whose lease ran out mid-call and whose "finished" mark then finds
  the claim finished by the replica that took it over must roll its own writes
  back: they record the same call, which the winner already recorded.
- A claim whose message was dead-lettered (``Poison``, or a failure on the last
  allowed delivery), and a stale claim whose attempts reached
  ``WORKER_MAX_DELIVERIES``, is abandoned: the sweeper never calls for it again.
  A new delivery of the message (a re-submitted dead letter) still takes it over.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from pydantic import BaseModel
from sqlalchemy import BigInteger, Table, insert, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tests.concurrency.concurrency_helpers import inbox_rows
from tests.support.database import INBOX
from tests.support.layout import plain_table_only
from tests.support.pumps import MakeSettings, RunPumps
from worker import claim_runner, cli, leases, retention, sweeper
from worker.brokers.memory import MemoryBroker
from worker.claims import ClaimContext, side_effect
from worker.context import PumpSession, session_factory
from worker.db import Failure, classify, create_engine
from worker.errors import Poison
from worker.logs import get_logger
from worker.registry import Handler, Registry
from worker.settings import Settings
from worker.verdict import Verdict

LOG = get_logger(test="claim-endings")


class Pay(BaseModel):
    amount: int


class Base(DeclarativeBase):
    pass


class Wallet(Base):
    __tablename__ = "claim_wallet"
    id: Mapped[int] = mapped_column(primary_key=True)
    paid: Mapped[int]


@dataclass
class FakeDelivery:
    """The parts of a Delivery that :func:`claim_runner.process` reads."""

    delivery_count: int
    message_id: str = "m1"
    type: str = "Pay"
    body: bytes = b'{"amount": 10}'
    headers: dict[str, Any] = field(default_factory=dict)


def pay_registry(calls: Counter[str], act: Any) -> tuple[Registry, Handler[Any]]:
    """A "Pay" side-effect handler counting its provider calls per key, then doing ``act``."""
    registry = Registry()

    @side_effect("Pay", Pay, consumer="pay", registry=registry)
    async def pay(ctx: ClaimContext, message: Pay) -> str | None:
        calls[ctx.idempotency_key] += 1
        return await act(ctx, message)  # type: ignore[no-any-return]

    return registry, next(iter(registry))


async def add_claim(
    engine: AsyncEngine,
    message_id: str,
    *,
    state: str = "claimed",
    attempts: int = 1,
    age: timedelta = timedelta(0),
    outcome: str | None = None,
) -> None:
    """A "Pay" claim: claimed with a lease that ran out ``age`` ago, or abandoned ``age`` ago."""
    now = datetime.now(UTC)
    values: dict[str, Any] = {
        "message_id": message_id,
        "consumer": "pay",
        "received_at": now - age,
        "state": state,
        "attempts": attempts,
        "outcome": outcome,
        "claimed_by": "someone-else",
        "message_type": "Pay",
        "body": b'{"amount": 10}',
        "processed_at": None,
    }
    if state == "claimed":
        values["lease_until"] = now - age
    else:
        values["processed_at"] = now - age
    async with engine.begin() as connection:
        await connection.execute(insert(INBOX).values(values))


# -- defect: a lost claim committed its writes ------------------------------------------------


async def test_a_replica_that_lost_its_claim_commits_none_of_its_writes(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    async with engine.begin() as connection:
        await connection.execute(text("CREATE TABLE claim_ledger (owner VARCHAR(200) NOT NULL)"))

    b_finished = asyncio.Event()

    async def record(ctx: ClaimContext, message: Pay) -> str:
        if ctx.claim.attempts == 1:  # replica A: a call that ignores the cut at its lease's end
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await b_finished.wait()  # (a thread, a shielded await: it goes on regardless)
        # the call happened (same key both times); the write is sent at once, before the mark
        await ctx.session.execute(
            text("INSERT INTO claim_ledger (owner) VALUES (:o)"), {"o": ctx.claim.owner}
        )
        return "paid"

    calls: Counter[str] = Counter()
    _, handler = pay_registry(calls, record)
    settings = make_settings(claim_lease=5, claim_call_timeout=4)
    sessions = session_factory(engine)

    async def finish(claim: leases.Claim, delivery_count: int) -> Verdict:
        return await claim_runner.run(
            sessions,
            handler,
            Pay(amount=10),
            claim,
            settings,
            LOG,
            message_id="m1",
            delivery_count=delivery_count,
            headers={},
        )

    slow = await leases.acquire(sessions, "m1", "pay", lease=0.2)  # replica A
    assert isinstance(slow, leases.Claim)
    a_running = asyncio.create_task(finish(slow, 1))
    await asyncio.sleep(0.4)  # A's lease runs out mid-call
    fast = await leases.acquire(sessions, "m1", "pay", lease=5)  # the redelivery, replica B
    assert isinstance(fast, leases.Claim) and fast.taken_over
    won = await finish(fast, 2)
    b_finished.set()
    lost = await asyncio.wait_for(a_running, 10)  # A's call returns only now; B finished first
    async with engine.connect() as connection:
        ledger = list((await connection.execute(text("SELECT owner FROM claim_ledger"))).scalars())
    [row] = await inbox_rows(engine)
    assert ledger == [fast.owner]  # B's write only: A's was rolled back
    assert (won.verb, won.outcome) == ("ack", "committed")
    assert (lost.verb, lost.outcome) == ("ack", "duplicate")
    assert lost.reason is not None and "rolled back" in lost.reason
    assert (row.state, row.attempts, row.claimed_by, row.outcome) == (
        "finished",
        2,
        fast.owner,
        "paid",
    )
    assert calls == Counter({"m1": 2})


async def test_the_mark_goes_before_the_handlers_writes_on_postgresql(
    postgres_only_url: str, make_settings: MakeSettings
) -> None:
    """A's finish waits on a business-row lock until its lease is over and B has taken over.

    The mark is written first (no autoflush), so it holds the claim's row and B's
    takeover waits for it; had A's write been flushed first, B would take over,
    and both writes would commit (paid = 20).
    """
    engine = create_engine(postgres_only_url)
    blocker = None
    try:
        async with engine.begin() as connection:
            await connection.execute(
                text("CREATE TABLE claim_wallet (id int PRIMARY KEY, paid int NOT NULL)")
            )
            await connection.execute(text("INSERT INTO claim_wallet VALUES (1, 0)"))

        async def credit(ctx: ClaimContext, message: Pay) -> str:
            await asyncio.sleep(0.1)  # the provider call
            wallet = await ctx.session.get_one(Wallet, 1)
            wallet.paid = Wallet.paid + message.amount  # pending: flushed with the mark
            return "paid"

        calls: Counter[str] = Counter()
        _, handler = pay_registry(calls, credit)
        settings = make_settings(
            database_url=postgres_only_url, claim_lease=1.0, claim_call_timeout=0.9
        )
        sessions = session_factory(engine)
        blocker = await engine.connect()  # another transaction holds the wallet row
        await blocker.execute(text("UPDATE claim_wallet SET paid = paid WHERE id = 1"))
        first = asyncio.create_task(
            claim_runner.process(sessions, handler, Pay(amount=10), FakeDelivery(1), settings, LOG)  # type: ignore[arg-type]
        )
        await asyncio.sleep(1.2)  # A's lease ran out while its write waited
        second = asyncio.create_task(
            claim_runner.process(sessions, handler, Pay(amount=10), FakeDelivery(2), settings, LOG)  # type: ignore[arg-type]
        )
        await asyncio.sleep(0.3)
        await blocker.rollback()
        outcomes = await asyncio.wait_for(asyncio.gather(first, second), 10)
        async with engine.connect() as connection:
            paid = await connection.scalar(text("SELECT paid FROM claim_wallet WHERE id = 1"))
        [row] = await inbox_rows(engine)
    finally:
        if blocker is not None:
            await blocker.close()
        await engine.dispose()
    assert paid == 10
    assert row.state == "finished"
    assert sorted(o.outcome for o in outcomes) == ["committed", "duplicate"]
    assert all(o.verb == "ack" for o in outcomes)


# -- defect: a poison or exhausted claim was re-driven forever ----------------------------------


async def test_a_poison_claim_is_abandoned_and_never_redriven(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    async def decline(ctx: ClaimContext, message: Pay) -> str:
        raise Poison("provider: HTTP 422 card declined")

    calls: Counter[str] = Counter()
    registry, _ = pay_registry(calls, decline)
    settings = make_settings(claim_lease=5, claim_call_timeout=4, purge_interval=0)
    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, settings):
        broker.publish("m1", "Pay", {"amount": 10})
        await broker.wait_idle(5)
    assert [letter.reason for letter in broker.dead_letters] == [
        "pay: provider: HTTP 422 card declined"
    ]
    sessions = session_factory(engine)
    sweeps = [await sweeper.redrive(sessions, registry, settings, LOG) for _ in range(3)]
    [row] = await inbox_rows(engine)
    assert sweeps == [Counter()] * 3
    assert calls == Counter({"m1": 1})  # the provider was called once, not once per sweep
    assert (row.state, row.lease_until, row.outcome) == (
        "abandoned",
        None,
        "failed: Poison: provider: HTTP 422 card declined",
    )
    assert row.processed_at is not None  # the retention window counts from here
    assert await sweeper.stale_claims(sessions) == []


async def test_a_failure_on_the_last_delivery_abandons_the_claim(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    async def fail(ctx: ClaimContext, message: Pay) -> str:
        raise RuntimeError("provider unreachable")

    calls: Counter[str] = Counter()
    registry, _ = pay_registry(calls, fail)
    settings = make_settings(
        claim_lease=5, claim_call_timeout=4, purge_interval=0, max_deliveries=2
    )
    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, settings):
        broker.publish("m1", "Pay", {"amount": 10})
        await broker.wait_idle(10)
    [letter] = broker.dead_letters
    assert letter.reason.startswith("failed 2 deliveries")
    [row] = await inbox_rows(engine)
    assert (row.state, row.attempts) == ("abandoned", 2)
    assert await sweeper.redrive(session_factory(engine), registry, settings, LOG) == Counter()
    assert calls == Counter({"m1": 2})


async def test_the_sweeper_abandons_claims_out_of_attempts_and_redrives_the_others(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    """The hopeless claim is the most overdue: with ``limit=1`` it would hide the other one
    forever if the sweeper only skipped it."""

    async def send(ctx: ClaimContext, message: Pay) -> str:
        return "paid"

    calls: Counter[str] = Counter()
    registry, _ = pay_registry(calls, send)
    settings = make_settings(claim_lease=5, claim_call_timeout=4, max_deliveries=3)
    await add_claim(
        engine, "spent", attempts=3, age=timedelta(minutes=10), outcome="failed: Retry: 503"
    )
    await add_claim(engine, "fresh", attempts=1, age=timedelta(minutes=1))
    sessions = session_factory(engine)
    sweeps = [await sweeper.redrive(sessions, registry, settings, LOG, limit=1) for _ in range(3)]
    spent, fresh = await inbox_rows(engine)
    assert sweeps == [Counter({"exhausted": 1}), Counter({"committed": 1}), Counter()]
    assert calls == Counter({"fresh": 1})
    assert (spent.state, spent.attempts, spent.outcome) == ("abandoned", 3, "failed: Retry: 503")
    assert (fresh.state, fresh.attempts, fresh.outcome) == ("finished", 2, "paid")


async def test_only_one_new_delivery_takes_over_an_abandoned_claim(database_url: str) -> None:
    """A re-submitted dead letter runs again (abandoned is not "done"), on one replica only;
    the sweeper's takeover, by id, leaves an abandoned claim alone."""
    engines = [create_engine(database_url) for _ in range(4)]
    try:
        await add_claim(engines[0], "m1", state="abandoned", attempts=3, age=timedelta(hours=1))
        [abandoned] = await inbox_rows(engines[0])
        assert await leases.take_over(session_factory(engines[0]), abandoned.id, lease=30) is None
        got = await asyncio.gather(
            *(leases.acquire(session_factory(e), "m1", "pay", lease=30) for e in engines)
        )
        [row] = await inbox_rows(engines[0])
    finally:
        for engine in engines:
            await engine.dispose()
    winners = [claim for claim in got if isinstance(claim, leases.Claim)]
    assert len(winners) == 1 and winners[0].attempts == 4
    assert sum(isinstance(claim, leases.Held) for claim in got) == 3
    assert (row.state, row.processed_at, row.claimed_by) == ("claimed", None, winners[0].owner)


async def test_abandoned_claims_are_listed_then_purged_with_the_finished_markers(
    engine: AsyncEngine, make_settings: MakeSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    plain_table_only(str(engine.url))  # the partitioned inbox drops partitions instead
    await add_claim(engine, "old", state="abandoned", age=timedelta(days=2), outcome="failed: x")
    await add_claim(engine, "recent", state="abandoned", attempts=2, age=timedelta(minutes=30))
    await add_claim(engine, "stuck", age=timedelta(days=2))  # unfinished: never purged
    settings = make_settings(
        broker_lock_timeout=timedelta(minutes=1),
        max_deliveries=5,
        message_ttl=timedelta(minutes=5),
        dead_letter_margin=timedelta(0),
        inbox_retention=timedelta(hours=1),
        purge_interval=0,
    )
    await cli.sweep_command(settings, redrive_claims=False, limit=10, abandoned=True)
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(c["message_id"], c["state"], c["attempts"]) for c in listed] == [
        ("recent", "abandoned", 2),
        ("old", "abandoned", 1),
    ]
    assert listed[1]["last_outcome"] == "failed: x"

    result = await retention.purge(engine, settings, pause=0)
    assert result.deleted == 1
    assert [row.message_id for row in await inbox_rows(engine)] == ["recent", "stuck"]


async def deliver(
    sessions: async_sessionmaker[PumpSession],
    handler: Handler[Any],
    settings: Settings,
    delivery: FakeDelivery,
) -> Verdict:
    """:func:`claim_runner.process` for a FakeDelivery of Pay(amount=10)."""
    return await claim_runner.process(
        sessions, handler, Pay(amount=10), cast(Any, delivery), settings, LOG
    )


# -- issue 15: a cut call keeps its lease; the lease bounds the call -----------------------------


async def hang(ctx: ClaimContext, message: Pay) -> str:
    await asyncio.sleep(30)  # a provider that does not answer in time
    return "paid"


async def test_a_call_that_timed_out_keeps_its_lease_and_comes_back_after_it(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    """A timeout says "outcome unknown", not "failed": the provider may still be sending."""
    calls: Counter[str] = Counter()
    _, handler = pay_registry(calls, hang)
    settings = make_settings(claim_lease=1.5, claim_call_timeout=0.1, max_deliveries=3)
    sessions = session_factory(engine)
    outcome = await deliver(sessions, handler, settings, FakeDelivery(1))
    [row] = await inbox_rows(engine)
    twin = await leases.acquire(sessions, "m1", "pay", lease=1.5)  # a redelivery right now
    assert (outcome.verb, outcome.outcome, outcome.counted) == ("nack", "call-timeout", True)
    assert isinstance(twin, leases.Held) and twin.remaining > 1.0  # the lease still runs
    assert outcome.delay is not None and outcome.delay >= twin.remaining  # back after it
    assert row.state == "claimed" and row.lease_until is not None
    assert row.outcome == (
        "unknown: TimeoutError: call took longer than WORKER_CLAIM_CALL_TIMEOUT=0.1s"
    )
    assert calls == Counter({"m1": 1})


async def test_a_call_that_timed_out_on_the_last_delivery_is_abandoned_with_its_lease(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    """Dead-lettered (the pump does it, from the TimeoutError) and abandoned, but even a
    re-submitted dead letter waits for the lease before it calls again."""
    calls: Counter[str] = Counter()
    _, handler = pay_registry(calls, hang)
    settings = make_settings(claim_lease=2.0, claim_call_timeout=0.1, max_deliveries=2)
    sessions = session_factory(engine)
    with pytest.raises(TimeoutError, match="WORKER_CLAIM_CALL_TIMEOUT"):
        await deliver(sessions, handler, settings, FakeDelivery(2))
    [row] = await inbox_rows(engine)
    assert (row.state, row.attempts) == ("abandoned", 1)
    assert row.lease_until is not None and row.processed_at is not None
    assert row.outcome.startswith("unknown: TimeoutError")
    resubmitted = await leases.acquire(sessions, "m1", "pay", lease=2.0)
    assert isinstance(resubmitted, leases.Held) and resubmitted.remaining > 0.5
    await asyncio.sleep(resubmitted.remaining + 0.1)
    later = await leases.acquire(sessions, "m1", "pay", lease=2.0)
    assert isinstance(later, leases.Claim) and later.attempts == 2
    assert await sweeper.stale_claims(sessions) == []  # abandoned: never the sweeper's


async def hold_key(engine: AsyncEngine) -> AsyncConnection:
    """Another transaction inserting claim m1/pay, uncommitted: a claim's INSERT waits for it
    (on PostgreSQL for the key, on SQLite for the write lock) until it rolls back."""
    blocker = await engine.connect()
    await blocker.execute(
        insert(INBOX).values(
            message_id="m1",
            consumer="pay",
            state="claimed",
            lease_until=datetime.now(UTC) + timedelta(seconds=30),
            claimed_by="blocker",
        )
    )
    return blocker


async def claim_behind_blocker(
    engine: AsyncEngine, handler: Handler[Any], settings: Settings, held_for: float
) -> Verdict:
    """:func:`claim_runner.process` whose claim waits ``held_for`` seconds for :func:`hold_key`."""
    blocker = await hold_key(engine)
    try:
        task = asyncio.create_task(
            deliver(session_factory(engine), handler, settings, FakeDelivery(1))
        )
        await asyncio.sleep(held_for)
    finally:
        await blocker.rollback()
        await blocker.close()
    [result] = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
    assert isinstance(result, Verdict), result  # not an exception
    return result


async def test_the_call_ends_before_a_lease_that_a_slow_claim_shortened(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    """Issue 15, suspected and confirmed: the lease starts with the claim's statement, the
    call timeout used to start when its commit returned. The claim here waits 1 s for
    another transaction, so half its 2 s lease is gone when the call starts: a 1.6 s call
    timeout then ran 0.6 s past the lease, where a redelivery may take over and call too."""
    cut: list[tuple[datetime, datetime]] = []

    async def hang_and_note(ctx: ClaimContext, message: Pay) -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cut.append((datetime.now(UTC), ctx.claim.lease_until))
            raise
        return "paid"

    calls: Counter[str] = Counter()
    _, handler = pay_registry(calls, hang_and_note)
    settings = make_settings(claim_lease=2.0, claim_call_timeout=1.6)
    outcome = await claim_behind_blocker(engine, handler, settings, held_for=1.0)
    [(cut_at, lease_until)] = cut
    assert cut_at < lease_until  # the lease as the database stored it
    assert calls == Counter({"m1": 1})
    assert (outcome.verb, outcome.outcome) == ("nack", "call-timeout")
    assert outcome.reason is not None and "before the claim's lease ends" in outcome.reason


async def test_a_lease_spent_by_the_claim_itself_is_given_back_uncounted_without_a_call(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    async def send(ctx: ClaimContext, message: Pay) -> str:
        return "paid"

    calls: Counter[str] = Counter()
    _, handler = pay_registry(calls, send)
    settings = make_settings(claim_lease=0.5, claim_call_timeout=0.4)
    outcome = await claim_behind_blocker(engine, handler, settings, held_for=0.8)
    [row] = await inbox_rows(engine)
    assert calls == Counter()  # calling now could overlap a takeover
    assert (outcome.verb, outcome.outcome, outcome.counted) == ("nack", "lease-spent", False)
    assert row.state == "claimed" and row.outcome.startswith("not called: TimeoutError")
    taken = await leases.acquire(session_factory(engine), "m1", "pay", lease=5)
    assert isinstance(taken, leases.Claim) and taken.attempts == 2  # released: at once


# -- issue 15 item 9: claim outcomes leave the process scrubbed -----------------------------------

DSN = "postgresql://ledger:S3cr3tPassw0rd@db/x"


async def test_claim_outcomes_are_scrubbed_in_the_inbox_and_in_worker_sweep(
    engine: AsyncEngine, make_settings: MakeSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    # "failed: RuntimeError: " + 206 characters + "postgresql://ledger:": the 255-character cut
    # falls inside the password, where a scrub after cutting would no longer see a URL
    straddling = "x" * 206 + DSN

    async def leak(ctx: ClaimContext, message: Pay) -> str:
        kind = ctx.message_id
        if kind == "returned":
            return f"sent through {DSN}"
        if kind == "poison":
            raise Poison(f"declined by {DSN}")
        if kind == "timeout":
            raise TimeoutError(f"no answer from {DSN}")
        raise RuntimeError(straddling if kind == "cut" else f"could not connect to {DSN}")

    calls: Counter[str] = Counter()
    _, handler = pay_registry(calls, leak)
    settings = make_settings(claim_lease=5, claim_call_timeout=4, purge_interval=0)
    sessions = session_factory(engine)
    outcomes: dict[str, Any] = {}
    for kind in ("failed", "cut", "poison", "timeout", "returned"):
        delivery = FakeDelivery(1, message_id=kind)
        outcomes[kind] = (
            await asyncio.gather(
                deliver(sessions, handler, settings, delivery),
                return_exceptions=True,
            )
        )[0]
    rows = {row.message_id: row for row in await inbox_rows(engine)}
    capsys.readouterr()  # the log lines so far (scrubbed by their own processor)
    await cli.sweep_command(settings, redrive_claims=False, limit=10)
    await cli.sweep_command(settings, redrive_claims=False, limit=10, abandoned=True)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    assert all("S3cr3t" not in (row.outcome or "") for row in rows.values())
    assert rows["failed"].outcome == (
        "failed: RuntimeError: could not connect to postgresql://ledger:***@db/x"
    )
    assert len(rows["cut"].outcome) == 255 and "postgresql://ledger:***@db/" in rows["cut"].outcome
    assert rows["poison"].outcome == "failed: Poison: declined by postgresql://ledger:***@db/x"
    assert rows["timeout"].outcome.startswith("unknown: TimeoutError: no answer from")
    assert rows["returned"].outcome == "sent through postgresql://ledger:***@db/x"
    assert outcomes["poison"].reason == "pay: declined by postgresql://ledger:***@db/x"
    assert "S3cr3t" not in outcomes["timeout"].reason
    # worker sweep: the released claims (stale at once) and the abandoned one
    assert sorted(p["message_id"] for p in printed) == ["cut", "failed", "poison"]
    assert all("S3cr3t" not in json.dumps(p) for p in printed)


async def test_worker_sweep_scrubs_outcomes_stored_before_scrubbing_was_done(
    engine: AsyncEngine, make_settings: MakeSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    await add_claim(engine, "old-stale", age=timedelta(minutes=5), outcome=f"failed: {DSN}")
    await add_claim(engine, "old-gone", state="abandoned", outcome=f"failed: {DSN}")
    settings = make_settings(purge_interval=0)
    await cli.sweep_command(settings, redrive_claims=False, limit=10)
    await cli.sweep_command(settings, redrive_claims=False, limit=10, abandoned=True)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["last_outcome"] for p in printed] == ["failed: postgresql://ledger:***@db/x"] * 2


# -- a delivery count is spent only by the message's own failure: a give-back it is not to
# -- blame for spends none


async def test_waiting_for_someone_elses_live_claim_is_not_counted(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    calls: Counter[str] = Counter()
    _, handler = pay_registry(calls, hang)
    await add_claim(engine, "m1", age=timedelta(seconds=-30))  # its lease runs 30 s more
    settings = make_settings(claim_lease=60, claim_call_timeout=5)
    outcome = await deliver(session_factory(engine), handler, settings, FakeDelivery(3))
    assert (outcome.verb, outcome.outcome, outcome.counted) == ("nack", "claim-held", False)
    assert outcome.delay is not None and 29 < outcome.delay <= 31
    assert calls == Counter()


async def test_contention_on_the_claim_itself_is_given_back_uncounted(
    database_url: str, make_settings: MakeSettings
) -> None:
    """SQLite: the write lock stays taken past the busy timeout. PostgreSQL: a deadlock
    (raised by a trigger, as the server reports one: SQLSTATE 40P01)."""
    calls: Counter[str] = Counter()
    _, handler = pay_registry(calls, hang)
    settings = make_settings(claim_lease=5, claim_call_timeout=4)
    engine = create_engine(database_url)
    blocker = None
    if database_url.startswith("sqlite"):
        claiming = create_async_engine(database_url, connect_args={"timeout": 0.05})
        blocker = await hold_key(engine)
    else:
        claiming = engine
        async with engine.begin() as connection:
            await connection.execute(text(DEADLOCK_FUNCTION))
            await connection.execute(text(DEADLOCK_TRIGGER))
    try:
        outcome = await deliver(session_factory(claiming), handler, settings, FakeDelivery(1))
    finally:
        if blocker is not None:
            await blocker.rollback()
            await blocker.close()
        else:
            async with engine.begin() as connection:
                await connection.execute(text("DROP TRIGGER claim_deadlock ON inbox"))
                await connection.execute(text("DROP FUNCTION claim_deadlock()"))
        rows = await inbox_rows(engine)
        await claiming.dispose()
        await engine.dispose()
    assert (outcome.verb, outcome.outcome, outcome.counted) == ("nack", "claim-contended", False)
    assert outcome.delay is not None and outcome.delay <= settings.retry_backoff_max
    assert rows == [] and calls == Counter()


class Receipt(Base):
    __tablename__ = "claim_receipts"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int] = mapped_column(BigInteger)


class VersionedWallet(Base):
    __tablename__ = "claim_versioned_wallet"
    id: Mapped[int] = mapped_column(primary_key=True)
    paid: Mapped[int]
    version: Mapped[int] = mapped_column()
    __mapper_args__ = {"version_id_col": version}


async def test_a_call_whose_writes_lose_to_another_writer_is_given_back_uncounted(
    database_url: str, make_settings: MakeSettings
) -> None:
    """The call succeeded, then its write met a version conflict: nothing was recorded.
    The lease goes at once (the call is over) and the delivery comes back uncounted while
    the claim's attempts stay below WORKER_MAX_DELIVERIES; the repeated call has the same key."""
    engine = create_engine(database_url)
    other = create_async_engine(database_url)  # another writer, outside the worker
    wallets = cast(Table, VersionedWallet.__table__)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(lambda sync: wallets.create(sync))
            await connection.execute(insert(wallets).values(id=1, paid=0, version=1))

        async def credit(ctx: ClaimContext, message: Pay) -> str:
            wallet = await ctx.session.get_one(VersionedWallet, 1)
            if ctx.claim.attempts == 1:  # someone else commits between our read and our write
                async with other.begin() as connection:
                    await connection.execute(
                        update(wallets).values(
                            paid=wallets.c.paid + 1, version=wallets.c.version + 1
                        )
                    )
            wallet.paid += message.amount
            return "paid"

        calls: Counter[str] = Counter()
        _, handler = pay_registry(calls, credit)
        settings = make_settings(claim_lease=5, claim_call_timeout=4, max_deliveries=5)
        sessions = session_factory(engine)
        lost = await deliver(sessions, handler, settings, FakeDelivery(1))
        [row] = await inbox_rows(engine)
        again = await deliver(sessions, handler, settings, FakeDelivery(1))  # not counted
        spent = await deliver(  # a claim out of attempts: counted, so a hot row still ends
            sessions, handler, make_settings(max_deliveries=1), FakeDelivery(1, message_id="m2")
        )
        async with engine.connect() as connection:
            paid = await connection.scalar(select(wallets.c.paid).where(wallets.c.id == 1))
    finally:
        await other.dispose()
        await engine.dispose()
    assert (lost.verb, lost.outcome, lost.counted) == ("nack", "finish-contended", False)
    assert lost.delay is not None and lost.delay <= settings.retry_backoff_max
    assert row.state == "claimed" and row.outcome.startswith("not recorded: StaleDataError")
    assert (again.verb, again.outcome) == ("ack", "committed")  # taken over at once
    assert (spent.outcome, spent.counted) == ("finish-contended", True)
    assert paid == 1 + 10 + 1  # theirs, ours once, theirs again for m2
    assert calls == Counter({"m1": 2, "m2": 1})  # m1 twice, with one key


async def test_a_call_whose_writes_the_database_refuses_abandons_its_claim(
    database_url: str, make_settings: MakeSettings
) -> None:
    """The call succeeded, then its write carries a value the database refuses for good
    (an integer beyond 64 bits: SQLSTATE class 22 on PostgreSQL, OverflowError on SQLite).
    The pump dead-letters that as poison; the claim is abandoned with it, so the sweeper
    never calls the provider again for a message in the dead-letter queue."""
    engine = create_engine(database_url)
    receipts = cast(Table, Receipt.__table__)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(lambda sync: receipts.create(sync))

        async def record(ctx: ClaimContext, message: Pay) -> str:
            if ctx.message_id == "sent-at-once":  # fails inside the call
                await ctx.session.execute(insert(receipts).values(amount=2**70))
            else:  # pending: fails when the claim is marked finished
                ctx.session.add(Receipt(amount=2**70))
            return "paid"

        calls: Counter[str] = Counter()
        registry, handler = pay_registry(calls, record)
        settings = make_settings(claim_lease=1.5, claim_call_timeout=1.2, max_deliveries=5)
        sessions = session_factory(engine)
        raised = []
        for kind in ("sent-at-once", "flushed-at-finish"):
            with pytest.raises((DBAPIError, OverflowError)) as error:
                await deliver(sessions, handler, settings, FakeDelivery(1, message_id=kind))
            raised.append(error.value)
        rows = await inbox_rows(engine)
        await asyncio.sleep(1.6)  # past the lease the claims had
        swept = await sweeper.redrive(sessions, registry, settings, LOG)
    finally:
        await engine.dispose()
    assert [classify(exc) for exc in raised] == [Failure.DATA] * 2  # the pump: poison
    assert [(row.state, row.lease_until) for row in rows] == [("abandoned", None)] * 2
    assert rows[1].outcome.startswith("not recorded: ")
    assert swept == Counter()  # never called again for a message in the dead-letter queue
    assert calls == Counter({"sent-at-once": 1, "flushed-at-finish": 1})


DEADLOCK_FUNCTION = """
CREATE FUNCTION claim_deadlock() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01';
END $$
"""
DEADLOCK_TRIGGER = """
CREATE TRIGGER claim_deadlock BEFORE INSERT ON inbox
    FOR EACH ROW WHEN (NEW.consumer = 'pay') EXECUTE FUNCTION claim_deadlock()
"""
