"""The relay: claims with a lease, confirmed publishing, parking, order, wake-up, retention."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import BaseModel
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.outbox.outbox_helpers import (
    RecordingPublisher,
    RunningRelays,
    fast_outbox,
    outbox_rows,
    publish_rows,
)
from tests.support.processes import clean_env, run_cli
from tests.support.pumps import MakeSettings, RunPumps
from tests.support.waiting import wait_for
from worker.brokers.memory import MemoryBroker, MemoryPublisher
from worker.brokers.publishers import Outgoing
from worker.db import create_engine
from worker.errors import BrokerUnavailable
from worker.outbox.model import OutboxMessage
from worker.outbox.relay import Relay, purge
from worker.registry import Context, Registry


class Item(BaseModel):
    key: str
    n: int


def item_registry(events_per_message: int = 1) -> Registry:
    registry = Registry()

    @registry.handler("Item", Item, consumer="items")
    async def item(ctx: Context, message: Item) -> None:
        for e in range(events_per_message):
            await ctx.publish("ItemSeen", {"n": message.n, "e": e}, key=message.key)

    return registry


async def produce(
    engine: AsyncEngine,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    items: list[tuple[str, int]],
) -> None:
    """Run a pump over ``items`` so each adds its outbox rows, then stop it."""
    broker = MemoryBroker()
    settings = make_settings(concurrency=1)
    async with run_pumps([broker.connect()], [engine], item_registry(), settings):
        for key, n in items:
            broker.publish(f"item-{n}", "Item", {"key": key, "n": n})
        await broker.wait_idle(timeout=60)


async def test_the_relay_publishes_and_marks_sent(
    engine: AsyncEngine,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    publisher: RecordingPublisher,
) -> None:
    await produce(engine, make_settings, run_pumps, [("a", n) for n in range(25)])
    relay = Relay(engine, publisher, fast_outbox(batch=10))
    assert await relay.drain() == 25
    rows = await outbox_rows(engine)
    assert {r.state for r in rows} == {"sent"} and all(r.sent_at for r in rows)
    assert sorted(m.message_id for m in publisher.sent) == sorted(r.message_id for r in rows)
    assert publisher.sent[0].headers["ce-id"] == publisher.sent[0].message_id
    assert await relay.drain() == 0  # nothing twice


async def test_delete_sent_removes_confirmed_rows(
    engine: AsyncEngine,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    publisher: RecordingPublisher,
) -> None:
    await produce(engine, make_settings, run_pumps, [("a", n) for n in range(5)])
    assert await Relay(engine, publisher, fast_outbox(delete_sent=True)).drain() == 5
    assert await outbox_rows(engine) == []


async def test_a_commit_wakes_the_relay_before_its_poll(
    engine: AsyncEngine,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    running_relays: RunningRelays,
) -> None:
    """With a 30 s poll, only the in-process wake-up can get an event out in time."""
    events = MemoryBroker()
    relay = Relay(engine, MemoryPublisher(events), fast_outbox(poll_interval=30.0))
    broker = MemoryBroker()
    latencies: list[float] = []

    def woken(count: int) -> Callable[[], bool]:
        return lambda: len(events.ready) > count

    async with (
        running_relays([relay]),
        run_pumps([broker.connect()], [engine], item_registry(), make_settings()),
    ):
        await asyncio.sleep(0.2)  # the relay has polled once and sleeps now
        for n in range(20):
            started = time.perf_counter()
            broker.publish(f"w-{n}", "Item", {"key": "k", "n": n})
            await wait_for(woken(n), 5, "the woken relay", step=0.001)
            latencies.append(time.perf_counter() - started)
    latencies.sort()
    p50, p95 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.95) - 1]
    print(f"delivery -> commit -> relay confirm: p50 {p50 * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms")
    assert p95 < 2.0


async def test_a_refused_row_is_parked_then_retried_by_the_cli(
    engine: AsyncEngine,
    database_url: str,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    publisher: RecordingPublisher,
) -> None:
    await produce(engine, make_settings, run_pumps, [("a", 1), ("b", 2)])
    poison = (await outbox_rows(engine))[0].message_id
    publisher.refuse = lambda m: "unroutable: no queue bound" if m.message_id == poison else None
    relay = Relay(engine, publisher, fast_outbox(max_attempts=3))
    for _ in range(5):
        await relay.drain()
    rows = {r.message_id: r for r in await outbox_rows(engine)}
    assert (rows[poison].state, rows[poison].attempts) == ("parked", 3)
    assert rows[poison].last_error == "unroutable: no queue bound"
    assert [m.message_id for m in publisher.sent] == [r for r in rows if r != poison]

    env = {**clean_env(), "WORKER_DATABASE_URL": database_url, "WORKER_LOG_LEVEL": "ERROR"}
    listed = run_cli(env, "outbox")
    assert listed.returncode == 0, listed.stderr
    lines = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(x["id"], x["state"], x["attempts"]) for x in lines] == [(poison, "parked", 3)]
    assert "0 pending" in listed.stderr and "1 parked" in listed.stderr

    publisher.refuse = lambda m: None  # the destination is fixed
    retried = run_cli(env, "outbox", "--retry")
    assert retried.returncode == 0, retried.stderr
    assert "re-queued 1 parked" in retried.stderr
    assert await relay.drain() == 1
    assert {r.state for r in await outbox_rows(engine)} == {"sent"}
    assert publisher.sent[-1].message_id == poison


async def test_an_unreachable_broker_spends_no_attempt(
    engine: AsyncEngine,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    publisher: RecordingPublisher,
) -> None:
    await produce(engine, make_settings, run_pumps, [("a", n) for n in range(6)])
    publisher.unreachable = 20
    relay = Relay(engine, publisher, fast_outbox(max_attempts=2))
    for _ in range(20):
        result = await relay.run_once()
        assert result.unavailable and result.sent == 0
    backlog = await relay.update_gauges()
    assert (backlog.pending, backlog.parked) == (6, 0)
    assert backlog.oldest_pending_seconds >= 0
    assert {(r.state, r.attempts, r.lease_until) for r in await outbox_rows(engine)} == {
        ("pending", 0, None)
    }
    assert await relay.drain() == 6  # the broker is back: the backlog drains
    assert (await relay.update_gauges()).pending == 0


async def test_an_expired_lease_is_taken_over_with_the_same_id(
    engine: AsyncEngine,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    publisher: RecordingPublisher,
) -> None:
    """A relay that claimed and vanished: its rows go out again once the lease is over."""
    await produce(engine, make_settings, run_pumps, [("a", 1)])
    # a 3 s lease: the second claim must come inside it, on a busy machine too
    crashed = Relay(engine, publisher, fast_outbox(lease=3.0, publish_timeout=0.5), name="dead")
    claimed = await crashed.claim()
    assert len(claimed) == 1
    other = Relay(engine, publisher, fast_outbox(lease=3.0, publish_timeout=0.5), name="alive")
    assert await other.claim() == []  # leased: not yet
    await asyncio.sleep(3.1)
    assert await other.drain() == 1
    assert publisher.sent[0].message_id == claimed[0].message.message_id


async def test_keyed_rows_go_out_in_order_across_three_relays(
    engine: AsyncEngine,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    running_relays: RunningRelays,
) -> None:
    rng = random.Random(3)
    items = [(f"key-{rng.randrange(4)}", n) for n in range(60)]
    await produce(engine, make_settings, run_pumps, items)
    publisher = RecordingPublisher(delay=0.002)
    flaky = random.Random(5)
    publisher.refuse = lambda m: "flaky" if flaky.random() < 0.2 else None
    relays = [Relay(engine, publisher, fast_outbox(ordered=True, batch=5)) for _ in range(3)]
    async with running_relays(relays):
        await wait_for(lambda: len(publisher.sent) >= 60, 60, "every row published")
    by_key: dict[str, list[int]] = defaultdict(list)
    for message in publisher.sent:
        by_key[message.key or ""].append(json.loads(message.body)["n"])
    expected: dict[str, list[int]] = defaultdict(list)
    for key, n in items:
        expected[key].append(n)
    assert by_key == expected
    assert publisher.overlaps == 0


@pytest.mark.postgres
async def test_three_relays_on_postgres_publish_each_row_once(
    postgres_only_url: str,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    running_relays: RunningRelays,
) -> None:
    """SKIP LOCKED claims: in normal operation no row is published twice, or twice at once."""
    engines = [create_engine(postgres_only_url, pool_size=4) for _ in range(3)]
    try:
        items = [(f"k{n % 7}", n) for n in range(600)]
        await produce(
            engines[0],
            lambda **kw: make_settings(database_url=postgres_only_url, **kw),
            run_pumps,
            items,
        )
        publisher = RecordingPublisher(delay=0.005)
        relays = [Relay(e, publisher, fast_outbox(batch=20)) for e in engines]
        async with running_relays(relays):
            await wait_for(lambda: len(publisher.sent) >= 600, 60, "every row published")
            await asyncio.sleep(0.3)  # time for a second copy, if one were coming
        counts = Counter(m.message_id for m in publisher.sent)
        assert len(counts) == 600 and set(counts.values()) == {1}
        assert publisher.overlaps == 0
        assert all(r.stats["published"] > 0 for r in relays), [r.stats for r in relays]
    finally:
        for e in engines:
            await e.dispose()


async def test_sent_rows_are_purged_after_the_retention_in_batches(
    engine: AsyncEngine,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    publisher: RecordingPublisher,
) -> None:
    await produce(engine, make_settings, run_pumps, [("a", n) for n in range(30)])
    settings = fast_outbox(retention=timedelta(hours=1), purge_batch=7)
    assert await Relay(engine, publisher, settings).drain() == 30
    old = datetime.now(UTC) - timedelta(hours=2)
    async with engine.begin() as connection:
        await connection.execute(
            update(OutboxMessage).where(OutboxMessage.id <= 20).values(sent_at=old)
        )
    assert await purge(engine, settings) == 20
    assert len(await outbox_rows(engine)) == 10


class OneDestinationHangs(RecordingPublisher):
    """A producer whose sends to ``stuck`` never get an answer: the other messages of the
    call go out, and the call as a whole gives up (aiokafka's sends under one timeout)."""

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        served = await super().publish([m for m in messages if m.destination != "stuck"])
        if len(served) < len(messages):
            raise BrokerUnavailable("kafka: no acks within 2.0s")
        return served


async def test_a_destination_that_never_answers_costs_only_its_own_rows(
    engine: AsyncEngine,
) -> None:
    """While other rows keep going out, the stuck row counts an attempt per round and is
    parked; the good rows of its batches go out once, and are marked sent, instead of
    heading every round again."""
    events = [("Seen", {"n": n}, None, "events") for n in range(4)]
    ids = await publish_rows(engine, "in-0", [*events, ("Seen", {"n": 9}, None, "stuck")])
    publisher = OneDestinationHangs()
    relay = Relay(engine, publisher, fast_outbox(max_attempts=3))
    first = await relay.run_once()
    assert (first.sent, first.unserved, first.unavailable) == (4, 1, False)
    for n in range(1, 6):  # more traffic: a new row beside the stuck one, round after round
        ids += await publish_rows(engine, f"in-{n}", [("Seen", {"n": n}, None, "events")])
        await relay.run_once()
    rows = {r.message_id: r for r in await outbox_rows(engine)}
    good = [i for i in ids if i != ids[4]]
    assert sorted(m.message_id for m in publisher.sent) == sorted(good)  # each once
    assert {rows[i].state for i in good} == {"sent"}
    stuck = rows[ids[4]]
    assert (stuck.state, stuck.attempts) == ("parked", 3)
    assert stuck.last_error == "destination 'stuck': kafka: no acks within 2.0s"


async def test_a_destination_that_never_answers_alone_spends_no_attempt(
    engine: AsyncEngine,
) -> None:
    """Nothing of the round was confirmed: the broker may be away, so nothing counts."""
    ids = await publish_rows(engine, "in-1", [("Seen", {"n": 1}, None, "stuck")])
    relay = Relay(engine, OneDestinationHangs(), fast_outbox(max_attempts=1))
    for _ in range(3):
        assert (await relay.run_once()).unavailable
    (row,) = await outbox_rows(engine)
    assert (row.message_id, row.state, row.attempts, row.lease_until) == (
        ids[0],
        "pending",
        0,
        None,
    )


class StuckDestinationTimesOut(RecordingPublisher):
    """Sends to ``stuck`` wait for the whole publish timeout, then give up, as a publisher
    does when no confirmation comes; every other call is answered at once."""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.timeout = timeout

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        if any(m.destination == "stuck" for m in messages):
            await asyncio.sleep(self.timeout)
            raise BrokerUnavailable(f"no confirms within {self.timeout}s")
        return await super().publish(messages)


async def test_a_destination_that_timed_out_goes_last_and_no_round_outlives_its_lease(
    engine: AsyncEngine,
) -> None:
    """Destinations are published one after another. A call that could not end inside
    the lease is not started (its rows wait, uncounted), and a destination that gave no
    answer goes last next round, so an old stuck row cannot keep the others out."""
    settings = fast_outbox(lease=3.0, publish_timeout=2.0, max_attempts=5)
    stuck = await publish_rows(engine, "in-0", [("Seen", {"n": 0}, None, "stuck")])
    good = await publish_rows(engine, "in-1", [("Seen", {"n": n}, None, "events") for n in (1, 2)])
    publisher = StuckDestinationTimesOut(settings.publish_timeout)
    relay = Relay(engine, publisher, settings)
    started = time.monotonic()
    first = await relay.run_once()
    assert time.monotonic() - started < settings.lease  # the second call would not fit
    assert (first.sent, first.deferred, first.unavailable) == (0, 2, True)
    assert {r.attempts for r in await outbox_rows(engine)} == {0}  # nobody's attempt yet
    second = await relay.run_once()
    assert (second.sent, second.unserved) == (2, 1)  # the others first, then the stuck one
    rows = {r.message_id: r for r in await outbox_rows(engine)}
    assert [rows[i].state for i in good] == ["sent", "sent"]
    assert (rows[stuck[0]].state, rows[stuck[0]].attempts) == ("pending", 1)
    assert sorted(m.message_id for m in publisher.sent) == sorted(good)


async def test_a_refusal_quoting_a_database_url_is_kept_and_listed_without_its_password(
    engine: AsyncEngine, database_url: str, publisher: RecordingPublisher
) -> None:
    secret = "S3cr3tPassw0rd"
    quoted = f"bridge to postgresql://ledger:{secret}@host/db refused it"
    ids = await publish_rows(engine, "in-1", [("Seen", {"n": n}, None, None) for n in (1, 2)])
    publisher.refuse = lambda m: quoted if m.message_id == ids[0] else None
    relay = Relay(engine, publisher, fast_outbox())
    assert (await relay.run_once()).refused == 1
    masked = "bridge to postgresql://ledger:***@host/db refused it"
    rows = {r.message_id: r for r in await outbox_rows(engine)}
    assert rows[ids[0]].last_error == masked  # at rest
    async with engine.begin() as connection:  # as a relay before the fix stored it
        await connection.execute(
            update(OutboxMessage)
            .where(OutboxMessage.message_id == ids[1])
            .values(state="parked", last_error=quoted)
        )

    env = {**clean_env(), "WORKER_DATABASE_URL": database_url, "WORKER_LOG_LEVEL": "ERROR"}
    listed = run_cli(env, "outbox")
    assert listed.returncode == 0, listed.stderr
    assert secret not in listed.stdout + listed.stderr
    assert [json.loads(line)["error"] for line in listed.stdout.splitlines()] == [masked, masked]


async def test_a_stopping_relay_starts_no_further_call_and_releases_the_rest(
    engine: AsyncEngine,
) -> None:
    """stop() waits for the call in flight, not for every destination after it: the
    rows not yet tried are released, uncounted, for the next relay."""
    settings = fast_outbox(lease=10.0, publish_timeout=1.0)
    await publish_rows(engine, "in-0", [("Seen", {"n": 0}, None, "stuck")])
    await publish_rows(engine, "in-1", [("Seen", {"n": 1}, None, "events")])
    publisher = StuckDestinationTimesOut(settings.publish_timeout)
    relay = Relay(engine, publisher, settings)
    asyncio.get_running_loop().call_later(0.2, relay.stop)  # while the stuck call waits
    result = await relay.run_once()
    assert (result.sent, result.deferred) == (0, 1)
    assert publisher.sent == []
    assert {(r.state, r.attempts, r.lease_until) for r in await outbox_rows(engine)} == {
        ("pending", 0, None)
    }
