"""The inbox under sustained inserts with retention on a short horizon: the plain table's
batched DELETE purge against the partitioned inbox's whole-partition drops.

    python benchmarks/inbox_soak.py [--rows 5000000] [--writers 4] [--retention 120]
        [--period 30] [--interval 10] [--layouts table,partitioned] [--idle 10] [--server URL]

For each layout, on a throwaway PostgreSQL database of its own (migrated by the worker,
``WORKER_INBOX_LAYOUT`` as given), ``--writers`` connections insert markers, one per
transaction, with the pump's own marker statement (``INSERT INTO inbox (message_id,
consumer) VALUES ...``, random dedup keys as real message ids are), until ``--rows``
markers are in. Meanwhile the worker's own housekeeping pass (:func:`worker.retention.purge`)
runs every ``--interval`` seconds with a retention of ``--retention`` seconds: a DELETE of
bounded batches on the plain table, a rollover (partitions of ``--period`` seconds made
ahead, whole ones dropped) on the partitioned inbox. The layouts run one after the other,
never at once, so neither takes the other's CPU.

Reported, per layout: markers per minute over the run (every minute, and how far the
steadiest stretch strays from its mean), the latency of one marker insert (p50, p99,
p99.9, max), the inbox's table and index size at the end (every partition summed), WAL
written (``pg_current_wal_lsn`` before and after: cluster-wide, so the rate of WAL the
server wrote while idle just before, for ``--idle`` seconds, is shown next to it), and the
vacuum work.

Autovacuum: the server may run with ``autovacuum = off`` (the test server does). The
benchmark then does autovacuum's job itself: every 10 s it looks at each table of the
inbox as autovacuum would, with the default thresholds (dead rows above 50 + 20 % of the
table, rows inserted since the last vacuum above 1000 + 20 %), runs ``VACUUM`` where they
are crossed and times it. With autovacuum on, it leaves that to the server and reads
``pg_stat_user_tables``' autovacuum counts instead (PostgreSQL before 18 keeps no times).

Commits are asynchronous (``synchronous_commit = off`` in the writers' sessions): both
layouts pay the same flush per commit, and on a shared machine its noise would drown what
differs, the table's own work. The writers run in this process, on asyncpg directly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import time
import uuid
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg  # type: ignore[import-untyped,unused-ignore]
from sqlalchemy.engine import make_url

from worker import retention
from worker.db import create_engine
from worker.migrate import upgrade
from worker.settings import Settings

MARK = "INSERT INTO inbox (message_id, consumer) VALUES ($1, 'soak')"  # inbox._MARK
VACUUM_EVERY = 10.0
WAL_EVERY = 0.5  # small stretches: read long before a checkpoint recycles their segments
SAMPLE_EVERY = 60.0
_TABLES = (
    "SELECT c.oid::regclass::text FROM pg_class c WHERE c.oid = 'inbox'::regclass "
    "AND c.relkind = 'r' UNION ALL SELECT relid::regclass::text FROM pg_partition_tree("
    "'inbox') WHERE isleaf AND (SELECT relkind FROM pg_class WHERE oid = 'inbox'::regclass) = 'p'"
)
_SIZE = f"SELECT coalesce(sum(pg_total_relation_size(t::regclass)), 0) FROM ({_TABLES}) AS x(t)"
_DUE = """
SELECT s.relid::regclass::text, s.n_dead_tup, s.n_ins_since_vacuum, greatest(c.reltuples, 0)
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.relname = 'inbox' OR s.relname LIKE 'inbox\\_%'
"""


@dataclass
class Run:
    layout: str
    rows: int = 0
    seconds: float = 0.0
    per_minute: list[int] = field(default_factory=list)
    latencies: array[float] = field(default_factory=lambda: array("d"))
    size: int = 0
    live_rows: int = 0
    wal: int = 0
    own_wal: int = 0
    unread_wal: int = 0
    wal_errors: set[str] = field(default_factory=set)
    loads: list[float] = field(default_factory=list)  # the machine's 1-minute load average
    idle_wal_per_minute: float = 0.0
    vacuums: int = 0
    vacuum_seconds: float = 0.0
    vacuum_longest: float = 0.0
    autovacuum_server: bool = False
    passes: int = 0
    pass_seconds: float = 0.0
    pass_longest: float = 0.0
    deleted: int = 0
    dropped: int = 0
    created: int = 0
    postponed: int = 0


@contextlib.asynccontextmanager
async def own_database(server: str, layout: str) -> AsyncIterator[str]:
    name = f"inbox_soak_{layout}_{uuid.uuid4().hex[:8]}"
    admin = server.replace("postgresql+asyncpg", "postgresql")
    connection = await asyncpg.connect(admin)
    try:
        await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()
    try:
        yield make_url(server).set(database=name).render_as_string(hide_password=False)
    finally:
        connection = await asyncpg.connect(admin)
        try:
            await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await connection.close()


def settings_for(url: str, layout: str, args: argparse.Namespace) -> Settings:
    horizon = timedelta(seconds=args.retention)
    return Settings(
        database_url=url,
        inbox_layout=layout,
        inbox_partition_period=timedelta(seconds=args.period),
        inbox_retention=horizon,
        # a redelivery window just inside the retention: the purge may take all it allows
        broker_lock_timeout=timedelta(seconds=1),
        max_deliveries=1,
        message_ttl=horizon - timedelta(seconds=1),
        dead_letter_margin=timedelta(0),
        purge_interval=args.interval,
        purge_batch=1000,
        purge_max_batches=1000,
    )


async def wal_lsn(connection: Any) -> int:
    return int(await connection.fetchval("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"))


_OURS = """
SELECT coalesce(sum(record_length), 0)::bigint, pg_current_wal_flush_lsn()::text
FROM pg_get_wal_records_info($1::text::pg_lsn, pg_current_wal_flush_lsn())
WHERE block_ref LIKE '%/' || (SELECT oid FROM pg_database WHERE datname = current_database())
    || '/%'
