"""Databases migrated as a deployment of the example application migrates them."""

from __future__ import annotations

from datetime import timedelta

from worker.histories import application_histories
from worker.migrate import upgrade


def migrate_with_the_example(
    url: str, *, inbox_layout: str = "table", partition_period: timedelta = timedelta(days=1)
) -> None:
    """The worker's tables, then the example application's (``accounts``, ``products``):
    what ``worker migrate`` does with the default WORKER_HANDLERS=handlers. Many tests run
    the shipped handlers. The history is found without importing ``handlers``, so no test
    process registers the shipped handlers by accident. Blocking."""
    upgrade(
        url,
        applications=application_histories(["handlers"]),
        inbox_layout=inbox_layout,
        partition_period=partition_period,
    )
