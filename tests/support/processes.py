"""Real ``python -m worker.cli`` processes: their environment, one-shot commands, running workers.

Every process is started with this interpreter (``sys.executable``) in the
repository, and a running worker is only ever killed by its own PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def clean_env(*prefixes: str) -> dict[str, str]:
    """This process's environment without any WORKER_* (or other ``prefixes``) variables."""
    dropped = ("WORKER_", *prefixes)
    return {k: v for k, v in os.environ.items() if not k.startswith(dropped)}


def json_env(variables: Mapping[str, str] | None = None) -> dict[str, str]:
    """:func:`clean_env` with JSON logs, then ``variables``: a one-shot command's environment."""
    return {**clean_env(), "WORKER_LOG_FORMAT": "json", **(variables or {})}


def worker_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "worker.cli", *args]


# What pip writes for a console script (pip's own template): Python then puts the script's
# bin directory first on sys.path, where ``python -m`` puts the working directory.
_CONSOLE_SCRIPT = """\
# -*- coding: utf-8 -*-
import re
import sys
from {module} import {function}
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit({function}())
"""


def console_script(directory: Path) -> list[str]:
    """The ``worker`` command as ``pip install`` makes it (pyproject's entry point), written
    into ``directory``: the launcher for :func:`run_cli` that imports the way it does."""
    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["worker"]
    module, function = entry.split(":")
    script = directory / "worker"
    script.write_text(_CONSOLE_SCRIPT.format(module=module, function=function))
    return [sys.executable, str(script)]


def run_cli(
    env: Mapping[str, str],
    *args: str,
    stdin: str | None = None,
    timeout: float = 60,
    cwd: Path | None = REPO,
    launcher: Sequence[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``worker <args>`` in ``env`` (the whole environment: see :func:`clean_env` and
    :func:`json_env`) to completion, bounded, output captured; in the repository unless
    ``cwd`` says where (None: this process's directory); started as ``python -m worker.cli``
    unless ``launcher`` says how (:func:`console_script`). The suite's only CLI runner."""
    return subprocess.run(
        [*launcher, *args] if launcher else worker_cli(*args),
        env=dict(env),
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


async def arun_cli(
    env: dict[str, str], *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """:func:`run_cli` without blocking the event loop (a pump or producer keeps running)."""
    return await asyncio.to_thread(run_cli, env, *args, stdin=stdin)


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON log lines of a worker's output (libraries' plain-text lines are skipped)."""
    lines = []
    for raw in text.splitlines():
        if raw.startswith("{"):
            try:
                lines.append(json.loads(raw))
            except ValueError:
                continue
    return lines


class WorkerProcess:
    """One ``worker run`` OS process, its log in a file of its own."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.process = subprocess.Popen(
            worker_cli("run"), env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log_lines(self) -> list[dict[str, Any]]:
        return json_lines(self.log_path.read_text(errors="replace"))

    def events(self, event: str) -> list[dict[str, Any]]:
        return [line for line in self.log_lines() if line.get("event") == event]

    def logged(self, event: str) -> bool:
        return bool(self.events(event))

    def signal(self, sig: signal.Signals) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """Its exit code; a process still running after ``timeout`` fails the test with the
        tail of its log, which says where its shutdown stands."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._log.flush()
            tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
            raise AssertionError(
                f"worker pid {self.process.pid} still running {timeout}s later; "
                "its last log lines:\n" + "\n".join(tail)
            ) from None
        finally:
            self._log.close()

    def kill(self) -> None:
        """Cleanup: SIGKILL this process (only this one, by its PID) if still running."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._log.close()


def events(workers: Iterable[WorkerProcess], event: str) -> list[dict[str, Any]]:
    """One event's log lines across several workers."""
    return [line for worker in workers for line in worker.events(event)]


class Fleet:
    """The worker processes of one scenario: live ones by slot, and every one ever started."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.live: dict[str, WorkerProcess] = {}
        self.workers: list[WorkerProcess] = []
        self.events: list[str] = []
        self.exit_codes: dict[str, int] = {}
        self.seconds = 0.0

    def start(self, slot: str) -> None:
        process = WorkerProcess(self.env, self.logs / f"worker-{slot}-{len(self.workers)}.log")
        self.live[slot] = process
        self.workers.append(process)

    def all_started(self) -> bool:
        for worker in self.live.values():
            if worker.process.poll() is not None:  # died at start: show why
                pytest.fail(worker.log_path.read_text()[-3000:])
        return all(w.logged("pump started") for w in self.live.values())

    async def act(self, action: str, slot: str, progress: float) -> None:
        self.events.append(f"{action} {slot} at {progress:.0%}")
        worker = self.live.pop(slot)
        if action == "kill":
            worker.signal(signal.SIGKILL)
            await asyncio.to_thread(worker.wait, 10)
            self.start(slot)  # a restarted pod
        else:
            worker.signal(signal.SIGTERM)
            self.exit_codes[f"{slot} (SIGTERM)"] = await asyncio.to_thread(worker.wait, 30)

    def restart_exited(self) -> None:
        """Start again every worker that exited on its own (the orchestrator restarts the pod)."""
        for slot, worker in list(self.live.items()):
            if worker.process.poll() is not None:
                self.live.pop(slot)
                self.start(slot)

    async def stop(self) -> None:
        for worker in self.live.values():
            worker.signal(signal.SIGTERM)
        for slot, worker in self.live.items():
            self.exit_codes[slot] = await asyncio.to_thread(worker.wait, 30)

    def kill_all(self) -> None:
        for worker in self.workers:
            worker.kill()


class KillSchedule:
    """When a chaos test SIGKILLs one of its workers: at three random shares of the work,
    and by the clock every 1-3 s.

    By the clock only after ``step`` more units of progress since the last kill: on a
    loaded machine, kills every 1-3 s could otherwise outpace the restarted workers'
    start-up, and the run would never drain. Only a worker that is up is killed: killing
    a pod that never got going proves nothing.
    """

    def __init__(
        self,
        rng: random.Random,
        total: int,
        step: int = 1,
        within: tuple[float, float] = (0.05, 0.9),
    ) -> None:
        self.rng, self.total, self.step = rng, total, step
        self.next_kill = time.monotonic() + rng.uniform(1, 3)
        # kills by the clock alone depend on the throughput: a run that drains its work in
        # seconds once got 2 kills; these points (shares of the work, ``within``) do not
        self.points = sorted(rng.uniform(*within) for _ in range(3))
        self.killed_at = -step  # progress at the last kill

    async def tick(self, fleet: Fleet, done: int) -> None:
        """Restart the workers that exited, then kill one if it is time (``done`` of ``total``)."""
        fleet.restart_exited()
        passed = [point for point in self.points if done >= point * self.total]
        clock = time.monotonic() >= self.next_kill and done >= self.killed_at + self.step
        if not (clock or passed) or done >= self.total:
            return
        up = [slot for slot, worker in fleet.live.items() if worker.logged("pump started")]
        if not up:
            return
        if passed:
            self.points.remove(passed[0])  # one kill for each point
        await fleet.act("kill", self.rng.choice(up), done / self.total)
        self.killed_at = done
        self.next_kill = time.monotonic() + self.rng.uniform(1, 3)
