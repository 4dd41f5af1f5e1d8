"""A readers-writer lock across processes for tests that touch the shared services globally.

Every test holds the lock *shared* while it runs (setup, call, teardown); a ``serial``
test holds it *exclusively*: it waits for the tests running in other processes (pytest-xdist
workers, or another pytest run on this machine) to end, and no test starts until it ended.
Restarting RabbitMQ or PostgreSQL, or asserting tight timings, is then safe under ``-n``.

A turnstile (a second lock, held by a writer while it waits) keeps a stream of readers
from starving a waiting writer. ``flock`` locks belong to the open file: a process that
dies holding one releases it, so a killed run never leaves the lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# machine-wide on purpose: the services are too (one PostgreSQL, one RabbitMQ)
LOCK = Path(tempfile.gettempdir()) / "idempotent-worker-tests.shared-services.lock"
TURNSTILE = LOCK.with_suffix(".turnstile")
WAIT_LIMIT = 30 * 60.0  # longer than any test may hold the lock (the chaos test: 480 s)


def _open(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)  # another user's run on this machine can take it too
    return fd


def _take(fd: int, mode: int, what: str) -> None:
    """flock(fd, mode), bounded: a hang elsewhere fails loudly instead of stalling the run."""
    deadline = time.monotonic() + WAIT_LIMIT
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"waited {WAIT_LIMIT:.0f}s for the {what} on {LOCK}: another test run "
                    "holds it (a hung test?)"
                ) from None
            time.sleep(0.05)


@contextlib.contextmanager
def holding(exclusive: bool) -> Iterator[None]:
    """Hold the lock, exclusively (a ``serial`` test) or shared (any other test)."""
    turnstile, lock = _open(TURNSTILE), _open(LOCK)
    try:
        _take(turnstile, fcntl.LOCK_EX, "turnstile")
        try:
            _take(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, "services lock")
        finally:
            if not exclusive:  # a reader passes through; a writer blocks new readers
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        os.close(lock)  # closing releases the flock
        os.close(turnstile)
