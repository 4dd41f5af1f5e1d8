"""A start survives a blip: ``worker run`` processes started while the database or the
broker refuses, resets or black-holes their connections wait (alive, not ready) and come up
when it ends; only a configuration no retry fixes, or a spent WORKER_START_TIMEOUT, exits.

Each test puts loopback proxies (tests/support/proxy.py) between the worker and the real
PostgreSQL and RabbitMQ, and faults only its own traffic."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path

import pytest

from tests.rabbitmq.rabbit_helpers import publish, rabbit_env
from tests.support.credits import credit
from tests.support.database import balances
from tests.support.processes import REPO, WorkerProcess, free_port, worker_cli
from tests.support.proxy import TcpProxy, proxied, proxied_amqp
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.slow]


def probe(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


async def status(port: int, path: str) -> int:
    return await asyncio.to_thread(probe, port, path)


@asynccontextmanager
async def proxies(pg: str, amqp: str) -> AsyncIterator[tuple[TcpProxy, str, TcpProxy, str]]:
    database, database_url = await proxied(pg)
    broker, amqp_url = await proxied_amqp(amqp)
    try:
        yield database, database_url, broker, amqp_url
    finally:
        await database.close()
        await broker.close()


def tries(worker: WorkerProcess, what: str) -> list[dict[str, object]]:
    return worker.events(f"{what} unavailable at start, retrying")


async def test_a_worker_started_during_refusals_comes_up_when_they_end(
    pg: str, amqp_url: str, rabbit_settings: MakeRabbitSettings, tmp_path: Path
) -> None:
    settings = rabbit_settings()
    async with proxies(pg, amqp_url) as (database, database_url, broker, proxied_url):
        await database.refuse()
        await broker.refuse()
        ops = free_port()
        env = rabbit_env(
            settings.model_copy(update={"url": proxied_url}), database_url,
            WORKER_OPS_PORT=str(ops), WORKER_OPS_HOST="127.0.0.1", WORKER_CONCURRENCY="4",
        )  # fmt: skip
        worker = WorkerProcess(env, tmp_path / "worker.log")
        try:
            await wait_for(lambda: len(tries(worker, "database")) >= 2, 30, "database retries")
            assert worker.process.poll() is None  # waiting, not exiting
            assert await status(ops, "/healthz") == 200 and await status(ops, "/readyz") == 503
            for line in tries(worker, "database"):
                assert str(line["reason"]).startswith("ConnectionRefusedError")  # never empty
            await database.heal()
            await wait_for(lambda: len(tries(worker, "broker")) >= 2, 30, "broker retries")
            assert await status(ops, "/readyz") == 503
            assert all(str(line["reason"]) for line in tries(worker, "broker"))
            await broker.heal()
            await wait_for(lambda: worker.logged("pump started"), 30, "the pump")
            await wait_for(lambda: probe(ops, "/readyz") == 200, 10, "ready")
            await publish(settings, [credit(f"m-{n}", "a", "1.00") for n in range(10)])
            await wait_for_balance(pg, {"a": Decimal("10.00")})
            worker.signal(signal.SIGTERM)
            assert await asyncio.to_thread(worker.wait, 30) == 0
        finally:
            worker.kill()


async def wait_for_balance(database_url: str, expected: dict[str, Decimal]) -> None:
    deadline = time.monotonic() + 30
    while await balances(database_url) != expected:
        if time.monotonic() > deadline:
            pytest.fail(f"balances {await balances(database_url)} != {expected}")
        await asyncio.sleep(0.1)


async def test_a_worker_started_into_a_black_hole_comes_up_when_it_heals(
    pg: str, amqp_url: str, rabbit_settings: MakeRabbitSettings, tmp_path: Path
) -> None:
    """The peer vanishes without a word: a connect that never answers is cut by the
    connect timeout and retried, never waited on for ever."""
    settings = rabbit_settings()
    async with proxies(pg, amqp_url) as (_, database_url, broker, proxied_url):
        broker.blackhole()
        env = rabbit_env(
            settings.model_copy(update={"url": proxied_url}), database_url,
            WORKER_RABBITMQ_CONNECT_TIMEOUT="1",
        )  # fmt: skip
        worker = WorkerProcess(env, tmp_path / "worker.log")
        try:
            await wait_for(lambda: len(tries(worker, "broker")) >= 2, 40, "broker retries")
            assert worker.process.poll() is None
            await broker.heal()
            broker.reset()  # the connections that sat in the hole
            await wait_for(lambda: worker.logged("pump started"), 40, "the pump")
            worker.signal(signal.SIGTERM)
            assert await asyncio.to_thread(worker.wait, 30) == 0
        finally:
            worker.kill()


def run_worker(env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        worker_cli("run"), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    return done.returncode, done.stderr, time.monotonic() - started


async def test_a_start_gives_up_once_the_start_timeout_is_spent(
    pg: str, amqp_url: str, rabbit_settings: MakeRabbitSettings
) -> None:
    settings = rabbit_settings()
    async with proxies(pg, amqp_url) as (database, database_url, _, _):
        await database.refuse()
        env = rabbit_env(settings, database_url, WORKER_START_TIMEOUT="2")
        code, stderr, seconds = await asyncio.to_thread(run_worker, env, 60)
    assert code == 1 and seconds < 30
    [line] = [x for x in stderr.splitlines() if x.startswith("worker: ")]
    assert line.startswith("worker: database unavailable: ") and "Connection" in line
    assert not line.rstrip().endswith(":")  # a reason, never an empty one


async def test_a_refused_login_stops_the_start_at_once(
    pg: str, rabbit_settings: MakeRabbitSettings
) -> None:
    """Configuration no retry can fix exits at once, whatever WORKER_START_TIMEOUT says."""
    no_such_role = pg.replace("://postgres@", "://no_such_role_here@", 1)
    assert no_such_role != pg
    env = rabbit_env(rabbit_settings(), no_such_role, WORKER_START_TIMEOUT="300")
    code, stderr, seconds = await asyncio.to_thread(run_worker, env, 60)
    assert code != 0 and seconds < 20
    assert "no_such_role_here" in stderr and "login" in stderr


async def test_an_unknown_vhost_stops_the_start_at_once(
    pg: str, rabbit_settings: MakeRabbitSettings
) -> None:
    settings = rabbit_settings()
    url = settings.url.rsplit("/", 1)[0] + "/no_such_vhost_here"
    env = rabbit_env(settings.model_copy(update={"url": url}), pg, WORKER_START_TIMEOUT="300")
    code, stderr, seconds = await asyncio.to_thread(run_worker, env, 60)
    assert code != 0 and seconds < 20
    [line] = [x for x in stderr.splitlines() if x.startswith("worker: ")]
    assert "no_such_vhost_here" in line and "Connection.Close" not in line
