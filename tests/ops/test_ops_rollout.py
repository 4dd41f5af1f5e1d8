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
import signal
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from sqlalchemy import text

from tests.rabbitmq.rabbit_helpers import declare
from tests.support.processes import REPO, clean_env, free_port, json_lines, run_cli, worker_cli
from tests.support.rabbitmq import guest_url, rabbitmqctl
from worker.brokers.rabbitmq import RabbitMQSettings
from worker.db import create_engine

CONCURRENCY = 4
HANDLER_SECONDS = 2.0
GRACE_PERIOD = 10.0


def declared(env: dict[str, str]) -> None:
    """The queues a worker with ``env`` declares at its start."""
    queue = env["WORKER_RABBITMQ_QUEUE"]
    rabbit = RabbitMQSettings(
        url=env["WORKER_RABBITMQ_URL"], queue=queue, exchange=env["WORKER_RABBITMQ_EXCHANGE"]
    )
    asyncio.run(declare(rabbit))


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


@pytest.fixture
def database(postgres_only_url: str) -> str:
    """PostgreSQL: on SQLite the single writer lock would run slow transactions one by one."""
    return postgres_only_url


def worker_env(database: str, port: int, **extra: str) -> dict[str, str]:
    env = clean_env("ROLLOUT_")
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
        worker_cli("run"),
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
            "events": json_lines(stderr),
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


@pytest.mark.slow
@pytest.mark.rabbitmq
def test_sigterm_with_rabbitmq(database: str, rabbitmq_vhost: str) -> None:
    """In the session's throwaway vhost (tests/conftest.py), deleted with its queues at the end."""
    port = free_port()
    queue = "rollout"
    env = worker_env(
        database,
        port,
        WORKER_BROKER="rabbitmq",
        WORKER_RABBITMQ_URL=guest_url(rabbitmq_vhost),
        WORKER_RABBITMQ_QUEUE=queue,
        WORKER_RABBITMQ_EXCHANGE=f"{queue}.in",
    )
    total = 12
    lines = "".join(
        json.dumps({"id": f"slow-{n:03d}", "type": "Slow", "body": {"seconds": HANDLER_SECONDS}})
        + "\n"
        for n in range(total)
    )
    declared(env)  # as the worker's start would (`worker publish` declares nothing)
    published = run_cli(env, "publish", "-", stdin=lines)
    assert published.returncode == 0, published.stderr

    stopped = assert_graceful(roll(database, env, port))
    # only what never started went back (the prefetch beyond the workers), uncounted
    assert stopped.get("nack", 0) <= total - CONCURRENCY

    # nothing was lost: what was not processed is still queued, ready for the next pod
    # (a quorum queue's counters trail its acks by a moment: poll, bounded)
    deadline = time.monotonic() + 15
    while (depth := queue_depth(rabbitmq_vhost, queue)) != total - CONCURRENCY:
        assert time.monotonic() < deadline, f"{depth} messages queued, not {total - CONCURRENCY}"
        time.sleep(0.25)


def queue_depth(vhost: str, queue: str) -> int:
    listing = rabbitmqctl(
        "-q", "list_queues", "-p", vhost, "name", "messages", "--formatter", "json"
    )
    depths = {row["name"]: row["messages"] for row in json.loads(listing)}
    return int(depths[queue])


# -- the worst case: work that outlives the grace period ------------------------

WORST_GRACE = 3.0
SHUTDOWN_AFTER_GRACE = 30.0  # deploy/README.md "Stopping"; the pod's budget beyond the grace


def stop_mid_work(env: dict[str, str], port: int) -> tuple[int, float, list[dict[str, Any]]]:
    """SIGTERM while every slot runs a handler far longer than the grace period."""
    process = subprocess.Popen(
        worker_cli("run"),
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while (probe(port, "/readyz") or (0, {}))[0] != 200 or in_flight(port) < CONCURRENCY:
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the deliveries never got in flight"
            time.sleep(0.05)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=WORST_GRACE + SHUTDOWN_AFTER_GRACE + 10)
        return process.returncode, time.monotonic() - sent, json_lines(stderr)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.slow
@pytest.mark.rabbitmq
def test_the_worst_case_shutdown_fits_the_pod_s_termination_grace(
    database: str, rabbitmq_vhost: str
) -> None:
    """Handlers that never finish, messages prefetched and unsettled: the grace period runs
    out, the work is cancelled unsettled, the broker gets everything back, and the whole
    stop stays inside the budget terminationGracePeriodSeconds is sized for.
    """
    port, queue, total = free_port(), "worst", 12
    env = worker_env(
        database,
        port,
        WORKER_BROKER="rabbitmq",
        WORKER_RABBITMQ_URL=guest_url(rabbitmq_vhost),
        WORKER_RABBITMQ_QUEUE=queue,
        WORKER_RABBITMQ_EXCHANGE=f"{queue}.in",
        WORKER_GRACE_PERIOD=str(WORST_GRACE),
    )
    lines = "".join(
        json.dumps({"id": f"worst-{n:03d}", "type": "Slow", "body": {"seconds": 600}}) + "\n"
        for n in range(total)
    )
    declared(env)
    assert run_cli(env, "publish", "-", stdin=lines).returncode == 0

    code, seconds, events = stop_mid_work(env, port)
    assert code == 0
    names = [event.get("event") for event in events]
    assert "grace period over, cancelled in-flight work" in names
    assert WORST_GRACE <= seconds < WORST_GRACE + SHUTDOWN_AFTER_GRACE, seconds
    print(f"worst-case stop: {seconds:.2f}s, {seconds - WORST_GRACE:.2f}s after the grace period")
    assert markers(database) == 0  # nothing committed...
    deadline = time.monotonic() + 15
    while (depth := queue_depth(rabbitmq_vhost, queue)) != total:  # ...and nothing lost
        assert time.monotonic() < deadline, f"{depth} of {total} messages back in the queue"
        time.sleep(0.25)
