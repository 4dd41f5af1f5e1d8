"""The pytest plugin of the test kit: registered under the ``pytest11`` entry point, so an
installed ``idempotent-worker`` brings it to every pytest run.

Fixtures:

- ``worker_database`` (session): where harnesses and checks make their databases; SQLite
  files, or throwaway databases on the PostgreSQL server of ``--worker-database`` (or the
  ``worker_database`` ini option), dropped at the end of the session;
- ``worker_harness``: ``async with worker_harness() as worker:`` the registered handlers
  on two running pumps (:func:`worker.testing.harness`) on a fresh database.

With plugin autoloading off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), load it with
``-p worker.testing.plugin`` or ``pytest_plugins = ["worker.testing.plugin"]`` in the
root conftest.py. The fixtures are synchronous: they work under pytest-asyncio and
anyio alike, and the ``async with`` runs in the test's own event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from sqlalchemy import MetaData

    from worker.registry import Registry
    from worker.testing.harness import Given, Harness, HarnessFactory
    from worker.testing.scratch import Scratch

OPTION = "--worker-database"
INI = "worker_database"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("idempotent-worker", "the idempotent-worker test kit")
    group.addoption(
        OPTION,
        default=None,
        metavar="URL",
        help="postgresql+asyncpg:// URL of a server the kit creates throwaway databases on "
        "(default: SQLite files)",
    )
    parser.addini(INI, "the default of " + OPTION, default=None)


def database_option(config: pytest.Config) -> str | None:
    """``--worker-database``, else the ini option, else None (SQLite)."""
    given = config.getoption(OPTION.lstrip("-").replace("-", "_"), default=None)
    if not given:
        try:
            given = config.getini(INI)
        except ValueError:  # the plugin's ini option is not registered (imported fixtures)
            given = None
    return str(given) if given else None


@pytest.fixture(scope="session")
def worker_database(request: pytest.FixtureRequest) -> Iterator[Scratch]:
    """The session's scratch databases (:class:`worker.testing.Scratch`)."""
    from worker.testing.scratch import open_scratch

    scratch = open_scratch(database_option(request.config))
    try:
        yield scratch
    finally:
        asyncio.run(scratch.close())


@pytest.fixture
def worker_harness(worker_database: Scratch) -> HarnessFactory:
    """``async with worker_harness() as worker:`` see :func:`worker.testing.harness`."""
    from worker.testing.harness import harness

    def make(
        handlers: Registry | None = None,
        *,
        given: Given = (),
        models: Sequence[MetaData] = (),
        **settings: Any,
    ) -> AbstractAsyncContextManager[Harness]:
        return harness(handlers, database=worker_database, given=given, models=models, **settings)

    return make
