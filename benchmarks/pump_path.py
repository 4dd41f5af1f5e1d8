"""The pump's own per-message cost, without a network broker: a focused micro-benchmark.

    python -m benchmarks.pump_path [--messages 5000] [--rounds 3] [--only "reference|atomic"]

An in-process :class:`worker.pump.Pump` on the memory broker consumes N
``CreditRequested`` deliveries (100 accounts, concurrency 32) into PostgreSQL: with
``WORKER_BATCH_SIZE=1`` (no groups: one transaction per delivery), the reference handler
(``handlers.credit.apply_credit``, keyed by account) and the atomic-SQL handler of
benchmarks/throughput_handlers.py; with the default settings (group commit, groups up to
32), the keyed reference handler and the set-based batch handler. The same deliveries
are also run by the hand-written asyncpg inbox transaction (no broker, no pump) for
scale. ``--only`` picks the rows whose label contains one of its ``|``-separated parts.
Rounds alternate; medians are printed, msg/s and the process's CPU time per message
(steadier than msg/s on a shared machine). What is left between the pump rows and the
asyncpg row is the pump's, SQLAlchemy's and the handler's Python work: run it under
``py-spy record`` to see where it goes. Makes a scratch database and drops it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Any

import asyncpg  # type: ignore[import-untyped]
from sqlalchemy import text

from benchmarks.rabbitmq_vs_handwritten import CREDIT, MARK, admin_sql
from benchmarks.throughput_handlers import credit_atomic, credit_set_based
from handlers.credit import CreditRequested, apply_credit
from tests.support.migrations import migrate_with_the_example
from worker import logs
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine
from worker.pump import Pump
from worker.registry import Registry
from worker.settings import Settings


async def reset(url: str, accounts: int) -> None:
    engine = create_engine(url, pool_size=1)
    async with engine.begin() as connection:
        await connection.execute(text("TRUNCATE inbox, accounts"))
        insert = "INSERT INTO accounts (id, balance, version) VALUES (:id, 0, 1)"
        await connection.execute(text(insert), [{"id": f"acct-{n}"} for n in range(accounts)])
    await engine.dispose()


async def pump_run(
    url: str,
    count: int,
    accounts: int,
    concurrency: int,
    func: Any,
    key: bool,
    batch: int = 0,
    set_based: bool = False,
) -> tuple[float, float]:
    registry = Registry()
    keyed = (lambda m: m.account_id) if key else None
    if set_based:
        registry.handler("CreditRequested", CreditRequested, consumer="credit", batch=True)(func)
    else:
        registry.handler("CreditRequested", CreditRequested, consumer="credit", key=keyed)(func)
    values: dict[str, Any] = {"database_url": url, "concurrency": concurrency, "purge_interval": 0}
    if batch:  # else the default (groups up to 32)
        values["batch_size"] = batch
    settings = Settings(**values)
    engine = create_engine(url, pool_size=settings.pool_size, max_overflow=0)
    broker = MemoryBroker()
    tag = uuid.uuid4().hex[:8]
    for n in range(count):
        body = f'{{"account_id": "acct-{n % accounts}", "amount": "1.25"}}'.encode()
        broker.publish(f"{tag}-{n}", "CreditRequested", body)
    pump = Pump(broker.connect(), engine, registry, settings)
    started, cpu = time.perf_counter(), time.process_time()
    task = asyncio.create_task(pump.run())
    try:
        async with asyncio.timeout(300):
            while pump.stats["ack"] < count:
                if task.done():
                    task.result()
                await asyncio.sleep(0.005)
        return count / (time.perf_counter() - started), (time.process_time() - cpu) / count
    finally:
        pump.stop()
        await task
        await engine.dispose()
        noted = (
            "batch-isolated",
            "batch-deferred",
            "batch-retried",
            "batch-fallback",
            "duplicates-fast-path",
        )
        unusual = {k: v for k, v in pump.stats.items() if k in noted or k.startswith("retried")}
        if unusual:
            print(f"    {unusual}", flush=True)


async def asyncpg_run(url: str, count: int, accounts: int, concurrency: int) -> tuple[float, float]:
    dsn = url.replace("postgresql+asyncpg", "postgresql")
    pool = await asyncpg.create_pool(dsn, min_size=concurrency, max_size=concurrency + 2)
    tag = uuid.uuid4().hex[:8]
    work = [
        (f"{tag}-{n}", f'{{"account_id": "acct-{n % accounts}", "amount": "1.25"}}'.encode())
        for n in range(count)
    ]
    work.reverse()

    async def one() -> None:
        while work:
            message_id, raw = work.pop()
            body = CreditRequested.model_validate_json(raw)
            async with pool.acquire() as db, db.transaction():
                if await db.fetchval(MARK, message_id) is not None:
                    await db.execute(CREDIT, body.account_id, body.amount)

    started, cpu = time.perf_counter(), time.process_time()
    try:
        await asyncio.gather(*(one() for _ in range(concurrency)))
        return count / (time.perf_counter() - started), (time.process_time() - cpu) / count
    finally:
        await pool.close()


async def main(args: argparse.Namespace) -> None:
    logs.configure("WARNING", "json")
    name = f"pump_path_{uuid.uuid4().hex[:8]}"
    url = args.postgres.rsplit("/", 1)[0] + f"/{name}"
    one, default = "WORKER_BATCH_SIZE=1 (no groups)", "default settings (groups up to 32)"
    runners = {
        "asyncpg inbox (no broker)": lambda: asyncpg_run(url, *shape),
        f"pump, {one}, reference (keyed)": lambda: pump_run(
            url, *shape, apply_credit, True, batch=1
        ),
        f"pump, {one}, atomic-SQL handler": lambda: pump_run(
            url, *shape, credit_atomic, False, batch=1
        ),
        f"pump, {default}, reference (keyed)": lambda: pump_run(url, *shape, apply_credit, True),
        f"pump, {default}, set-based": lambda: pump_run(
            url, *shape, credit_set_based, False, set_based=True
        ),
    }
    shape = (args.messages, args.accounts, args.concurrency)
    if args.only:
        runners = {k: v for k, v in runners.items() if any(o in k for o in args.only.split("|"))}
    rates: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    await admin_sql(args.postgres, f'CREATE DATABASE "{name}"')
    try:
        await asyncio.to_thread(migrate_with_the_example, url)
        for _ in range(args.rounds):
            for label, runner in runners.items():
                await reset(url, args.accounts)
                rate, seconds = await runner()
                rates[label].append(rate)
                cpu[label].append(seconds * 1e6)
                print(f"  {label}: {rate:.0f} msg/s, {seconds * 1e6:.0f} us CPU/msg", flush=True)
    finally:
        await admin_sql(args.postgres, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    width = max([28, *(len(label) for label in rates)])
    print(f"{'':{width}} {'msg/s':>7} {'CPU us/msg':>11}  (msg/s of each round)")
    for label, values in rates.items():
        runs = ", ".join(f"{v:.0f}" for v in values)
        print(
            f"{label:{width}} {statistics.median(values):7.0f} "
            f"{statistics.median(cpu[label]):11.0f}  ({runs})"
        )


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="rows whose label contains one of these (|)")
    parser.add_argument(
        "--postgres", default="postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse()))
