"""Helpers for the RabbitMQ tests: the server's control, queue depths, subprocess workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from sqlalchemy import text

from handlers.credit import CreditRequested, apply_credit
from worker.brokers import OutgoingMessage
from worker.brokers.rabbitmq import RabbitMQAdmin, RabbitMQBroker, RabbitMQSettings, make_identity
from worker.db import create_engine
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings

HOST, PORT = "127.0.0.1", 5672
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def rabbitmqctl(*args: str, timeout: float = 60) -> str:
    """Run ``rabbitmqctl`` (bounded); the tests control the local server through it."""
    result = subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


async def arabbitmqctl(*args: str) -> str:
    """:func:`rabbitmqctl` without blocking the event loop (a pump keeps running meanwhile)."""
    return await asyncio.to_thread(rabbitmqctl, *args)


# -- messages --------------------------------------------------------------------


def credit(
    message_id: str | None, account: str, amount: Decimal | str, type: str = "CreditRequested"
) -> OutgoingMessage:
    body = json.dumps({"account_id": account, "amount": str(amount)}).encode()
    return OutgoingMessage(message_id, type, body)


async def publish(settings: RabbitMQSettings, messages: list[OutgoingMessage]) -> None:
    admin = RabbitMQAdmin(settings, make_identity(settings))
    try:
        await admin.publish(messages)
    finally:
        await admin.close()


async def publish_raw(settings: RabbitMQSettings, *messages: aio_pika.Message) -> None:
    """Publish exactly these AMQP messages (no id or type filled in) to the work queue."""
    connection = await aio_pika.connect(settings.url)
    try:
        channel = await connection.channel()
        for message in messages:
            await channel.default_exchange.publish(message, routing_key=settings.queue)
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


# -- waiting and the database ------------------------------------------------------


async def wait_for(
    predicate: Callable[[], Any], seconds: float, what: str, step: float = 0.05
) -> None:
    """Poll an (async or plain) predicate until true, or fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {seconds}s waiting for {what}")
        await asyncio.sleep(step)


async def scalar(database_url: str, sql: str) -> Any:
    engine = create_engine(database_url, pool_size=1)
    try:
        async with engine.connect() as connection:
            return (await connection.execute(text(sql))).scalar()
    finally:
        await engine.dispose()


async def fetch(database_url: str, sql: str) -> list[Any]:
    engine = create_engine(database_url, pool_size=1)
    try:
        async with engine.connect() as connection:
            return list(await connection.execute(text(sql)))
    finally:
        await engine.dispose()


async def execute(database_url: str, *statements: str) -> None:
    engine = create_engine(database_url, pool_size=1)
    try:
        async with engine.begin() as connection:
            for sql in statements:
                await connection.execute(text(sql))
    finally:
        await engine.dispose()


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


def make_broker(settings: RabbitMQSettings) -> RabbitMQBroker:
    return RabbitMQBroker(settings, make_identity(settings))


@contextlib.asynccontextmanager
async def running(
    rabbit: RabbitMQSettings, database_url: str, registry: Registry, **overrides: Any
) -> AsyncIterator[Pump]:
    values: dict[str, Any] = {"database_url": database_url, "concurrency": 4, "grace_period": 5}
    values.update(overrides)
    settings = Settings(**values)
    engine = create_engine(database_url, pool_size=6)
    pump = Pump(make_broker(rabbit), engine, registry, settings, name="test")
    task = asyncio.create_task(pump.run())

    def started() -> bool:
        if task.done():
            task.result()  # raise what stopped it
        return pump.running

    try:
        await wait_for(started, 15, "the pump to start")
        yield pump
    finally:
        pump.stop()
        async with asyncio.timeout(30):
            await task
        await engine.dispose()


# -- worker subprocesses ------------------------------------------------------------


def rabbit_env(settings: RabbitMQSettings, database_url: str, **extra: str) -> dict[str, str]:
    """The environment of a ``python -m worker.cli`` subprocess using ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
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


def worker_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "worker.cli", *args]


class WorkerProcess:
    """One ``worker run`` OS process, its log in a file of its own."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.process = subprocess.Popen(
            worker_cli("run"), env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log_lines(self) -> list[dict[str, Any]]:
        """The JSON log lines (aio-pika's own plain-text warnings are skipped)."""
        lines = []
        for raw in self.log_path.read_text(errors="replace").splitlines():
            if raw.startswith("{"):
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    continue
        return lines

    def logged(self, event: str) -> bool:
        return any(line.get("event") == event for line in self.log_lines())

    def signal(self, sig: signal.Signals) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        """Cleanup: SIGKILL this process (only this one, by its PID) if still running."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._log.close()


def events(workers: Iterable[WorkerProcess], event: str) -> list[dict[str, Any]]:
    return [line for w in workers for line in w.log_lines() if line.get("event") == event]