"""


async def wal_meter(dsn: str, run: Run, stop: asyncio.Event) -> None:
    """WAL records that touch this database's pages, read with pg_walinspect every
    :data:`WAL_EVERY` seconds (before the server recycles the segments): the WAL the layout
    itself causes, apart from the other databases on the server and from the commit
    records (one per marker on both layouts). A stretch whose segments were gone already
    is counted apart."""
    connection = await asyncpg.connect(dsn)
    try:
        try:
            await connection.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        except asyncpg.PostgresError:
            run.own_wal = -1  # not available: the cluster-wide figure only
            return
        start = await connection.fetchval("SELECT pg_current_wal_flush_lsn()::text")
        while True:
            stopping = stop.is_set()
            try:
                ours, start_next = await connection.fetchrow(_OURS, start)
                run.own_wal += ours
            except asyncpg.PostgresError as exc:
                if "future start" not in str(exc):  # else: no WAL flushed meanwhile
                    run.wal_errors.add(str(exc)[:120])
                start_next = await connection.fetchval("SELECT pg_current_wal_flush_lsn()::text")
                run.unread_wal += int(
                    await connection.fetchval(
                        "SELECT $2::text::pg_lsn - $1::text::pg_lsn", start, start_next
                    )
                )
            start = start_next
            if stopping:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=WAL_EVERY)
    finally:
        await connection.close()


async def writer(dsn: str, run: Run, target: int, started: float) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute("SET synchronous_commit = off")
        mark = await connection.prepare(MARK)
        latencies = run.latencies
        while run.rows < target:
            run.rows += 1
            async with connection.transaction():
                before = time.perf_counter()
                await mark.fetch(uuid.uuid4().hex)
                latencies.append(time.perf_counter() - before)
            minute = int((time.monotonic() - started) // 60)
            while len(run.per_minute) <= minute:
                run.per_minute.append(0)
            run.per_minute[minute] += 1
    finally:
        await connection.close()


async def housekeeping(settings: Settings, run: Run, stop: asyncio.Event) -> None:
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        while not stop.is_set():
            began = time.perf_counter()
            result = await retention.purge(engine, settings)
            took = time.perf_counter() - began
            run.passes += 1
            run.pass_seconds += took
            run.pass_longest = max(run.pass_longest, took)
            run.deleted += result.deleted
            if result.rollover is not None:
                run.dropped += len(result.rollover.dropped)
                run.created += len(result.rollover.created)
                run.postponed += len(result.rollover.postponed)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=settings.purge_interval)
    finally:
        await engine.dispose()


async def autovacuum(dsn: str, run: Run, stop: asyncio.Event) -> None:
    """Autovacuum's decision with its default thresholds, and the VACUUM it would run."""
    connection = await asyncpg.connect(dsn)
    try:
        run.autovacuum_server = await connection.fetchval("SHOW autovacuum") == "on"
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=VACUUM_EVERY)
            run.loads.append(os.getloadavg()[0])
            if run.autovacuum_server:
                continue
            for table, dead, inserted, tuples in await connection.fetch(_DUE):
                if dead > 50 + 0.2 * tuples or inserted > 1000 + 0.2 * tuples:
                    began = time.perf_counter()
                    with contextlib.suppress(asyncpg.UndefinedTableError):  # dropped meanwhile
                        await connection.execute(f"VACUUM {table}")
                    took = time.perf_counter() - began
                    run.vacuums += 1
                    run.vacuum_seconds += took
                    run.vacuum_longest = max(run.vacuum_longest, took)
    finally:
        await connection.close()


