"""Real ``worker run`` processes behind loopback proxies to PostgreSQL and RabbitMQ, through a
run of network faults: black holes, resets and refusals of both, with workers started while
a fault lasts. Running workers lose nothing and double nothing; starting ones come up when
the fault ends, without exiting (DESIGN: "the environment's faults are not the message's")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.rabbitmq.rabbit_helpers import publish, rabbit_env, take_dead_letters, unsettled
from tests.rabbitmq.test_rabbitmq_workers_survive_kills_and_restarts import make_stream
from tests.support.database import balances, marker_count, scalar
from tests.support.processes import Fleet
from tests.support.proxy import proxied, proxied_amqp
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.timeout(400),
]

UNIQUE = 1_500


async def test_running_workers_lose_nothing_and_starting_ones_wait_out_the_faults(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str, pg: str, tmp_path: Path
) -> None:
    rabbit = rabbit_settings(retry_delays=[0.2, 1.0])
    stream, expected = make_stream(UNIQUE, 0.25, seed=11)
    database, database_url = await proxied(pg)
    broker, amqp_url = await proxied_amqp(rabbit.url)
    env = rabbit_env(
        rabbit.model_copy(update={"url": amqp_url}), database_url,
        WORKER_CONCURRENCY="8", WORKER_GRACE_PERIOD="10", WORKER_LOG_LEVEL="INFO",
        WORKER_RABBITMQ_CONNECT_TIMEOUT="2", WORKER_START_TIMEOUT="120",
    )  # fmt: skip
    fleet = Fleet(env, tmp_path)
    done: list[str] = []

    async def progress() -> float:
        return float(await scalar(pg, "SELECT count(*) FROM inbox")) / UNIQUE

    async def until(fraction: float) -> None:
        await wait_for_progress(progress, fraction, done)

    try:
        for slot in "ab":
            fleet.start(slot)
        await wait_for(fleet.all_started, 60, "2 workers")
        await publish(rabbit, stream)  # straight to the server: the fault is the workers'
        await until(0.10)
        database.blackhole()
        done.append("database black hole 5 s")
        await asyncio.sleep(5)
        await database.heal()
        await until(0.25)
        broker.reset()
        await broker.refuse()
        fleet.start("c")  # starts while the broker refuses
        done.append("broker reset, refused 3 s, worker c started")
        await asyncio.sleep(3)
        await broker.heal()
        await until(0.45)
        broker.blackhole()
        done.append("broker black hole 8 s, then reset")
        await asyncio.sleep(8)
        await broker.heal()
        broker.reset()
        await until(0.60)
        await database.refuse()
        fleet.start("d")  # starts while the database refuses
        done.append("database refused 3 s, worker d started")
        await asyncio.sleep(3)
        await database.heal()
        await until(0.75)
        database.reset()
        done.append("database connections reset")
        await wait_for(
            lambda: all(w.logged("pump started") for w in fleet.live.values()), 60, "c and d up"
        )
        deadline = time.monotonic() + 120
        while await scalar(pg, "SELECT count(*) FROM inbox") < UNIQUE or unsettled(
            rabbitmq_vhost, rabbit
        ):
            if time.monotonic() > deadline:
                pytest.fail(f"not drained: {await progress():.1%} after {done}")
            await asyncio.sleep(0.2)
        exited = {slot: w.process.poll() for slot, w in fleet.live.items()}
        assert exited == {slot: None for slot in "abcd"}, f"a worker exited: {exited}"
        await fleet.stop()
        assert all(code == 0 for code in fleet.exit_codes.values()), fleet.exit_codes
    finally:
        fleet.kill_all()
        await database.close()
        await broker.close()
    assert await balances(pg) == expected, done
    assert await marker_count(pg) == UNIQUE
    assert await take_dead_letters(rabbit) == []


async def wait_for_progress(
    progress: Callable[[], Awaitable[float]], fraction: float, done: list[str]
) -> None:
    deadline = time.monotonic() + 90
    while await progress() < fraction:
        if time.monotonic() > deadline:
            pytest.fail(f"stuck below {fraction:.0%} after {done}")
        await asyncio.sleep(0.1)
