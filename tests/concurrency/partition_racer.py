"""A process of the partitioned inbox's race (test_partitioned_inbox_race.py).

``python -m tests.concurrency.partition_racer replica <n> <messages> <start-at> <out>``
(settings from ``WORKER_*``): one pump on a memory broker of its own, with the
housekeeping loop (partitions made ahead while markers go in), given the same message ids
as every other replica, all published at ``start-at`` (epoch seconds). The handler holds
its transaction open for a random while, so copies straddle a partition boundary, and
sometimes fails after its marker went in, so a waiting copy sees a rollback and the
message comes back as a redelivery (the fast path, the bounded marker wait). Every
handler stage is a JSON line in ``out``: message id, start, end, outcome; the last line is
the broker's tallies.

``python -m tests.concurrency.partition_racer churn <seconds> <out>``: makes and drops
partitions years ahead (empty, so no retention rule is bent) as fast as their locks allow
for ``seconds``: every attach and every drop lands in the middle of the replicas' lookups.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

from pydantic import BaseModel
from sqlalchemy import text

from worker import logs, partitions, retention, rollover
from worker.brokers.memory import MemoryBroker
from worker.context import session_factory
from worker.db import create_engine
from worker.middleware import NextStage
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings, load
from worker.transaction import Stage
from worker.verdict import Verdict

HOLD = 0.8  # seconds a handler may keep its transaction (and its marker) open
FAIL = 0.12  # share of handler runs that fail after the marker went in
CHUNK = 16  # ids are shuffled within chunks: the replicas stay roughly in step


class Touch(BaseModel):
    n: int


async def replica(number: int, messages: int, start_at: float, out: Path) -> None:
    settings = load(Settings)
    logs.configure(settings.log_level, "json")
    log = logs.get_logger(replica=number)
    rng = random.Random(number)
    registry = Registry()

    @registry.handler("Touch", Touch, consumer="race")
    async def touch(ctx: Context, message: Touch) -> None:
        await asyncio.sleep(rng.uniform(0, HOLD))
        if rng.random() < FAIL:
            raise RuntimeError("failed after the marker went in")
        await ctx.session.execute(
            text("INSERT INTO race_effects (message_id, replica) VALUES (:m, :r)"),
            {"m": ctx.message_id, "r": number},
        )

    records: list[dict[str, object]] = []

    async def record(stage: Stage, call_next: NextStage) -> list[Verdict]:
        started = time.time()
        verdicts = await call_next(stage)
        ended = time.time()
        for item, verdict in zip(stage.items, verdicts, strict=True):
            records.append(
                {
                    "message_id": item.message_id,
                    "start": started,
                    "end": ended,
                    "outcome": verdict.outcome.value,
                    "batch": len(stage.items),
                }
            )
        return verdicts

    broker = MemoryBroker()
    engine = create_engine(settings.database_url, pool_size=settings.pool_size)
    pump = Pump(
        broker.connect(),
        engine,
        registry,
        settings,
        name=f"racer-{number}",
        stage_middleware=[record],
    )
    chores = retention.start(engine, session_factory(engine), registry, settings, log)
    try:
        async with pump.running():
            await asyncio.sleep(max(0.0, start_at - time.time()))
            ids = list(range(messages))
            for first in range(0, messages, CHUNK):
                chunk = ids[first : first + CHUNK]
                rng.shuffle(chunk)
                ids[first : first + CHUNK] = chunk
            for n in ids:
                broker.publish(f"m-{n}", "Touch", {"n": n})
            await broker.wait_idle(timeout=240)
    finally:
        if chores is not None:
            chores.cancel()
        await engine.dispose()
    lines = [json.dumps(entry) for entry in records]
    lines.append(json.dumps({"stats": dict(broker.stats)}))
    await asyncio.to_thread(out.write_text, "\n".join(lines) + "\n")


async def churn(seconds: float, out: Path) -> None:
    """Partitions years ahead, attached and dropped again and again, under lock timeouts."""
    settings = load(Settings)
    engine = create_engine(settings.database_url, pool_size=1)
    done = {"created": 0, "dropped": 0, "postponed": 0}
    deadline = time.monotonic() + seconds
    step = timedelta(seconds=1)
    try:
        async with engine.connect() as connection:
            base = rollover.boundary(await retention.database_now(connection), step)
            base += timedelta(days=5 * 365)
            k = 0
            while time.monotonic() < deadline:
                lower = base + k * step
                name = partitions.partition_name(lower)
                for statements, action in (
                    (partitions.create_partition(lower, lower + step), "created"),
                    (rollover.retire(name), "dropped"),
                ):
                    await connection.exec_driver_sql("SET lock_timeout = '1s'")
                    try:
                        for statement in statements:
                            await connection.exec_driver_sql(statement)
                        await connection.commit()
                        done[action] += 1
                    except Exception:  # a lock that stayed taken: the next round tries again
                        await connection.rollback()
                        done["postponed"] += 1
                        break
                k += 1
                await asyncio.sleep(0.5)
    finally:
        await engine.dispose()
    await asyncio.to_thread(out.write_text, json.dumps(done))


if __name__ == "__main__":
    if sys.argv[1] == "churn":
        asyncio.run(churn(float(sys.argv[2]), Path(sys.argv[3])))
    else:
        asyncio.run(
            replica(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), Path(sys.argv[5]))
        )
