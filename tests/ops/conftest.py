"""Fixtures for the operations tests: a migrated SQLite file, a pump running in the background."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.pumps import RunPump, engine_for, running_pump
from worker.brokers.memory import MemoryBroker
from worker.middleware import StageMiddleware, Timing, WorkMiddleware
from worker.pump import Pump
from worker.registry import Registry
from worker.settings import Settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "worker.db"
    shutil.copy(sqlite_template, path)
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture
def run_pump(sqlite_url: str) -> RunPump:
    """``async with run_pump(registry, **settings) as (pump, broker)``: started, then stopped;
    with handler timing, as ``worker run`` assembles it, unless ``stage_middleware`` says."""

    @asynccontextmanager
    async def run(
        registry: Registry,
        *,
        middleware: Sequence[WorkMiddleware] = (),
        stage_middleware: Sequence[StageMiddleware] = (Timing(),),
        **overrides: Any,
    ) -> AsyncIterator[tuple[Pump, MemoryBroker]]:
        values: dict[str, Any] = {
            "database_url": sqlite_url,
            "concurrency": 4,
            "retry_backoff": 0.001,
            "retry_backoff_max": 0.01,
            "grace_period": 5.0,
        }
        values.update(overrides)
        settings = Settings(**values)
        broker = MemoryBroker()
        async with (
            engine_for(sqlite_url, pool_size=8) as engine,
            running_pump(
                broker.connect(),
                engine,
                registry,
                settings,
                name="test",
                middleware=middleware,
                stage_middleware=stage_middleware,
            ) as pump,
        ):
            yield pump, broker

    return run
