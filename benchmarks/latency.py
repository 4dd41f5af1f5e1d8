"""Latency at a steady rate: the delay from publish to commit, per consumer, in one table.

    python -m benchmarks.latency [--seconds 20] [--runs 3] [--rates 300,600] [--top 0.8]
        [--only LABEL|LABEL]

For each consumer (the rows below) and each rate, ONE consumer process (concurrency 32)
takes ``CreditRequested`` deliveries over 100 accounts that this process publishes to
RabbitMQ at a steady rate for ``--seconds``; PostgreSQL holds the inbox. The delay of a
message is from the moment it was handed to the publishing channel to the moment its
inbox marker's transaction committed, seen as a ``NOTIFY`` that a statement trigger on
the inbox table sends with the ids it inserted (PostgreSQL delivers a notification at
its transaction's commit, and drops it with a rollback), so every consumer is timed by
the same clock and pays the same trigger. The first ``--warm-up`` seconds (2) are a
warm-up and not counted. Rates: each of ``--rates`` (300/s and 600/s), and ``--top``
(80 %) of the hand-written consumer's own maximum, measured in each round by draining
``--messages`` (3,000) queued deliveries first (benchmarks/throughput.py's run): the
steady streams a hand-written consumer keeps up with.

Rows: the hand-written aio-pika + asyncpg inbox consumer of benchmarks/throughput.py;
``worker run`` with the shipped keyed handler and ``WORKER_BATCH_SIZE=1`` (no groups:
one transaction per delivery); the same with the worker's default settings (group
commit: deliveries ready together share a transaction, up to 32; a delivery alone never
waits for company); and the set-based batch handler with the default settings. Rows
alternate inside each of ``--runs`` rounds; medians are printed.
A consumer that cannot keep up shows it: the rate it reached is printed next to p50,
p99 and the maximum, and a backlog makes its delays grow for the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
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

import aio_pika
import asyncpg  # type: ignore[import-untyped]
import httpx

from benchmarks.hot_rows import patiently, prepare, throwaway_vhost
from benchmarks.rabbitmq_vs_handwritten import admin_sql, cleanup
from benchmarks.throughput import (
    AMOUNT,
    BASELINE,
    SET_BASED,
    SHIPPED,
    SHIPPED_DEFAULT,
    Row,
    consumer_env,
    run_disturbed,
    spawn,
)
from tests.support.migrations import migrate_with_the_example
from tests.support.processes import free_port
from tests.support.rabbitmq import guest_url
from worker.brokers.rabbitmq import RabbitMQSettings, declare_topology
from worker.db import create_engine

ROWS = (BASELINE, SHIPPED, SHIPPED_DEFAULT, SET_BASED)
WARM_UP = 2.0
TICK = 0.005
CHANNEL = "bench_commit"
TRIGGER = f"""
CREATE OR REPLACE FUNCTION bench_notify_commit() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', string_agg(message_id, ',')) FROM fresh;
    RETURN NULL;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER bench_notify_commit AFTER INSERT ON inbox
    REFERENCING NEW TABLE AS fresh FOR EACH STATEMENT EXECUTE FUNCTION bench_notify_commit();
"""


@dataclass
class Timing:
    rate: float  # the rate asked for
    reached: float = 0.0  # deliveries committed per second while publishing
    p50: float | None = None  # ms
    p99: float | None = None
    worst: float | None = None
    lost: int = 0  # published, never seen committed
    problem: str = ""


@dataclass
class Watch:
    """Publish times and commit times by message id, in this process's monotonic clock."""

    sent: dict[str, float] = field(default_factory=dict)
    committed: dict[str, float] = field(default_factory=dict)

    def on_notify(self, _connection: object, _pid: int, _channel: str, payload: str) -> None:
        now = time.monotonic()
        for message_id in payload.split(","):
            self.committed.setdefault(message_id, now)


