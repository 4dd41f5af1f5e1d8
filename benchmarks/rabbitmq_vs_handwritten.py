"""The worker (Pump + RabbitMQ adapter + PostgreSQL) against a hand-written inbox consumer.

    python benchmarks/rabbitmq_vs_handwritten.py [--messages 5000] [--accounts 20] [--runs 3]

Both consume the same N ``CreditRequested`` messages from the same kind of queue
(the adapter's quorum queue) with the same prefetch and database pool size:

- worker: :class:`worker.pump.Pump` at its default settings (group commit, groups up
  to 32) with the reference handler (read-modify-write guarded by a version token; a
  conflict re-runs the attempt on a new session);
- worker, SQL handler: the same pump with a handler that runs the hand-written
  consumer's atomic ``INSERT .. ON CONFLICT DO UPDATE`` through ``ctx.session``
  (separates the pump's own cost from the ORM read-modify-write's);
- hand-written: aio-pika + asyncpg, one transaction per message: insert the inbox
  marker ``ON CONFLICT DO NOTHING``; if it was new, ``UPDATE accounts SET balance =
  balance + $1`` (an atomic increment: no token, no retries); commit, then ack.

Each run starts on empty tables with all N messages already queued; the clock
runs from "start consuming" to the N-th ack. Prints messages/s (median of the
runs, alternating the two) and the ratio. Needs RabbitMQ and PostgreSQL; makes a
scratch database and uniquely named queues, and removes them afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
import uuid
from decimal import Decimal
from typing import Any

import aio_pika
import asyncpg  # type: ignore[import-untyped]
from sqlalchemy import text

from handlers.credit import CreditRequested, apply_credit
from tests.support.migrations import migrate_with_the_example
from worker import logs
from worker.brokers import OutgoingMessage
from worker.brokers.rabbitmq import (
    RabbitMQAdmin,
    RabbitMQConsumer,
    RabbitMQSettings,
    declare_topology,
    delete_topology,
    make_identity,
)
from worker.db import create_engine
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings

MARK = (
    "INSERT INTO inbox (message_id, consumer) VALUES ($1, 'credit') "
    "ON CONFLICT ON CONSTRAINT uq_inbox_message_consumer DO NOTHING RETURNING id"
)
CREDIT = (
    "INSERT INTO accounts (id, balance, version) VALUES ($1, $2, 1) ON CONFLICT (id) "
    "DO UPDATE SET balance = accounts.balance + EXCLUDED.balance, version = accounts.version + 1"
)

SQL_CREDIT = text(
    "INSERT INTO accounts (id, balance, version) VALUES (:a, :b, 1) ON CONFLICT (id) "
    "DO UPDATE SET balance = accounts.balance + EXCLUDED.balance, version = accounts.version + 1"
)


def messages(count: int, accounts: int, run: int) -> list[OutgoingMessage]:
    return [
        OutgoingMessage(
            f"run{run}-{n}",
            "CreditRequested",
            f'{{"account_id": "acct-{n % accounts}", "amount": "1.25"}}'.encode(),
        )
        for n in range(count)
    ]


async def _declare(settings: RabbitMQSettings) -> None:
    connection = await aio_pika.connect(settings.url)
    try:
        await declare_topology(await connection.channel(), settings)
    finally:
        await connection.close()


async def fill(settings: RabbitMQSettings, batch: list[OutgoingMessage]) -> None:
    await _declare(settings)  # `worker publish` declares nothing: a worker's start does
    admin = RabbitMQAdmin(settings, make_identity(settings))
    try:
        await admin.publish(batch)
    finally:
        await admin.close()


async def sql_credit(ctx: Context, message: CreditRequested) -> None:
    """The hand-written consumer's statement, in the pump's transaction."""
    await ctx.session.execute(SQL_CREDIT, {"a": message.account_id, "b": message.amount})


async def worker_run(
    settings: RabbitMQSettings, url: str, count: int, concurrency: int, handler: Any = apply_credit
) -> float:
    registry = Registry()
    registry.handler("CreditRequested", CreditRequested, consumer="credit")(handler)
    pump_settings = Settings(database_url=url, concurrency=concurrency, purge_interval=0)
    engine = create_engine(url, pool_size=pump_settings.pool_size)
    pump = Pump(
        RabbitMQConsumer(settings, make_identity(settings)), engine, registry, pump_settings
    )
    started = time.perf_counter()
    task = asyncio.create_task(pump.run())
    try:
        async with asyncio.timeout(600):
            while pump.stats["ack"] < count:
                if task.done():
                    task.result()
                await asyncio.sleep(0.005)
        return time.perf_counter() - started
    finally:
        pump.stop()
        await task
        await engine.dispose()


async def handwritten_run(
    settings: RabbitMQSettings, url: str, count: int, concurrency: int
) -> float:
    pool = await asyncpg.create_pool(
        url.replace("postgresql+asyncpg", "postgresql"),
        min_size=concurrency,
        max_size=concurrency + 2,
    )
    connection = await aio_pika.connect_robust(settings.url)
    acked = 0
    done = asyncio.Event()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal acked
        body = CreditRequested.model_validate_json(message.body)
        async with pool.acquire() as db, db.transaction():
            if await db.fetchval(MARK, message.message_id) is not None:
                await db.execute(CREDIT, body.account_id, body.amount)
        await message.ack()  # after the commit
        acked += 1
        if acked == count:
            done.set()

    try:
        started = time.perf_counter()
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=concurrency)
        queue = await declare_topology(channel, settings)
        await queue.consume(on_message)
        async with asyncio.timeout(600):
            await done.wait()
        return time.perf_counter() - started
    finally:
        await connection.close()
        await pool.close()


async def check(url: str, count: int, accounts: int) -> None:
    """Both must be right before their speed means anything."""
    engine = create_engine(url, pool_size=1)
    async with engine.begin() as connection:
        markers = (await connection.execute(text("SELECT count(*) FROM inbox"))).scalar()
        total = (await connection.execute(text("SELECT sum(balance) FROM accounts"))).scalar()
        await connection.execute(text("TRUNCATE inbox, accounts"))
    await engine.dispose()
    assert markers == count and total == Decimal("1.25") * count, (markers, total, accounts)


async def admin_sql(admin_url: str, sql: str) -> None:
    connection = await asyncpg.connect(admin_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


async def cleanup(settings: RabbitMQSettings) -> None:
    connection = await aio_pika.connect(settings.url)
    async with connection:
        await delete_topology(await connection.channel(), settings)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--accounts", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument(
        "--postgres", default="postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    args = parser.parse_args()
    logs.configure("ERROR")
    name = f"bench_{uuid.uuid4().hex[:8]}"
    url = args.postgres.rsplit("/", 1)[0] + f"/{name}"
    queue = f"bench-{uuid.uuid4().hex[:6]}"
    settings = RabbitMQSettings(url=args.amqp, queue=queue, exchange=f"{queue}.in")
    await admin_sql(args.postgres, f'CREATE DATABASE "{name}"')
    runners: dict[str, Any] = {
        "worker": worker_run,
        "worker, SQL handler": functools.partial(worker_run, handler=sql_credit),
        "hand-written": handwritten_run,
    }
    results: dict[str, list[float]] = {label: [] for label in runners}
    try:
        await asyncio.to_thread(migrate_with_the_example, url)
        for run in range(args.runs):
            for label, runner in runners.items():
                batch = messages(args.messages, args.accounts, hash((run, label)))
                await fill(settings, batch)
                seconds = await runner(settings, url, args.messages, args.concurrency)
                await check(url, args.messages, args.accounts)
                results[label].append(args.messages / seconds)
    finally:
        await cleanup(settings)
        await admin_sql(args.postgres, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    print(
        f"{args.messages} messages over {args.accounts} accounts, prefetch/concurrency "
        f"{args.concurrency}, {args.runs} runs each (messages/s)\n"
    )
    baseline = statistics.median(results["hand-written"])
    print(f"{'consumer':22}{'median':>8}{'vs hand-written':>17}{'runs':>22}")
    for label, rates in results.items():
        runs = ", ".join(f"{r:.0f}" for r in rates)
        median = statistics.median(rates)
        print(f"{label:22}{median:>8.0f}{median / baseline:>17.2f}{runs:>22}")


if __name__ == "__main__":
    asyncio.run(main())
