"""The inbox layout the suite's PostgreSQL database is migrated to: ``WORKER_TEST_INBOX``.

``WORKER_TEST_INBOX=partitioned`` runs the suite with the partitioned inbox
(worker/partitions.py) on PostgreSQL; SQLite keeps the plain table either way. A test
that is about the plain table itself (its DELETE purge, its columns) says so with
:func:`plain_table_only`.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

INBOX_LAYOUT = os.environ.get("WORKER_TEST_INBOX", "table")
if INBOX_LAYOUT not in ("table", "partitioned"):
    raise RuntimeError(f"WORKER_TEST_INBOX={INBOX_LAYOUT!r}: table or partitioned")
PARTITIONED = INBOX_LAYOUT == "partitioned"
PERIOD = timedelta(days=1)
"""The suite database's partition period (its tests make their own settings)."""


def layout_of(database_url: str) -> str:
    """The layout a test database at ``database_url`` has."""
    return INBOX_LAYOUT if database_url.startswith("postgresql") else "table"


def plain_table_only(database_url: str) -> None:
    """Skip a test about the plain table's own mechanics when the suite runs partitioned."""
    if layout_of(database_url) == "partitioned":
        pytest.skip("about the plain inbox table (WORKER_TEST_INBOX=partitioned)")