async def publish_steadily(
    rabbit: RabbitMQSettings, row: Row, rate: float, args: argparse.Namespace, watch: Watch
) -> None:
    """``rate`` deliveries a second for ``seconds``: each tick sends what is due by then."""
    connection = await aio_pika.connect(rabbit.url)
    try:
        channel = await connection.channel(publisher_confirms=False)
        exchange = await channel.get_exchange(rabbit.exchange, ensure=False)
        started = time.monotonic()
        counter = itertools.count()
        sent = 0
        tag = rabbit.queue
        while (elapsed := time.monotonic() - started) < args.seconds:
            due = int(elapsed * rate) - sent
            for _ in range(due):
                n = next(counter)
                message_id = f"{tag}-{n}"
                body = f'{{"account_id": "acct-{n % args.accounts}", "amount": "{AMOUNT}"}}'
                message = aio_pika.Message(
                    body.encode(),
                    message_id=message_id,
                    type=row.message_type,
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                )
                watch.sent[message_id] = time.monotonic()
                await exchange.publish(message, routing_key=row.message_type)
            sent += max(due, 0)
            await asyncio.sleep(TICK)
    finally:
        await connection.close()


async def timed(row: Row, rate: float, args: argparse.Namespace, vhost: str, logs: Path) -> Timing:
    """One consumer at one steady rate."""
    tag = f"lat-{uuid.uuid4().hex[:6]}"
    rabbit = RabbitMQSettings(url=guest_url(vhost), queue=tag, exchange=f"{tag}.in")
    port = free_port()
    env = consumer_env(row, args, rabbit, port, expect=10**9)
    db = create_engine(args.database_url, pool_size=1, max_overflow=0)
    try:
        await prepare(db, args.accounts)
    finally:
        await db.dispose()
    connection = await aio_pika.connect(rabbit.url)
    try:
        await declare_topology(await connection.channel(), rabbit)
    finally:
        await connection.close()
    timing = Timing(rate)
    watch = Watch()
    listener = await asyncpg.connect(args.database_url.replace("postgresql+asyncpg", "postgresql"))
    await listener.add_listener(CHANNEL, watch.on_notify)
    process = spawn(row, env, logs / f"{tag}.log")
    try:
        await until_ready(process, row, port)
        began = time.monotonic()
        await publish_steadily(rabbit, row, rate, args, watch)
        for _ in range(600):  # the stragglers: 30 s at most
            if len(watch.committed) >= len(watch.sent):
                break
            await asyncio.sleep(0.05)
        measured(timing, watch, began, args.seconds, args.warm_up)
    except (OSError, RuntimeError, TimeoutError) as exc:
        timing.problem = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        process.signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(process.wait, 30)
        except subprocess.TimeoutExpired:
            process.kill()
        await listener.close()
        await patiently("deleting the queues", lambda: cleanup(rabbit))
    return timing


