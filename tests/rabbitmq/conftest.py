"""RabbitMQ fixtures: one throwaway vhost per test session, unique names per test.

Deleting the vhost at the end deletes every queue and exchange the tests
declared, whatever state a failed test left them in.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.rabbitmq.rabbit_helpers import HOST, PORT, REPO, rabbitmqctl
from worker.brokers.rabbitmq import RabbitMQSettings


@pytest.fixture(scope="session")
def rabbitmq_vhost(pytestconfig: pytest.Config) -> Iterator[str]:
    """A fresh vhost for this test session, deleted (with everything in it) afterwards."""
    # the shared helper from tests/conftest.py: skip locally, fail under CI
    root = pytestconfig.pluginmanager.get_plugin(str(REPO / "tests" / "conftest.py"))
    assert root is not None, "tests/conftest.py is not loaded"
    root.require_service(HOST, PORT, "RabbitMQ")
    if shutil.which("rabbitmqctl") is None:
        message = "rabbitmqctl is not on PATH: the tests cannot control the local RabbitMQ"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    name = f"worker_test_{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


@pytest.fixture(scope="session")
def amqp_url(rabbitmq_vhost: str) -> str:
    return f"amqp://guest:guest@{HOST}:{PORT}/{rabbitmq_vhost}"


@pytest.fixture
def rabbit_settings(amqp_url: str) -> Callable[..., RabbitMQSettings]:
    """Settings whose queue and exchange names are unique to the test."""
    queue = f"q{uuid.uuid4().hex[:8]}"

    def make(**overrides: Any) -> RabbitMQSettings:
        values: dict[str, Any] = {
            "url": amqp_url,
            "queue": queue,
            "exchange": f"{queue}.in",
            "retry_delays": [0.2, 0.5],
            "reconnect_interval": 0.3,
            "settle_timeout": 5.0,
        }
        values.update(overrides)
        return RabbitMQSettings(**values)

    return make


@pytest.fixture
def pg(postgres_only_url: str) -> str:
    """The session's migrated PostgreSQL database, with empty tables for this test."""
    return postgres_only_url
