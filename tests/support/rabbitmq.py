"""The local RabbitMQ the tests use: its address, its control, and a throwaway vhost.

Deleting the vhost at the end deletes every queue and exchange the tests
declared in it, whatever state a failed test left them in. Each test's own queues go
at its end (:func:`delete_topologies`): a server keeps files open for every queue, and a
session's worth of quorum queues ran a local server (1024 descriptors) out of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import uuid
from collections.abc import Callable, Iterator

import aio_pika

from tests.support.services import require_command, require_service
from worker.brokers.rabbitmq import RabbitMQSettings, delete_topology

HOST, PORT = "127.0.0.1", 5672

MakeRabbitSettings = Callable[..., RabbitMQSettings]
"""The ``rabbit_settings`` fixture (tests/conftest.py): ``rabbit_settings(**overrides)``, a
queue and exchange of the test's own in the session's vhost."""


def rabbitmqctl(*args: str, timeout: float = 60) -> str:
    """Run ``rabbitmqctl`` (bounded); the tests control the local server through it."""
    result = subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def guest_url(vhost: str) -> str:
    return f"amqp://guest:guest@{HOST}:{PORT}/{vhost}"


async def arabbitmqctl(*args: str) -> str:
    """:func:`rabbitmqctl` without blocking the event loop (a pump keeps running meanwhile)."""
    return await asyncio.to_thread(rabbitmqctl, *args)


@contextlib.contextmanager
def throwaway_vhost(prefix: str = "worker_test") -> Iterator[str]:
    """A fresh vhost the guest user may use, deleted (with everything in it) afterwards."""
    require_service(HOST, PORT, "RabbitMQ")
    require_command("rabbitmqctl", "the tests cannot control the local RabbitMQ")
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


NAMING = {"queue", "exchange", "retry_delays"}
"""The settings that name what :func:`delete_topology` deletes."""


def delete_topologies(url: str, made: list[RabbitMQSettings]) -> None:
    """Delete, in the vhost of ``url``, the queues and exchanges of every settings a test
    made, messages included.

    Each is named by the settings (work queue, delay queues, dead-letter queue and
    exchanges); deleting what was never declared is a no-op on the server. ``url`` is
    the server's own address: a test's settings may point at a fault proxy long gone.
    """
    if made:
        asyncio.run(_delete(url, made))


async def _delete(url: str, made: list[RabbitMQSettings]) -> None:
    names = {settings.model_dump_json(include=NAMING): settings for settings in made}
    async with await aio_pika.connect(url, timeout=30) as connection:
        channel = await connection.channel()
        for settings in names.values():
            await delete_topology(channel, settings)
