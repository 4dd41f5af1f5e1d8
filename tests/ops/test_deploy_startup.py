"""``worker run`` as a pod starts it: real processes, a database that never answers, PID 1.

- A SIGTERM while the worker is still starting (here: connecting to a database that
  accepts the connection and never says a word) ends it at once, also as PID 1 of a
  container without an init, where a signal without a handler is never delivered.
- An SQLite URL together with a networked broker is refused with one line (exit 2):
  in Kubernetes every pod would otherwise keep its own inbox in its own /tmp.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ops.deploy_helpers import as_pid_1, cli_env, namespace_init
from tests.support.processes import REPO, free_port, json_lines, run_cli, worker_cli


class SilentDatabase(str):
    """A PostgreSQL URL whose server accepts connections and never answers."""

    accepted: list[socket.socket]


@pytest.fixture
def silent_database() -> Iterator[SilentDatabase]:
    """A PostgreSQL URL whose server accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(connection)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = SilentDatabase(f"postgresql+asyncpg://worker:secret@127.0.0.1:{port}/worker")
    url.accepted = accepted
    try:
        yield url
    finally:
        done.set()
        thread.join(5)
        for connection in accepted:
            connection.close()
        listener.close()


@pytest.mark.parametrize("pid_1", [False, True], ids=["child", "pid-1"])
def test_sigterm_during_start_up_ends_the_worker_at_once(
    silent_database: SilentDatabase, pid_1: bool, tmp_path: Path
) -> None:
    env = cli_env(
        silent_database,
        WORKER_OPS_PORT=str(free_port()),
        WORKER_OPS_HOST="127.0.0.1",
        WORKER_HANDLERS="handlers",
    )
    command = worker_cli("run")
    log = (tmp_path / "run.log").open("w+")
    launcher = subprocess.Popen(
        as_pid_1(command) if pid_1 else command,
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pid = namespace_init(launcher) if pid_1 else launcher.pid
        # imported, configured, handlers loaded, now waiting on the database's first reply
        deadline = time.monotonic() + 60  # a loaded machine imports slowly
        while not silent_database.accepted:
            assert launcher.poll() is None, (tmp_path / "run.log").read_text()
            assert time.monotonic() < deadline, "the worker never connected to the database"
            time.sleep(0.05)
        time.sleep(0.5)
        assert launcher.poll() is None, (tmp_path / "run.log").read_text()
        sent = time.monotonic()
        os.kill(pid, signal.SIGTERM)  # the worker process itself, by its PID
        code = launcher.wait(15)
        took = time.monotonic() - sent
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        log.close()
    output = (tmp_path / "run.log").read_text()
    print(f"SIGTERM during start-up: exit after {took:.2f}s")
    assert took < 5, f"SIGTERM took {took:.1f}s to end the start-up"  # the pod's 60 s, unused
    assert code == 0, output
    assert "stopped during start-up" in {line.get("event") for line in json_lines(output)}
    assert "secret" not in output


@pytest.mark.parametrize("broker", ["rabbitmq", "kafka", "servicebus"])
def test_sqlite_with_a_networked_broker_is_refused_with_one_line(
    broker: str, tmp_path: Path
) -> None:
    env = cli_env("", WORKER_BROKER=broker)
    del env["WORKER_DATABASE_URL"]  # the classic slip: the Secret lacks the key
    result = run_cli(env, "run", timeout=60)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("worker: configuration error: ")
    for name in ("WORKER_DATABASE_URL", "WORKER_BROKER", "WORKER_ALLOW_SQLITE_WITH_NETWORK_BROKER"):
        assert name in line
    assert "not set" in line

    explicit = cli_env(f"sqlite+aiosqlite:///{tmp_path / 'w.db'}", WORKER_BROKER=broker)
    again = run_cli(explicit, "run", timeout=60)
    assert again.returncode == 2
    assert "WORKER_ALLOW_SQLITE_WITH_NETWORK_BROKER" in again.stderr


def test_sqlite_with_a_networked_broker_runs_when_explicitly_allowed(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'w.db'}"
    env = cli_env(
        url,
        WORKER_BROKER="rabbitmq",
        WORKER_RABBITMQ_URL=f"amqp://guest:guest@127.0.0.1:{free_port()}/",  # nothing there
        WORKER_ALLOW_SQLITE_WITH_NETWORK_BROKER="true",
        WORKER_START_TIMEOUT="0",  # no retry: the refusal is what this test is about
    )
    assert run_cli(env, "migrate").returncode == 0
    result = run_cli(env, "run", timeout=90)
    assert result.returncode == 1  # past the refusal: the broker is what is missing now
    assert "broker unavailable" in result.stderr


def test_sqlite_with_the_memory_broker_needs_no_permission(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'w.db'}"
    env = cli_env(url, WORKER_BROKER="memory", WORKER_HANDLERS="no_such_module")
    result = run_cli(env, "run")
    assert result.returncode == 2
    assert "WORKER_HANDLERS" in result.stderr  # the next check, not the SQLite refusal
