"""What counting started attempts costs a first delivery and a redelivery, side by side.

    python -m benchmarks.delivery_count_cost [--messages 2000] [--runs 3] [--database URL]

N credits go through one pump (concurrency 16, the reference handler) on the memory
broker and PostgreSQL, as first deliveries and as redeliveries (each message handed out
with a count of 2, as after a lost ack), with ``WORKER_DELIVERY_COUNTS=database`` (the
default: a redelivery's start is one autocommitted upsert) and ``=broker`` (no table
write). Rows alternate inside each round; the table shows medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid

from sqlalchemy import text

from handlers.credit import CreditRequested, apply_credit
from tests.support.migrations import migrate_with_the_example
from worker import logs
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.pump import Pump
from worker.registry import Registry
from worker.settings import Settings

ADMIN = os.environ.get(
    "WORKER_BENCH_POSTGRES", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
)


async def run_once(url: str, messages: int, counts: str, redelivered: bool) -> float:
    registry = Registry()
    registry.handler("Credit", CreditRequested, consumer="credit")(apply_credit)
    engine = create_engine(url, pool_size=20)
    async with engine.begin() as connection:
        await connection.execute(text("TRUNCATE inbox, accounts, delivery_counts"))
    broker = MemoryBroker()
    tag = uuid.uuid4().hex[:6]
    settings = Settings(database_url=url, concurrency=16, delivery_counts=counts)
    pump = Pump(broker.connect(), engine, registry, settings)
    try:
        async with pump.running():
            started = time.perf_counter()
            for n in range(messages):
                body = f'{{"account_id": "a{n % 50}", "amount": "1"}}'.encode()
                broker.publish(f"{tag}-{n}", "Credit", body, delivered_before=int(redelivered))
            await broker.wait_idle(timeout=300)
            elapsed = time.perf_counter() - started
    finally:
        await engine.dispose()
    return messages / elapsed


async def main(messages: int, runs: int, database: str | None) -> None:
    logs.configure("WARNING")
    url = database
    created = None
    if url is None:
        created = f"bench_counts_{uuid.uuid4().hex[:8]}"
        admin = create_engine(ADMIN, pool_size=1)
        async with admin.connect() as connection:
            await connection.execution_options(isolation_level="AUTOCOMMIT")
            await connection.execute(text(f'CREATE DATABASE "{created}"'))
        await admin.dispose()
        url = ADMIN.rsplit("/", 1)[0] + f"/{created}"
    rows = [
        ("first delivery, counts=database", "database", False),
        ("first delivery, counts=broker", "broker", False),
        ("redelivery, counts=database", "database", True),
        ("redelivery, counts=broker", "broker", True),
    ]
    results: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    try:
        if created is not None:  # inside the try: a failed migration drops it too
            await asyncio.to_thread(migrate_with_the_example, url)
        for _ in range(runs):
            for name, counts, redelivered in rows:
                results[name].append(await run_once(url, messages, counts, redelivered))
    finally:
        if created is not None:
            admin = create_engine(ADMIN, pool_size=1)
            async with admin.connect() as connection:
                await connection.execution_options(isolation_level="AUTOCOMMIT")
                await connection.execute(text(f'DROP DATABASE "{created}" WITH (FORCE)'))
            await admin.dispose()
    print(f"python -m benchmarks.delivery_count_cost --messages {messages} --runs {runs}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(f"{'row':<36} {'msg/s':>8} {'us/msg':>8} {'vs broker':>10}")
    for name, _, _ in rows:
        median = statistics.median(results[name])
        base = statistics.median(results[name.replace("database", "broker")])
        print(f"{name:<36} {median:8.0f} {1e6 / median:8.0f} {median / base:9.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--database", help="an existing migrated PostgreSQL URL")
    args = parser.parse_args()
    asyncio.run(main(args.messages, args.runs, args.database))
