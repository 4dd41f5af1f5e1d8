"""Real ``worker run`` processes against the real RabbitMQ and PostgreSQL: kills and restarts.

The acceptance scenario: three workers share one queue; 5,000 credits over 20
accounts, 20% of them published twice under the same message id; one worker is
SIGKILLed twice (and restarted), another SIGTERMed once. The same scenario run
through the naive check-then-insert handler must come out wrong, or the test
could not tell.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path

import pytest

from tests.rabbitmq.rabbit_helpers import (
    all_depths,
    credit_registry,
    publish,
    rabbit_env,
    running,
    settled,
    take_dead_letters,
    unsettled,
)
from tests.support.credits import credit
from tests.support.database import balances, execute, fetch, marker_count, scalar
from tests.support.processes import Fleet, WorkerProcess, events
from tests.support.rabbitmq import MakeRabbitSettings, arabbitmqctl
from tests.support.waiting import wait_for
from worker.brokers import OutgoingMessage
from worker.brokers.rabbitmq import RabbitMQSettings
from worker.registry import Context

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]

ACCOUNTS = 20
UNIQUE = 5_000
TWICE = 0.20

# tests/rabbitmq/naive_handlers.py's tables (importing it here would register its handler)
NAIVE_TABLES = (
    "CREATE TABLE IF NOT EXISTS naive_accounts (id text PRIMARY KEY, balance numeric(18, 2))",
    "CREATE TABLE IF NOT EXISTS naive_inbox (id bigserial PRIMARY KEY, message_id text)",
)


def make_stream(
    unique: int, twice: float, seed: int = 3, type: str = "CreditRequested"
) -> tuple[list[OutgoingMessage], dict[str, Decimal]]:
    """Unique credits plus second copies of a fraction of them, some adjacent, some later."""
    rng = random.Random(seed)
    keyed: list[tuple[float, OutgoingMessage]] = []
    expected: dict[str, Decimal] = {}
    for n in range(unique):
        account, amount = f"acct-{n % ACCOUNTS:02d}", Decimal(rng.randint(1, 10_000)) / 100
        message = credit(f"msg-{n:05d}", account, amount, type)
        expected[account] = expected.get(account, Decimal(0)) + amount
        keyed.append((n, message))
    for n in rng.sample(range(unique), int(unique * twice)):
        # adjacent copies race each other on two workers; later ones are plain redeliveries
        keyed.append((n + 0.5 if rng.random() < 0.5 else rng.uniform(n, unique), keyed[n][1]))
    keyed.sort(key=lambda pair: pair[0])
    return [message for _, message in keyed], expected


async def run_scenario(
    rabbit: RabbitMQSettings,
    vhost: str,
    database_url: str,
    tmp_path: Path,
    handlers: str,
    progress_sql: str,
    stream: list[OutgoingMessage],
) -> Fleet:
    env = rabbit_env(
        rabbit, database_url, WORKER_HANDLERS=handlers, WORKER_CONCURRENCY="8",
        WORKER_GRACE_PERIOD="10", WORKER_LOG_LEVEL="INFO",
    )  # fmt: skip
    fleet = Fleet(env, tmp_path)
    try:
        started = time.monotonic()
        for slot in "abc":
            fleet.start(slot)
        await wait_for(fleet.all_started, 60, "3 workers")
        publishing = asyncio.create_task(publish(rabbit, stream))  # consumed meanwhile
        plan = [(0.10, "kill", "a"), (0.35, "kill", "a"), (0.60, "term", "b")]
        drained = _drained(rabbit, vhost, database_url, progress_sql, publishing)
        while not await drained():
            progress = await scalar(database_url, progress_sql) / UNIQUE
            if plan and progress >= plan[0][0]:
                _, action, slot = plan.pop(0)
                await fleet.act(action, slot, progress)
            if time.monotonic() - started > 150:
                pytest.fail(f"not drained in time; progress {progress:.1%}, {fleet.events}")
            await asyncio.sleep(0.1)
        assert not plan, f"drained before every kill happened: {fleet.events}"
        fleet.seconds = time.monotonic() - started
        await fleet.stop()
    finally:
        fleet.kill_all()
    return fleet


def _drained(
    rabbit: RabbitMQSettings,
    vhost: str,
    database_url: str,
    progress_sql: str,
    publishing: asyncio.Task[None],
) -> Callable[[], Awaitable[bool]]:
    """Every unique message processed and nothing left in (or held from) the queues."""

    async def check() -> bool:
        if not publishing.done() or await scalar(database_url, progress_sql) < UNIQUE:
            return False
        publishing.result()  # a failed publish fails here
        return await asyncio.to_thread(unsettled, vhost, rabbit) == 0

    return check


@pytest.mark.slow
async def test_three_workers_kills_and_duplicates_come_out_exact(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str, pg: str, tmp_path: Path
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings(retry_delays=[0.2, 1.0])
    stream, expected = make_stream(UNIQUE, TWICE)
    run = await run_scenario(
        rabbit, rabbitmq_vhost, pg, tmp_path, "handlers", "SELECT count(*) FROM inbox", stream
    )
    assert len(run.events) == 3 and all(code == 0 for code in run.exit_codes.values()), run
    assert await balances(pg) == expected
    assert await marker_count(pg) == UNIQUE
    assert await scalar(pg, "SELECT count(DISTINCT message_id) FROM inbox") == UNIQUE
    assert set((await all_depths(rabbit)).values()) == {0}
    assert await take_dead_letters(rabbit) == []

    caught = events(run.workers, "duplicate")
    copies = len(stream) - UNIQUE
    assert len(caught) >= copies, "every second copy must be acked as a logged duplicate"
    assert all(line["message_id"] and line["consumer"] == "credit" for line in caught)
    report = {
        "seconds": round(run.seconds, 1),
        "published": len(stream),
        "events": run.events,
        "duplicates logged": len(caught),
        "of which redeliveries (fast path)": sum(1 for c in caught if c.get("fast_path")),
        "redelivered deliveries seen as duplicates": sum(c["delivery_count"] > 1 for c in caught),
        "nacked (retry queue)": len(events(run.workers, "attempts-exhausted")),
        "settlements lost": len(events(run.workers, "settlement lost, broker will redeliver")),
        "version conflicts retried (gracefully stopped workers)": sum(
            line.get("retried-conflict", 0) for line in events(run.workers, "pump stopped")
        ),
    }
    print(f"\nacceptance: {report}")  # read with -s for the closing note


@pytest.mark.slow
async def test_the_naive_handler_fails_the_same_scenario(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str, pg: str, tmp_path: Path
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings(retry_delays=[0.2, 1.0])
    stream, expected = make_stream(UNIQUE, TWICE)
    accounts = ", ".join(f"('acct-{n:02d}', 0)" for n in range(ACCOUNTS))
    await execute(pg, *NAIVE_TABLES, "TRUNCATE naive_accounts, naive_inbox",
                  f"INSERT INTO naive_accounts VALUES {accounts}")  # fmt: skip
    run = await run_scenario(
        rabbit, rabbitmq_vhost, pg, tmp_path, "tests.rabbitmq.naive_handlers",
        "SELECT count(DISTINCT message_id) FROM naive_inbox", stream,
    )  # fmt: skip
    actual = await balances(pg, "naive_accounts")
    markers = await scalar(pg, "SELECT count(*) FROM naive_inbox")
    print(
        f"\nnaive: expected total {sum(expected.values())}, actual {sum(actual.values())}, "
        f"accounts exact {sum(actual[a] == e for a, e in expected.items())}/{ACCOUNTS}, "
        f"markers {markers} for {UNIQUE} messages, events {run.events}"
    )
    assert actual != expected, "the naive handler came out exact: this scenario proves nothing"


@pytest.mark.slow
@pytest.mark.serial  # stop_app: every connection to the server drops, other tests' too
async def test_a_rabbitmq_restart_loses_nothing(
    rabbit_settings: MakeRabbitSettings, pg: str, rabbitmq_vhost: str
) -> None:
    """Stops and starts the local server's RabbitMQ application (``rabbitmqctl stop_app``).

    ``stop_app`` drops every connection like a restart but keeps the Erlang node
    up, so it takes seconds, not tens of seconds. It affects every user of the
    local server, so it is always followed by ``start_app``, even on failure.
    """
    rabbit: RabbitMQSettings = rabbit_settings(reconnect_interval=0.5)
    total = 1_000
    messages = [credit(f"r{n}", f"acct-{n % ACCOUNTS:02d}", "1") for n in range(total)]
    await publish(rabbit, messages)

    async def slowly(ctx: Context) -> None:
        await asyncio.sleep(0.005)

    registry, _ = credit_registry(slowly)
    readiness: list[bool] = []
    async with running(rabbit, pg, registry, concurrency=4) as pump:
        broker = pump.broker
        await wait_for(lambda: pump.stats["committed"] >= 100, 30, "100 commits")
        stopped = time.monotonic()
        try:
            await arabbitmqctl("stop_app")
            await wait_for(lambda: not broker.ready, 10, "not ready while the broker is down")
            readiness.append(pump.ready)
            await asyncio.sleep(1.0)
            readiness.append(pump.ready)
            done_while_down = pump.stats["committed"]
        finally:
            await arabbitmqctl("start_app")
        await wait_for(lambda: broker.ready, 60, "the reconnect")
        outage = time.monotonic() - stopped
        await wait_for(_inbox_count_is(pg, total), 90, "every message committed")
        await wait_for(settled(rabbitmq_vhost, rabbit), 30, "every message acked")
    assert readiness == [False, False]
    assert await marker_count(pg) == total
    assert set((await balances(pg)).values()) == {Decimal(total // ACCOUNTS)}
    assert set((await all_depths(rabbit)).values()) == {0}
    print(
        f"\nrestart: outage {outage:.1f}s, committed before start_app {done_while_down}, "
        f"settlements lost {pump.stats['settlement-lost']}, duplicates {pump.stats['duplicate']}"
    )


def _inbox_count_is(database_url: str, expected: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await marker_count(database_url) == expected

    return check


async def test_sigterm_mid_batch_acks_nothing_unfinished(
    rabbit_settings: MakeRabbitSettings, pg: str, tmp_path: Path
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings()
    total = 60
    await publish(rabbit, [credit(f"s{n}", "a", str(n + 1), "SlowCredit") for n in range(total)])
    env = rabbit_env(
        rabbit, pg, WORKER_HANDLERS="tests.rabbitmq.slow_handlers", WORKER_CONCURRENCY="8",
        WORKER_GRACE_PERIOD="0.3", WORKER_TEST_HANDLER_SECONDS="2.0",
    )  # fmt: skip
    # the second wave is 0.35 s (plus the poll's lag) into its 2 s when SIGTERM lands, so
    # the 0.3 s grace ends with it in flight; 0.6 s handlers finished inside it under load
    worker = WorkerProcess(env, tmp_path / "first.log")
    try:
        await wait_for(_inbox_at_least(pg, 8), 30, "the first commits")
        await asyncio.sleep(0.35)  # mid-batch: a fresh prefetch is in the handlers now
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 30) == 0
    finally:
        worker.kill()
    assert worker.logged("grace period over, cancelled in-flight work"), "nothing was mid-batch"
    left = (await all_depths(rabbit))[rabbit.queue]
    done = [r.message_id for r in await fetch(pg, "SELECT message_id FROM inbox")]
    assert 0 < len(done) < total
    # Acked = total - left. An acked message without a marker would be lost work;
    # a marker without an ack (cancelled between commit and ack) is a redelivery
    # the inbox absorbs, so ">=" is the safe direction.
    assert len(done) + left >= total
    (balance,) = [r.balance for r in await fetch(pg, "SELECT balance FROM accounts")]
    assert balance == sum(int(m[1:]) + 1 for m in done), "balance and inbox disagree"

    drainer = WorkerProcess(env, tmp_path / "second.log")
    try:
        await wait_for(_inbox_count_is(pg, total), 60, "the rest, after a restart")
        drainer.signal(signal.SIGTERM)
        assert await asyncio.to_thread(drainer.wait, 30) == 0
    finally:
        drainer.kill()
    (balance,) = [r.balance for r in await fetch(pg, "SELECT balance FROM accounts")]
    assert balance == sum(range(1, total + 1))
    assert set((await all_depths(rabbit)).values()) == {0}


def _inbox_at_least(database_url: str, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await marker_count(database_url) >= count

    return check
