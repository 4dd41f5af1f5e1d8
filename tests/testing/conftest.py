"""Fixtures of the test kit's tests.

The kit's own fixtures are imported here as well, so these tests run whether or not the
installed package's ``pytest11`` entry point is registered yet (an install from before it
existed); with it registered, these names are simply the same fixtures.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import pytest

from handlers import notify
from tests.support.services import require_service
from tests.testing import wrong_handlers
from tests.testing.apis import RecordingAPI, serving
from worker.testing import Scratch, open_scratch
from worker.testing.plugin import worker_database, worker_harness

__all__ = ["worker_database", "worker_harness"]

POSTGRES_SERVER = os.environ.get(
    "WORKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture(scope="session")
def kit_postgres() -> Iterator[Scratch]:
    """Throwaway databases of the kit's own on the test PostgreSQL server."""
    require_service("127.0.0.1", 5432, "PostgreSQL")
    scratch = open_scratch(POSTGRES_SERVER)
    try:
        yield scratch
    finally:
        asyncio.run(scratch.close())


@pytest.fixture(scope="session")
def kit_sqlite() -> Iterator[Scratch]:
    scratch = open_scratch()
    try:
        yield scratch
    finally:
        asyncio.run(scratch.close())


@pytest.fixture(params=["sqlite", "postgresql"])
def kit_database(request: pytest.FixtureRequest) -> Scratch:
    """Each test on both databases."""
    name = "kit_sqlite" if request.param == "sqlite" else "kit_postgres"
    scratch: Scratch = request.getfixturevalue(name)
    return scratch


@pytest.fixture
async def payments() -> AsyncIterator[RecordingAPI]:
    """A payment API that charges on every call (no idempotency keys)."""
    async with serving(RecordingAPI(dedup=False), "/charge") as api:
        wrong_handlers.PAYMENTS["url"] = api.url
        try:
            yield api
        finally:
            wrong_handlers.PAYMENTS["url"] = ""


@pytest.fixture
async def mail_api() -> AsyncIterator[RecordingAPI]:
    """A mail API that sends one mail per idempotency key; the notify handler posts to it."""
    async with serving(RecordingAPI(dedup=True), "/send") as api:
        notify.configure(notify.MailSettings(api_url=api.url))
        try:
            yield api
        finally:
            notify.configure(None)


@pytest.fixture
async def audit_engines() -> AsyncIterator[None]:
    """The escaping handler's own engines, disposed after the test."""
    yield
    await wrong_handlers.dispose_audit_engines()