def measured(
    timing: Timing, watch: Watch, began: float, seconds: float, warm_up: float = WARM_UP
) -> None:
    counted = [m for m, at in watch.sent.items() if at - began >= warm_up]
    delays = sorted(
        (watch.committed[m] - watch.sent[m]) * 1000 for m in counted if m in watch.committed
    )
    timing.lost = len(watch.sent) - len(watch.committed)
    inside = [at for at in watch.committed.values() if began + warm_up <= at <= began + seconds]
    timing.reached = len(inside) / max(seconds - warm_up, 0.001)
    if delays:
        timing.p50 = delays[len(delays) // 2]
        timing.p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
        timing.worst = delays[-1]
    if timing.lost:
        timing.problem = f"{timing.lost} never committed within 30 s of the last publish"


async def until_ready(process: object, row: Row, port: int, seconds: float = 60) -> None:
    from tests.support.processes import WorkerProcess

    assert isinstance(process, WorkerProcess)
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.process.poll() is not None:
                raise RuntimeError(f"{row.label}: exited before it was ready")
            if process.logged("pump started"):
                if row.serve:
                    return
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                        return
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{row.label}: not ready within {seconds:.0f}s")


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def report(results: dict[tuple[str, str], list[Timing]], args: argparse.Namespace) -> None:
    print(
        f"\nPublish-to-commit delay, RabbitMQ + PostgreSQL on loopback, 1 consumer process at "
        f"concurrency {args.concurrency}, {args.seconds:g} s per rate ({args.warm_up:g} s "
        f"warm-up not counted); median of {args.runs} runs, rows alternating\n"
    )
    header = ("consumer", "rate", "reached/s", "p50 ms", "p99 ms", "max ms")
    widths = (max([52, *(len(label) for label, _ in results)]), 16, 9, 7, 7, 8)
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for (label, which), timings in results.items():
        rate = _median([t.rate for t in timings])
        cells = [
            label,
            f"{rate:.0f}/s ({which})" if rate else which,
            f"{_median([t.reached for t in timings]) or 0:.0f}",
            *(
                f"{v:.1f}" if (v := _median([getattr(t, k) for t in timings])) is not None else "-"
                for k in ("p50", "p99", "worst")
            ),
        ]
        print("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |")
    problems = [
        f"  {k[0]} ({k[1]}): {t.problem}" for k, ts in results.items() for t in ts if t.problem
    ]
    if problems:
        print("problems:\n" + "\n".join(problems))
    print("\ntargets: default settings keep up (>= 99 % of the rate) with a p99 <= 2x the")
    print("hand-written consumer's at the same rate:")
    for label, which in results:
        if label != SHIPPED_DEFAULT.label:
            continue
        mine, theirs = results[label, which], results.get((BASELINE.label, which), [])
        rate = _median([t.rate for t in mine]) or 0.0
        reached = _median([t.reached for t in mine]) or 0.0
        p99, base = _median([t.p99 for t in mine]), _median([t.p99 for t in theirs])
        kept = reached >= 0.99 * rate
        ratio = p99 / base if p99 and base else None
        verdict = "met" if kept and ratio is not None and ratio <= 2.0 else "missed"
        shown = f"{ratio:.2f}x" if ratio is not None else "-"
        print(f"  {which}: reached {reached:.0f}/{rate:.0f}/s, p99 {shown}: {verdict}")


async def main(args: argparse.Namespace) -> int:
    name = f"latency_{uuid.uuid4().hex[:8]}"
    args.database_url = args.postgres.rsplit("/", 1)[0] + f"/{name}"
    args.timeout, args.profile = 120.0, ""
    logs = Path(tempfile.mkdtemp(prefix="latency_"))
    wanted = args.only.split("|") if args.only else []
    rows = [r for r in ROWS if r is BASELINE or not wanted or any(o in r.label for o in wanted)]
    await admin_sql(args.postgres, f'CREATE DATABASE "{name}"')
    results: dict[tuple[str, str], list[Timing]] = {}
    failed: list[str] = []  # the draining runs' problems (report() prints the others)
    try:
        await asyncio.to_thread(migrate_with_the_example, args.database_url)
        await admin_sql(args.database_url, TRIGGER)
        db = create_engine(args.database_url, pool_size=1, max_overflow=0)
        try:
            async with throwaway_vhost("latency") as vhost:
                for run in range(args.runs):
                    # the hand-written consumer's own maximum this round: the top rate
                    drained = await run_disturbed(BASELINE, 0.0, args, db, vhost, logs, run * 10)
                    if drained.problem:
                        failed.append(f"  {BASELINE.label} (draining): {drained.problem}")
                    rates = [(f"{r:g}/s", r) for r in args.rates]
                    if drained.rate:
                        top = args.top * drained.rate
                        rates.append((f"{args.top:.0%} of hand-written max", top))
                    for row in rows:
                        for which, rate in rates:
                            timing = await timed(row, rate, args, vhost, logs)
                            results.setdefault((row.label, which), []).append(timing)
                            print(
                                f"[{run + 1}/{args.runs}] {row.label} at {rate:.0f}/s "
                                f"(hand-written max {drained.rate:.0f}/s): "
                                f"reached {timing.reached:.0f}/s, "
                                f"p50 {timing.p50} p99 {timing.p99} max {timing.worst} "
                                f"{timing.problem}",
                                flush=True,
                            )
        finally:
            await db.dispose()
    finally:
        await admin_sql(args.postgres, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    report(results, args)
    if failed:
        print("draining runs with a problem:\n" + "\n".join(failed))
    if failed or any(t.problem for ts in results.values() for t in ts):
        print(f"\nconsumer logs: {logs}")
        return 1
    shutil.rmtree(logs, ignore_errors=True)
    return 0


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument(
        "--rates",
        type=lambda v: [float(r) for r in v.split(",") if r],
        default=[300.0, 600.0],
        help="steady rates, comma-separated (and --top of the hand-written maximum)",
    )
    parser.add_argument(
        "--top", type=float, default=0.8, help="the top rate: this share of the hand-written max"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--messages", type=int, default=3000, help="queued deliveries drained for the maximum"
    )
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument(
        "--warm-up", type=float, default=WARM_UP, help="first seconds of a rate not counted"
    )
    parser.add_argument(
        "--only", default="", help="rows whose label contains one of these (|); and the baseline"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--postgres", default="postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
