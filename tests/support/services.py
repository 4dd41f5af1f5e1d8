"""Services and tools the tests need: a missing one skips a test locally and fails it under CI.

So a CI run (``CI`` set) can never pass by skipping what it was meant to prove.
"""

from __future__ import annotations

import os
import shutil
import socket
from typing import NoReturn

import pytest


def unavailable(message: str) -> NoReturn:
    """Skip the test, or fail it under CI."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def require_service(host: str, port: int, what: str) -> None:
    """Skip (or, under CI, fail) when nothing listens on host:port."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return
    except OSError as exc:
        unavailable(f"{what} is not reachable at {host}:{port} ({exc})")


def require_command(name: str, why: str) -> str:
    """The path of a command on PATH; skip (or, under CI, fail) without it."""
    found = shutil.which(name)
    if found is None:
        unavailable(f"{name} is not on PATH: {why}")
    return found