async def soak(server: str, layout: str, args: argparse.Namespace) -> Run:
    run = Run(layout)
    async with own_database(server, layout) as url:
        settings = settings_for(url, layout, args)
        await asyncio.to_thread(
            upgrade, url, inbox_layout=layout, partition_period=settings.partition_period
        )
        dsn = url.replace("postgresql+asyncpg", "postgresql")
        probe = await asyncpg.connect(dsn)
        try:
            idle = await wal_lsn(probe)
            await asyncio.sleep(args.idle)
            run.idle_wal_per_minute = (await wal_lsn(probe) - idle) * 60 / max(args.idle, 1e-3)
            wal_before = await wal_lsn(probe)
            stop = asyncio.Event()
            chores = [
                asyncio.create_task(housekeeping(settings, run, stop)),
                asyncio.create_task(autovacuum(dsn, run, stop)),
                asyncio.create_task(wal_meter(dsn, run, stop)),
            ]
            started = time.monotonic()
            await asyncio.gather(
                *(writer(dsn, run, args.rows, started) for _ in range(args.writers))
            )
            run.seconds = time.monotonic() - started
            stop.set()
            await asyncio.gather(*chores)
            run.wal = await wal_lsn(probe) - wal_before
            run.size = int(await probe.fetchval(_SIZE))
            run.live_rows = int(await probe.fetchval("SELECT count(*) FROM inbox"))
            if run.autovacuum_server:
                run.vacuums = int(
                    await probe.fetchval(
                        "SELECT coalesce(sum(autovacuum_count), 0) FROM pg_stat_user_tables "
                        "WHERE relname = 'inbox' OR relname LIKE 'inbox\\_%'"
                    )
                )
        finally:
            await probe.close()
    return run


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def whole_minutes(run: Run) -> list[int]:
    """The markers of every minute the run lasted from start to end (not its last, cut one)."""
    return run.per_minute[: int(run.seconds // 60)] or run.per_minute


def steady(minutes: list[int], args: argparse.Namespace) -> list[int]:
    """The whole minutes after the inbox first reached its horizon: before, it is filling up
    (and, partitioned, gaining the partitions every insert then looks into)."""
    filled = math.ceil((args.retention + args.period + args.interval) / 60)
    return minutes[filled:] or minutes[-1:]


def flatness(minutes: list[int]) -> float:
    """How far those minutes stray from their mean, at most (a share of it)."""
    mean = statistics.fmean(minutes)
    return max(abs(m - mean) for m in minutes) / mean


def mb(value: float) -> str:
    return f"{value / 1e6:,.1f} MB"


def report(runs: list[Run], args: argparse.Namespace) -> str:
    header = [
        "",
        *(f"{r.layout} ({'DELETE' if r.layout == 'table' else 'partitions'})" for r in runs),
    ]
    rows: list[list[str]] = []
    for run in runs:
        ordered = sorted(run.latencies)
        minutes = whole_minutes(run)
        settled = steady(minutes, args)
        run_rows = [
            f"{run.rows:,} in {run.seconds / 60:.1f} min",
            f"{run.rows / run.seconds * 60:,.0f}",
            f"{minutes[0]:,}",
            f"{len(settled)} min: {statistics.fmean(settled):,.0f}, "
            f"±{flatness(settled) * 100:.0f} %",
            f"{settled[-1]:,}",
            f"{quantile(ordered, 0.5) * 1000:.2f} / {quantile(ordered, 0.99) * 1000:.2f}"
            f" / {quantile(ordered, 0.999) * 1000:.1f} / {ordered[-1] * 1000:.0f}",
            f"{mb(run.size)} ({run.live_rows:,} rows)",
            (
                f"{mb(run.own_wal)}"
                + (f" (+{mb(run.unread_wal)} unread)" if run.unread_wal else "")
                if run.own_wal >= 0
                else "pg_walinspect missing"
            ),
            f"{mb(run.wal)} (idle: {mb(run.idle_wal_per_minute)}/min)",
            (
                f"{run.vacuums} autovacuums (server)"
                if run.autovacuum_server
                else f"{run.vacuums} runs, {run.vacuum_seconds:.1f} s, "
                f"longest {run.vacuum_longest:.1f} s"
            ),
            f"{run.passes} passes, {run.pass_seconds:.1f} s, longest {run.pass_longest:.2f} s",
            (
                f"{run.deleted:,} rows deleted"
                if run.layout == "table"
                else f"{run.created} made, {run.dropped} dropped, {run.postponed} postponed"
            ),
            (
                f"{statistics.fmean(run.loads):.1f} mean, "
                f"{min(run.loads):.1f} to {max(run.loads):.1f}"
                if run.loads
                else "-"
            ),
        ]
        rows.append(run_rows)
    labels = [
        "markers inserted",
        "markers per minute (mean)",
        "  the first minute (an empty inbox)",
        "  at the horizon: mean, most off it",
        "  the last whole minute",
        "marker insert ms p50 / p99 / p99.9 / max",
        "table + indexes at the end",
        "WAL of this database's pages",
        "WAL written (cluster-wide)",
        "vacuum (autovacuum's thresholds)",
        "retention passes",
        "  what they did",
        "machine load (1-min average) during the run",
    ]
    table = [header, *([label, *(r[i] for r in rows)] for i, label in enumerate(labels))]
    widths = [max(len(line[c]) for line in table) for c in range(len(header))]
    out = [
        "| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |"
        for line in table
    ]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for run in runs:
        every = ", ".join(f"{m:,}" for m in run.per_minute)
        out.append(f"{run.layout}: markers per minute: {every}")
        for error in sorted(run.wal_errors):
            out.append(f"{run.layout}: WAL not read: {error}")
    out.append(
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; writers {args.writers}, retention "
        f"{args.retention} s, partition period {args.period} s, housekeeping every "
        f"{args.interval} s; {os.cpu_count()} CPUs"
    )
    return "\n".join(out)


async def main(args: argparse.Namespace) -> None:
    runs = []
    for layout in args.layouts.split(","):
        runs.append(await soak(args.server, layout, args))
        print(f"{layout}: done, {runs[-1].rows:,} markers in {runs[-1].seconds:.0f} s", flush=True)
    print(report(runs, args))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=5_000_000, help="markers per layout")
    parser.add_argument("--writers", type=int, default=4, help="connections inserting")
    parser.add_argument("--retention", type=float, default=120.0, help="seconds kept")
    parser.add_argument("--period", type=float, default=30.0, help="seconds per partition")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between passes")
    parser.add_argument("--layouts", default="table,partitioned")
    parser.add_argument(
        "--idle", type=float, default=10.0, help="seconds the idle server's WAL is measured"
    )
    parser.add_argument(
        "--server",
        default="postgresql+asyncpg://postgres@127.0.0.1:5432/postgres",
        help="a PostgreSQL server the benchmark may create databases on",
    )
    asyncio.run(main(parser.parse_args()))
