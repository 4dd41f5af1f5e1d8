"""A rolling deploy, for real: SIGTERM to a ``worker run`` process in the middle of its work.

What Kubernetes relies on: readiness drops first (while the process still runs),
the deliveries in flight finish, commit and are settled, nothing new is started,
and the process exits 0 well within the grace period. Run twice: against the
memory broker (messages queued by a test-only handlers module) and against the
local RabbitMQ (the real adapter, messages published from outside the process).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from worker.db import create_engine

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONCURRENCY = 4
HANDLER_SECONDS = 2.0
GRACE_PERIOD = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def probe(port: int, path: str) -> tuple[int, dict[str, Any]] | None:
    """GET an ops path: (status, JSON body), or None while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return None


def in_flight(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("worker_in_flight "):
                return float(line.split()[1])
    return 0.0


def markers(database_url: str) -> int:
    """Committed deliveries: the inbox markers of the ``slow`` consumer."""

    async def count() -> int:
        engine = create_engine(database_url, pool_size=1)
        try:
            async with engine.connect() as connection:
                query = text("SELECT count(*) FROM inbox WHERE consumer = 'slow'")
                return int(await connection.scalar(query) or 0)
        finally:
            await engine.dispose()

    return asyncio.run(count())


def events(stderr: str) -> list[dict[str, Any]]:
    found = []
    for line in stderr.splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


@pytest.fixture
def database(postgres_only_url: str) -> str:
    """PostgreSQL: on SQLite the single writer lock would run slow transactions one by one."""
    return postgres_only_url


def worker_env(database: str, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "ROLLOUT_"))}
    env.update(
        PYTHONPATH=str(REPO),
        WORKER_DATABASE_URL=database,
        WORKER_HANDLERS="tests.ops.rollout_handlers",
        WORKER_CONCURRENCY=str(CONCURRENCY),
        WORKER_GRACE_PERIOD=str(GRACE_PERIOD),
        WORKER_OPS_PORT=str(port),
        WORKER_OPS_HOST="127.0.0.1",
        WORKER_LOG_FORMAT="json",
        ROLLOUT_SECONDS=str(HANDLER_SECONDS),
    )
    env.update(extra)
    return env


def roll(database: str, env: dict[str, str], port: int) -> dict[str, Any]:
    """Start the worker, SIGTERM it while CONCURRENCY deliveries are in flight, watch it go."""
    process = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "run"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while (probe(port, "/readyz") or (0, {}))[0] != 200:
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.05)
        while in_flight(port) < CONCURRENCY:
            assert time.monotonic() < deadline, "the deliveries never got in flight"
            time.sleep(0.02)
        committed_before = markers(database)

        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        readiness: list[tuple[float, int, bool]] = []  # (seconds after SIGTERM, status, alive)
        while process.poll() is None and time.monotonic() - sent < GRACE_PERIOD + 5:
            answer = probe(port, "/readyz")
            if answer is not None:
                readiness.append((time.monotonic() - sent, answer[0], process.poll() is None))
            liveness = probe(port, "/healthz")
            if liveness is not None:
                assert liveness[0] == 200, "a worker shutting down is still alive"
            time.sleep(0.05)
        _, stderr = process.communicate(timeout=GRACE_PERIOD + 5)
        return {
            "code": process.returncode,
            "seconds": time.monotonic() - sent,
            "readiness": readiness,
            "committed_before": committed_before,
            "committed": markers(database),
            "events": events(stderr),
            "stderr": stderr,
        }
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def assert_graceful(result: dict[str, Any]) -> dict[str, Any]:
    assert result["code"] == 0, result["stderr"][-3000:]
    assert result["seconds"] < GRACE_PERIOD
    # readiness dropped at once (the signal takes a loop turn to arrive), for good, while
    # the process still ran and the deliveries in flight were far from done
    readiness = result["readiness"]
    statuses = [status for _, status, _ in readiness]
    assert 503 in statuses, readiness
    first = statuses.index(503)
    assert set(statuses[:first]) <= {200} and set(statuses[first:]) == {503}, readiness
    dropped_at, _, alive = readiness[first]
    assert alive
    assert dropped_at < min(0.5, HANDLER_SECONDS / 2), readiness
    # the deliveries in flight at SIGTERM finished and committed; nothing new started
    assert result["committed_before"] == 0
    assert result["committed"] == CONCURRENCY
    names = [event.get("event") for event in result["events"]]
    assert "grace period over, cancelled in-flight work" not in names
    stopped: dict[str, Any]
    [stopped] = [event for event in result["events"] if event.get("event") == "pump stopped"]
    assert stopped.get("ack") == CONCURRENCY  # settled: every commit was acked
    assert stopped.get("committed") == CONCURRENCY
    return stopped


@pytest.mark.slow
def test_sigterm_with_the_memory_broker(database: str) -> None:
    port = free_port()
    env = worker_env(database, port, WORKER_BROKER="memory", ROLLOUT_MEMORY_MESSAGES="12")
    assert_graceful(roll(database, env, port))


# -- the same against RabbitMQ -------------------------------------------------


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def vhost(request: pytest.FixtureRequest) -> Iterator[str]:
    """A throwaway vhost: deleting it removes every queue the worker declared."""
    root = request.config.pluginmanager.get_plugin(str(REPO / "tests" / "conftest.py"))
    assert root is not None
    root.require_service("127.0.0.1", 5672, "RabbitMQ")  # skips locally, fails under CI
    if shutil.which("rabbitmqctl") is None:
        if os.environ.get("CI"):
            pytest.fail("rabbitmqctl is not on PATH")
        pytest.skip("rabbitmqctl is not on PATH")
    name = f"worker_ops_{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


@pytest.mark.slow
@pytest.mark.rabbitmq
def test_sigterm_with_rabbitmq(database: str, vhost: str) -> None:
    port = free_port()
    queue = "rollout"
    env = worker_env(
        database,
        port,
        WORKER_BROKER="rabbitmq",
        WORKER_RABBITMQ_URL=f"amqp://guest:guest@127.0.0.1:5672/{vhost}",
        WORKER_RABBITMQ_QUEUE=queue,
        WORKER_RABBITMQ_EXCHANGE=f"{queue}.in",
    )
    total = 12
    lines = "".join(
        json.dumps({"id": f"slow-{n:03d}", "type": "Slow", "body": {"seconds": HANDLER_SECONDS}})
        + "\n"
        for n in range(total)
    )
    published = subprocess.run(
        [sys.executable, "-m", "worker.cli", "publish", "-"],
        input=lines,
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert published.returncode == 0, published.stderr

    stopped = assert_graceful(roll(database, env, port))
    assert stopped.get("nack", 0) == 0

    # nothing was lost: what was not processed is still queued, ready for the next pod
    # (a quorum queue's counters trail its acks by a moment: poll, bounded)
    deadline = time.monotonic() + 15
    while (depth := queue_depth(vhost, queue)) != total - CONCURRENCY:
        assert time.monotonic() < deadline, f"{depth} messages queued, not {total - CONCURRENCY}"
        time.sleep(0.25)


def queue_depth(vhost: str, queue: str) -> int:
    listing = subprocess.run(
        [
            "rabbitmqctl",
            "-q",
            "list_queues",
            "-p",
            vhost,
            "name",
            "messages",
            "--formatter",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    depths = {row["name"]: row["messages"] for row in json.loads(listing.stdout)}
    return int(depths[queue])
