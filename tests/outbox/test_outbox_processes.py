"""Real ``worker run`` processes: the relay inside every worker, SIGKILLs on both sides."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from tests.rabbitmq.rabbit_helpers import publish, rabbit_env, take_dead_letters
from tests.support.database import balances, fetch, marker_count, scalar
from tests.support.processes import WorkerProcess, free_port
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.waiting import wait_for
from worker.brokers import OutgoingMessage
from worker.brokers.rabbitmq import RabbitMQSettings

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.slow]

ORDERS = 600
ACCOUNTS = 10


async def _paced(settings: RabbitMQSettings, stream: list[OutgoingMessage]) -> None:
    """The stream in twenty parts a quarter of a second apart: the credits follow the
    publishing, so each planned kill finds work under way however fast the pumps drain
    (grouped, they drained the rest between two looks and a kill never happened)."""
    part = len(stream) // 20 + 1
    for start in range(0, len(stream), part):
        await publish(settings, stream[start : start + part])
        await asyncio.sleep(0.25)


def orders(seed: int = 11) -> tuple[list[OutgoingMessage], dict[str, Decimal]]:
    rng = random.Random(seed)
    stream: list[OutgoingMessage] = []
    expected: dict[str, Decimal] = {}
    for n in range(ORDERS):
        account, amount = f"acct-{n % ACCOUNTS}", Decimal(rng.randint(1, 9999)) / 100
        body = json.dumps({"account_id": account, "amount": str(amount)}).encode()
        stream.append(OutgoingMessage(f"order-{n:05d}", "Order", body))
        expected[account] = expected.get(account, Decimal(0)) + amount
    stream += rng.sample(stream, ORDERS // 5)  # producer retries: the same ids again
    return stream, expected


@pytest.mark.timeout(400)
async def test_every_order_on_a_yields_exactly_one_credit_on_b_through_sigkills(
    rabbit_settings: MakeRabbitSettings, postgres_only_url: str, tmp_path: Path
) -> None:
    a: RabbitMQSettings = rabbit_settings(retry_delays=[0.2, 1.0])
    b: RabbitMQSettings = rabbit_settings(
        queue=f"{a.queue}-b", exchange=f"{a.queue}-b.in", retry_delays=[0.2, 1.0]
    )
    pg = postgres_only_url
    outbox_env = {
        # every relay (A's and B's workers) sends A's rows to B, sharing the rows by lease
        "WORKER_OUTBOX_DESTINATION": f"{b.exchange}/CreditRequested",
        "WORKER_OUTBOX_LEASE": "3",
        "WORKER_OUTBOX_PUBLISH_TIMEOUT": "2",
        "WORKER_OUTBOX_POLL_INTERVAL": "0.2",
        "WORKER_CONCURRENCY": "8",
        "WORKER_GRACE_PERIOD": "5",
    }
    env_a = rabbit_env(a, pg, WORKER_HANDLERS="tests.outbox.outbox_handlers", **outbox_env)
    env_b = rabbit_env(b, pg, WORKER_HANDLERS="handlers.credit", **outbox_env)
    workers: list[WorkerProcess] = []
    live: dict[str, WorkerProcess] = {}

    def start(slot: str) -> None:
        env = env_a if slot.startswith("a") else env_b
        live[slot] = WorkerProcess(env, tmp_path / f"{slot}-{len(workers)}.log")
        workers.append(live[slot])

    def started() -> bool:
        for worker in live.values():
            if worker.process.poll() is not None:
                pytest.fail(worker.log_path.read_text()[-3000:])
        return all(w.logged("pump started") for w in live.values())

    stream, expected = orders()
    credits = "SELECT count(*) FROM inbox WHERE consumer = 'credit'"
    plan = [(0.15, "a1"), (0.40, "b1"), (0.65, "a2"), (0.80, "b2")]
    kills = []
    try:
        for slot in ("a1", "a2", "b1", "b2"):
            start(slot)
        await wait_for(started, 60, "4 workers")
        began = time.monotonic()
        publishing = asyncio.create_task(_paced(a, stream))
        deadline = time.monotonic() + 300
        while (done := await scalar(pg, credits)) < ORDERS or not publishing.done():
            if plan and done / ORDERS >= plan[0][0]:
                _, slot = plan.pop(0)
                live[slot].signal(signal.SIGKILL)  # that process, by its PID
                await asyncio.to_thread(live[slot].wait, 10)
                kills.append(f"{slot} at {done / ORDERS:.0%}")
                start(slot)
            if time.monotonic() > deadline:
                pytest.fail(f"{done}/{ORDERS} credits after 300 s; kills {kills}")
            await asyncio.sleep(0.1)
        publishing.result()
        seconds = time.monotonic() - began
        await asyncio.sleep(1.0)  # any late duplicate would land now
        # A relay killed between its publish and its "sent" leaves its claimed rows for
        # another relay once the lease (3 s) runs out: every row ends sent, some later.
        unsent = "SELECT count(*) FROM outbox WHERE state <> 'sent'"
        await wait_for(
            lambda: _none_left(pg, unsent), 30, "every outbox row sent (leases of killed relays)"
        )
        await wait_for(started, 60, "the restarted workers (SIGTERM needs their handlers)")
        for worker in live.values():
            worker.signal(signal.SIGTERM)
        for worker in live.values():
            assert await asyncio.to_thread(worker.wait, 30) == 0
    finally:
        for worker in workers:
            worker.kill()
    assert not plan, f"drained before every kill: {kills}"
    assert await balances(pg) == expected
    assert await scalar(pg, credits) == ORDERS
    assert await marker_count(pg, "consumer = 'orders'") == ORDERS
    assert await scalar(pg, "SELECT count(*) FROM outbox") == ORDERS
    assert await scalar(pg, "SELECT count(*) FROM outbox WHERE state <> 'sent'") == 0
    assert await take_dead_letters(a) == [] and await take_dead_letters(b) == []
    lag = sorted(
        row[0]
        for row in await fetch(
            pg, "SELECT EXTRACT(EPOCH FROM sent_at - created_at) FROM outbox ORDER BY 1"
        )
    )
    duplicates = sum(
        1 for w in workers for line in w.events("duplicate") if line.get("consumer") == "credit"
    )
    print(
        f"\noutbox e2e: {ORDERS} orders (+{len(stream) - ORDERS} producer retries) in "
        f"{seconds:.1f}s, kills {kills}; B absorbed {duplicates} duplicate credits (logged by "
        f"survivors); handler-start to sent p50 {float(lag[len(lag) // 2]) * 1000:.0f} ms, "
        f"p95 {float(lag[int(len(lag) * 0.95)]) * 1000:.0f} ms, max {float(lag[-1]):.1f} s"
    )


async def test_a_refusing_broker_leaves_readiness_alone_and_shows_the_backlog(
    rabbit_settings: MakeRabbitSettings, postgres_only_url: str, tmp_path: Path
) -> None:
    a: RabbitMQSettings = rabbit_settings(binding_keys=["Order"])
    port = free_port()
    env = rabbit_env(
        a,
        postgres_only_url,
        WORKER_HANDLERS="tests.outbox.outbox_handlers",
        WORKER_OPS_PORT=str(port),
        WORKER_OPS_HOST="127.0.0.1",
        WORKER_RABBITMQ_BINDING_KEYS='["Order"]',
        WORKER_OUTBOX_DESTINATION="Unroutable",  # a routing key nothing is bound to
        WORKER_OUTBOX_RETRY_BACKOFF="0.1",
        WORKER_OUTBOX_RETRY_BACKOFF_MAX="0.2",
        WORKER_OUTBOX_METRICS_INTERVAL="0.2",
        WORKER_OUTBOX_POLL_INTERVAL="0.1",
    )
    worker = WorkerProcess(env, tmp_path / "worker.log")
    try:
        await wait_for(lambda: worker.logged("pump started"), 60, "the worker")
        body = b'{"account_id": "x", "amount": "1"}'
        await publish(a, [OutgoingMessage(f"o-{n}", "Order", body) for n in range(3)])
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

            async def backlog_visible() -> bool:
                text = (await client.get("/metrics")).text
                return (
                    "worker_outbox_pending 3.0" in text
                    and _value(text, 'worker_outbox_failed_total{reason="refused"}') >= 3
                )

            await wait_for(backlog_visible, 30, "the refused backlog in /metrics", step=0.2)
            assert (await client.get("/readyz")).status_code == 200
            text = (await client.get("/metrics")).text
            assert _value(text, "worker_outbox_oldest_pending_seconds") > 0
            assert "worker_outbox_parked 0.0" in text
            assert "worker_outbox_published_total 0.0" in text
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 30) == 0
    finally:
        worker.kill()
    assert worker.logged("outbox publish refused")


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return -1.0


async def _none_left(database_url: str, sql: str) -> bool:
    left: int = await scalar(database_url, sql)
    return left == 0
