"""RabbitMQ fixtures: the vhost, ``amqp_url`` and ``rabbit_settings`` come from tests/conftest.py.

One throwaway vhost per test session, unique queue names per test.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def pg(postgres_only_url: str) -> str:
    """The session's migrated PostgreSQL database, with empty tables for this test."""
    return postgres_only_url
