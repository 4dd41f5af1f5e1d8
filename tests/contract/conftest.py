"""Fixtures of the broker contract suite: one migrated SQLite file per test."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.db import create_engine


@pytest.fixture
async def contract_db(
    sqlite_template: Path, tmp_path: Path
) -> AsyncIterator[tuple[str, AsyncEngine]]:
    """The broker is what is under test here, so one database (SQLite) is enough."""
    path = tmp_path / "contract.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite+aiosqlite:///{path}"
    engine = create_engine(url, pool_size=8)
    yield url, engine
    await engine.dispose()
