"""Helpers for the RabbitMQ tests: messages, queue depths, in-process pumps, worker environments.

The server's control, waiting, queries and worker processes are shared: tests/support/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from handlers.credit import CreditRequested, apply_credit
from tests.support.processes import REPO, clean_env
from tests.support.pumps import engine_for, running_pump
from tests.support.rabbitmq import rabbitmqctl
from worker.brokers import OutgoingMessage
from worker.brokers.rabbitmq import (
    REASON_HEADER,
    RabbitMQAdmin,
    RabbitMQConsumer,
    RabbitMQSettings,
    declare_topology,
    make_identity,
)
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings

# -- messages --------------------------------------------------------------------


async def declare(settings: RabbitMQSettings) -> None:
    """Declare the worker's topology, as a worker's start does (the operator tools don't)."""
    connection = await aio_pika.connect(settings.url)
    try:
        await declare_topology(await connection.channel(), settings)
    finally:
        await connection.close()


async def publish(settings: RabbitMQSettings, messages: list[OutgoingMessage]) -> None:
    """``worker publish``'s admin, into the topology a worker would have declared."""
    await declare(settings)
    admin = RabbitMQAdmin(settings, make_identity(settings))
    try:
        await admin.publish(messages)
    finally:
        await admin.close()


async def publish_raw(
    settings: RabbitMQSettings, *messages: aio_pika.Message, routing_keys: list[str] | None = None
) -> None:
    """Publish exactly these AMQP messages (no id or type filled in) to the work queue,
    or the n-th message to the n-th of ``routing_keys`` (queue names)."""
    connection = await aio_pika.connect(settings.url)
    try:
        channel = await connection.channel()
        for n, message in enumerate(messages):
            key = settings.queue if routing_keys is None else routing_keys[n]
            await channel.default_exchange.publish(message, routing_key=key)
    finally:
        await connection.close()


# -- queue state ------------------------------------------------------------------


async def depths(settings: RabbitMQSettings, *names: str) -> dict[str, int]:
    """Ready messages per queue (messages a consumer holds unacked are not counted)."""
    connection = await aio_pika.connect(settings.url)
    try:
        channel = await connection.channel()
        result = {}
        for name in names:
            queue = await channel.declare_queue(name, passive=True)
            result[name] = queue.declaration_result.message_count or 0
        return result
    finally:
        await connection.close()


async def all_depths(settings: RabbitMQSettings) -> dict[str, int]:
    """Work, dead-letter and retry queues (close every consumer first for a full count)."""
    names = [settings.queue, settings.dead_letter_queue]
    names += [settings.retry_queue(d) for d in settings.retry_delays]
    return await depths(settings, *names)


def unsettled(vhost: str, settings: RabbitMQSettings) -> int:
    """Ready + unacked over the worker's queues, as the server counts them."""
    out = rabbitmqctl("list_queues", "-q", "-p", vhost, "name", "messages", "--no-table-headers")
    ours = {settings.queue, *(settings.retry_queue(d) for d in settings.retry_delays)}
    total = 0
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ours:
            total += int(parts[1])
    return total


def settled(vhost: str, settings: RabbitMQSettings) -> Callable[[], Awaitable[bool]]:
    """A :func:`~tests.support.waiting.wait_for` predicate: nothing :func:`unsettled`."""

    async def check() -> bool:
        return await asyncio.to_thread(unsettled, vhost, settings) == 0

    return check


async def take_dead_letters(settings: RabbitMQSettings) -> list[AbstractIncomingMessage]:
    """Take (auto-ack) every dead letter: for assertions at the end of a test."""
    connection = await aio_pika.connect(settings.url)
    letters: list[AbstractIncomingMessage] = []
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(settings.dead_letter_queue, passive=True)
        while len(letters) < 10_000:
            message = await queue.get(no_ack=True, fail=False)
            if message is None:
                break
            letters.append(message)
    finally:
        await connection.close()
    return letters


def dead_letter_reason(letter: AbstractIncomingMessage) -> str:
    """The reason the worker stamped on a dead letter (a string header)."""
    reason = letter.headers[REASON_HEADER]
    assert isinstance(reason, str), reason
    return reason


# -- in-process pumps ----------------------------------------------------------------


Seen = list[tuple[int, float]]  # (delivery count, monotonic time) per handler call


def credit_registry(before: Callable[[Context], Any] | None = None) -> tuple[Registry, Seen]:
    """The real credit handler, with a hook that runs first (to fail, to record)."""
    registry, seen = Registry(), []

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def handle(ctx: Context, message: CreditRequested) -> None:
        seen.append((ctx.delivery_count, time.monotonic()))
        if before is not None and asyncio.iscoroutine(hook := before(ctx)):
            await hook
        await apply_credit(ctx, message)

    return registry, seen


def make_broker(settings: RabbitMQSettings) -> RabbitMQConsumer:
    return RabbitMQConsumer(settings, make_identity(settings))


@contextlib.asynccontextmanager
async def running(
    rabbit: RabbitMQSettings, database_url: str, registry: Registry, **overrides: Any
) -> AsyncIterator[Pump]:
    """One pump on ``rabbit``'s queue, consuming inside the block (tests/support/pumps.py)."""
    values: dict[str, Any] = {"database_url": database_url, "concurrency": 4, "grace_period": 5}
    values.update(overrides)
    settings = Settings(**values)
    async with (
        engine_for(database_url, pool_size=6) as engine,
        running_pump(make_broker(rabbit), engine, registry, settings, name="test") as pump,
    ):
        yield pump


# -- worker subprocesses ------------------------------------------------------------


def rabbit_env(settings: RabbitMQSettings, database_url: str, **extra: str) -> dict[str, str]:
    """The environment of a ``python -m worker.cli`` subprocess using ``settings``."""
    env = clean_env()
    env.update(
        WORKER_BROKER="rabbitmq",
        WORKER_DATABASE_URL=database_url,
        WORKER_RABBITMQ_URL=settings.url,
        WORKER_RABBITMQ_QUEUE=settings.queue,
        WORKER_RABBITMQ_EXCHANGE=settings.exchange,
        WORKER_RABBITMQ_RETRY_DELAYS=json.dumps(settings.retry_delays),
        WORKER_RABBITMQ_RECONNECT_INTERVAL=str(settings.reconnect_interval),
        WORKER_LOG_FORMAT="json",
        # test handler modules import as tests.rabbitmq.<module>
        PYTHONPATH=str(REPO),
    )
    env.update(extra)
    return env
