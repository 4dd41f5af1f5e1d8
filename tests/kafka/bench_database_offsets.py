"""What offsets and delivery counts in the database cost: records per second per mode.

    python -m tests.kafka.bench_database_offsets [--records 3000] [--partitions 8] [--runs 3]

Starts its own Tansu on a loopback port (stopped by PID) and a throwaway PostgreSQL
database on the server of WORKER_TEST_POSTGRES_URL (default: the tests' local one),
migrated and dropped at the end. Each mode drains ``--records`` records without message
ids (their coordinates are their identity) through one in-process pump at concurrency
16, with a handler that only has its inbox marker to commit (the pump's own cost shows;
a real handler's work comes on top). Prints the median of ``--runs`` runs per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from typing import Any

from pydantic import BaseModel
from sqlalchemy import text

from tests.kafka.kafka_helpers import create_topic, produce, settings_for, unique
from tests.support.tansu import running_tansu
from worker.brokers.kafka import KafkaConsumer
from worker.db import create_engine
from worker.migrate import upgrade
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings

ADMIN = os.environ.get(
    "WORKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
)
CONCURRENCY = 16

MODES: dict[str, dict[str, Any]] = {
    "broker offsets (default)": {},
    "database offsets": {"offsets": "database"},
    "broker offsets + counts (redeliveries)": {"delivery_counts": "database"},
    "broker offsets + counts (every delivery)": {
        "delivery_counts": "database",
        "count_first_deliveries": True,
    },
    "database offsets + counts (redeliveries)": {
        "offsets": "database",
        "delivery_counts": "database",
    },
    "database offsets, batches of 32": {"offsets": "database", "batch_size": 32},
    "broker offsets, batches of 32": {"batch_size": 32},
}
_CORE = ("delivery_counts", "count_first_deliveries", "batch_size")


class Step(BaseModel):
    n: int


def registry() -> Registry:
    handlers = Registry()

    @handlers.handler("Step", Step, consumer="bench")
    async def step(ctx: Context, message: Step) -> None:
        return None

    return handlers


async def admin(sql: str) -> None:
    engine = create_engine(ADMIN, pool_size=1)
    try:
        async with engine.connect() as connection:
            await connection.execution_options(isolation_level="AUTOCOMMIT")
            await connection.execute(text(sql))
    finally:
        await engine.dispose()


async def drain(bootstrap: str, url: str, mode: dict[str, Any], records: int, parts: int) -> float:
    topic = unique("bench")
    await create_topic(bootstrap, topic, parts)
    batch = [(None, b'{"n": %d}' % n, {"type": "Step"}, n % parts) for n in range(records)]
    await produce(bootstrap, topic, batch)
    kafka = settings_for(
        bootstrap, topic, commit_interval=0.5, offsets=mode.get("offsets", "broker")
    )
    core = {k: v for k, v in mode.items() if k in _CORE}
    settings = Settings(database_url=url, concurrency=CONCURRENCY, **core)
    engine = create_engine(url, pool_size=CONCURRENCY + 2)
    pump = Pump(KafkaConsumer(settings, kafka), engine, registry(), settings)
    task = asyncio.create_task(pump.run())
    try:
        began = 0.0
        for _ in range(150_000):  # bounded: 300 s at most
            done = pump.stats["committed"]
            if done and not began:
                began = time.monotonic()  # from the first commit: joining is not measured
            if done >= records:
                break
            await asyncio.sleep(0.002)
        return (records - 1) / (time.monotonic() - began)
    finally:
        pump.stop()
        await task
        await engine.dispose()


async def main(records: int, partitions: int, runs: int) -> None:
    name = f"worker_bench_{uuid.uuid4().hex[:8]}"
    await admin(f'CREATE DATABASE "{name}"')
    url = ADMIN.rsplit("/", 1)[0] + f"/{name}"
    try:
        await asyncio.to_thread(upgrade, url)
        with running_tansu() as tansu:
            print(
                f"{records} records over {partitions} partitions, concurrency {CONCURRENCY}, "
                f"a handler with only its marker; median of {runs}"
            )
            results: dict[str, list[float]] = {label: [] for label in MODES}
            for _ in range(runs):  # the modes alternate, so drift hits them all alike
                for label, mode in MODES.items():
                    rate = await drain(tansu.bootstrap, url, mode, records, partitions)
                    results[label].append(rate)
            base = statistics.median(results["broker offsets (default)"])
            for label, rates in results.items():
                rate = statistics.median(rates)
                print(f"{label:42} {rate:8.0f} records/s  {rate / base:5.2f}x")
    finally:
        await admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.records, args.partitions, args.runs))
