"""Hot rows: many credits to a few accounts, through real ``worker run`` processes.

    python -m benchmarks.hot_rows [--messages 10000] [--repeat 1] [--quick]

N ``CreditRequested`` bodies (1.25 each) over 5 accounts are queued in RabbitMQ,
then P ``python -m worker.cli run`` processes (concurrency 16 each; P = 1, then 4; the
worker's default settings otherwise: group commit, groups up to 32) consume them into
PostgreSQL. Rows (handlers in benchmarks/hot_rows_handlers.py):

- the reference read-modify-write handler (``handlers.credit.apply_credit``);
- the same with ``key=account_id`` (serialized per account inside each process);
- a ``SELECT ... FOR UPDATE`` handler (``with_for_update()``);
- an atomic ``UPDATE ... SET balance = balance + :amount`` handler;
- the hand-written aio-pika + asyncpg consumer of benchmarks/rabbitmq_vs_handwritten.py
  (atomic upsert, no pump), run as the same number of processes;
- the keyed reference handler on 100 cold accounts: what the key must come close to;
- the ``with_for_update()`` handler with the key as well.

msg/s counts the commits made once every process of the run had logged
``pump started`` (PostgreSQL's transaction start times of the inbox markers), so
process start-up is not in it. The counters are the sums of the workers'
``pump stopped`` log lines (each worker is stopped with SIGTERM once the queues
are drained). Every run must end with every balance exact and one marker per
message, or its row says so. Runs alternate rows; ``--repeat`` reports medians.

Needs RabbitMQ (with ``rabbitmqctl``: a throwaway vhost) and PostgreSQL (a
throwaway database); both are removed afterwards. Everything is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from aiormq.exceptions import AMQPError
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.hot_rows_handlers import MESSAGE_TYPE
from benchmarks.rabbitmq_vs_handwritten import admin_sql, cleanup, fill, handwritten_run, messages
from tests.rabbitmq.rabbit_helpers import all_depths, rabbit_env, unsettled
from tests.support.migrations import migrate_with_the_example
from tests.support.processes import REPO, WorkerProcess
from tests.support.rabbitmq import HOST, guest_url, rabbitmqctl
from worker.brokers.rabbitmq import RabbitMQSettings
from worker.db import create_engine
from worker.errors import BrokerUnavailable
from worker.settings import Settings

AMOUNT = Decimal("1.25")  # what rabbitmq_vs_handwritten.messages() credits each time
SHAPES = ((1, 16), (4, 16))  # (processes, concurrency each)


@dataclass(frozen=True)
class Row:
    label: str
    variant: str  # a HOT_ROWS_VARIANT, or "hand-written"
    accounts: int = 5


ROWS = (
    Row("reference, no key", "reference"),
    Row("reference, key=account_id", "keyed"),
    Row("with_for_update()", "for-update"),
    Row("atomic UPDATE", "atomic"),
    Row("hand-written aio-pika+asyncpg", "hand-written"),
    Row("keyed, 100 cold accounts", "keyed", accounts=100),
    Row("keyed + with_for_update()", "keyed-for-update"),
)

# The rows the targets compare first, the slowest last: a spent --budget cuts the least.
RUN_ORDER = (ROWS[1], ROWS[5], ROWS[3], ROWS[4], ROWS[2], ROWS[6], ROWS[0])


@dataclass
class Result:
    rate: float = 0.0  # commits per second with every process up
    seconds: float = 0.0  # wall clock from the first start to drained
    stats: Counter[str] = field(default_factory=Counter)
    dead_letters: int = 0
    exact: bool = False
    disturbed: bool = False  # a shared server went away during the run
    timed_out: bool = False  # not every message committed within --timeout
    problem: str = ""


# -- one run -------------------------------------------------------------------------


class HandwrittenProcess(WorkerProcess):
    """The hand-written consumer in its own OS process (this module, ``--serve-handwritten``)."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        command = [sys.executable, "-m", "benchmarks.hot_rows", "--serve-handwritten"]
        self.process = subprocess.Popen(
            command, env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT
        )


async def prepare(db: AsyncEngine, accounts: int) -> None:
    """Empty tables and the accounts already there: every variant updates, none creates."""
    async with db.begin() as connection:
        await connection.execute(text("TRUNCATE inbox, accounts"))
        rows = [{"id": f"acct-{n}"} for n in range(accounts)]
        insert = "INSERT INTO accounts (id, balance, version) VALUES (:id, 0, 1)"
        await connection.execute(text(insert), rows)


MEASURE = text(
    "SELECT count(*) FILTER (WHERE processed_at >= CAST(:t AS timestamptz)), "
    "extract(epoch FROM max(processed_at) - CAST(:t AS timestamptz)), "
    "extract(epoch FROM max(processed_at) - min(processed_at)), "
    "count(*), count(DISTINCT message_id) FROM inbox"
)


# rabbitmq_vs_handwritten.messages(): message "run<r>-<n>" credits account "acct-<n % accounts>"
PER_ACCOUNT = text(
    "SELECT 'acct-' || (split_part(message_id, '-', 2)::int % :accounts), count(*) "
    "FROM inbox GROUP BY 1"
)


async def measure(
    db: AsyncEngine, count: int, accounts: int, since: datetime
) -> tuple[float, bool, str]:
    """Commits per second after ``since``, and whether balances and markers are exact.

    Exact: one marker per message, and every balance is the sum of the credits whose
    markers are there (all of them, unless the run ran out of time).
    """
    async with db.connect() as connection:
        after, span, whole, markers, distinct = (
            await connection.execute(MEASURE, {"t": since})
        ).one()
        rows = await connection.execute(text("SELECT id, balance FROM accounts"))
        found = {row[0]: Decimal(row[1]) for row in rows}
        rows = await connection.execute(PER_ACCOUNT, {"accounts": accounts})
        marked = {row[0]: int(row[1]) for row in rows}
    wrong = [a for a in found if found[a] != AMOUNT * marked.get(a, 0)]
    problems = []
    if wrong:
        problems.append(f"{len(wrong)} balances wrong")
    if markers != distinct:
        problems.append(f"{markers} markers for {distinct} messages")
    if markers < count:
        problems.append(f"timed out: {markers} of {count} committed")
    if after >= markers // 2 and span:  # the usual case: most work done with every process up
        rate = after / float(span)
    else:  # the first process took most of it before the others were up
        rate = markers / float(whole) if whole else 0.0
    return rate, not wrong and markers == distinct, ", ".join(problems)


async def progress(db: AsyncEngine) -> int:
    """Markers so far; -1 when the server refuses (a shared server may run out of clients)."""
    try:
        async with db.connect() as connection:
            return int((await connection.execute(text("SELECT count(*) FROM inbox"))).scalar_one())
    except DBAPIError:
        return -1


def start(row: Row, env: dict[str, str], logs: Path, tag: str, slot: int) -> WorkerProcess:
    path = logs / f"{tag}-{slot}.log"
    if row.variant == "hand-written":
        return HandwrittenProcess(env, path)
    return WorkerProcess({**env, "HOT_ROWS_VARIANT": row.variant}, path)


def started_at(process: WorkerProcess) -> datetime | None:
    lines = process.events("pump started")
    return datetime.fromisoformat(lines[0]["timestamp"]) if lines else None


async def wait(what: str, seconds: float, check: Any, processes: list[WorkerProcess]) -> None:
    """Poll ``check`` (async) until true; fail on a dead process or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not await check():
        for process in processes:
            if process.process.poll() is not None:
                lines = process.log_path.read_text(errors="replace").strip().splitlines()
                last = lines[-1][:300] if lines else "no output"
                raise RuntimeError(f"{process.log_path.name} exited before {what}: {last}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {seconds:.0f}s")
        await asyncio.sleep(0.25)


async def run_once(
    row: Row,
    shape: tuple[int, int],
    args: argparse.Namespace,
    seconds: float,
    db: AsyncEngine,
    vhost: str,
    logs: Path,
    n: int,
) -> Result:
    count, (processes, concurrency) = args.messages, shape
    tag = f"hot{n}-{uuid.uuid4().hex[:6]}"
    rabbit = RabbitMQSettings(url=guest_url(vhost), queue=tag, exchange=f"{tag}.in")
    env = rabbit_env(
        rabbit,
        args.database_url,
        WORKER_HANDLERS="benchmarks.hot_rows_handlers",
        WORKER_CONCURRENCY=str(concurrency),
        WORKER_PURGE_INTERVAL="0",  # no inbox purge or claim sweep during the clock
        WORKER_OUTBOX_RELAY="false",  # these handlers publish nothing
        WORKER_GRACE_PERIOD="10",
        WORKER_DB_MAX_OVERFLOW="0",  # 4 x 18 connections must fit a shared server
        WORKER_LOG_LEVEL="INFO",
    )
    await prepare(db, row.accounts)
    batch = [replace(m, type=MESSAGE_TYPE) for m in messages(count, row.accounts, n)]
    await patiently("queueing the messages", lambda: fill(rabbit, batch))
    result = Result()
    workers: list[WorkerProcess] = []
    watch = asyncio.create_task(watch_services(result))
    began = time.monotonic()
    try:
        workers = [start(row, env, logs, tag, slot) for slot in range(processes)]

        async def all_started() -> bool:
            return all(started_at(w) is not None for w in workers)

        async def committed() -> bool:
            return await progress(db) >= count

        async def settled() -> bool:  # ready + unacked, as the server counts them
            try:
                return await asyncio.to_thread(unsettled, vhost, rabbit) == 0
            except RuntimeError:  # the broker is restarting (another user's test)
                return False

        await wait("every process to start", 90, all_started, workers)
        await wait(f"{count} commits", seconds, committed, workers)
        await wait("the queues to drain", 60, settled, workers)
        result.seconds = time.monotonic() - began
    except TimeoutError as exc:
        result.problem, result.timed_out = str(exc), True
    except RuntimeError as exc:
        result.problem = str(exc)
    finally:
        watch.cancel()
        await stop(workers, result)
    for worker in workers:
        if any(worker.events(event) for event in DISTURBANCES):
            result.disturbed = True
    result.dead_letters = (
        await patiently("counting dead letters", lambda: all_depths(rabbit))
    ).get(rabbit.dead_letter_queue, 0)
    await patiently("deleting the queues", lambda: cleanup(rabbit))
    starts = [t for t in map(started_at, workers) if t is not None]
    if starts and (result.timed_out or not result.problem):  # a timed-out run still counts
        result.rate, result.exact, wrong = await measure(db, count, row.accounts, max(starts))
        result.problem = wrong
    return result


async def stop(workers: list[WorkerProcess], result: Result) -> None:
    """SIGTERM every process (by its PID), then add up their ``pump stopped`` counters."""
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        try:
            await asyncio.to_thread(worker.wait, 40)
        except subprocess.TimeoutExpired:
            result.problem = result.problem or f"{worker.log_path.name}: no exit after SIGTERM"
            worker.kill()
        stopped = worker.events("pump stopped")
        for line in stopped:
            result.stats.update({k: v for k, v in line.items() if isinstance(v, int)})
        if not stopped:
            result.problem = result.problem or f"{worker.log_path.name}: no 'pump stopped' line"


# Log events that say a run was disturbed from outside (other users of the shared
# servers restart them): such a run is repeated rather than reported.
DISTURBANCES = ("rabbitmq connection lost, reconnecting", "paused", "database unavailable")


async def watch_services(result: Result) -> None:
    """Mark the run disturbed when RabbitMQ or PostgreSQL stops listening during it."""
    while not result.disturbed:
        for port in (5672, 5432):
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 5)
                writer.close()
            except (OSError, TimeoutError):
                result.disturbed = True
        await asyncio.sleep(0.5)


async def patiently(what: str, call: Any, seconds: float = 120) -> Any:
    """``await call()``, again while the broker is away (bounded): it is shared with tests."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await call()
        except (OSError, AMQPError, ConnectionError, BrokerUnavailable) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: the broker did not come back: {exc}") from exc
            await asyncio.sleep(1.0)


# -- the report ----------------------------------------------------------------------

COLUMNS = ("msg/s", "conflict retries", "exhausted", "nacks", "dead letters", "exact")


def summarize(row: Row, results: list[Result]) -> list[str]:
    """Medians over the runs without a problem; "-" where a consumer has no such counter."""

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.0f}" if values else "-"

    ok = [r for r in results if r.timed_out or not r.problem] or results
    pump = row.variant != "hand-written"  # no retries and no nack path: nothing to count
    late = "*" if any(r.timed_out for r in ok) else ""
    return [
        median([r.rate for r in ok]) + late,
        median([r.stats["retried-conflict"] for r in ok]) if pump else "-",
        median([r.stats["attempts-exhausted"] for r in ok]) if pump else "-",
        median([r.stats["nack"] for r in ok]) if pump else "-",
        median([r.dead_letters + r.stats["dead-letter"] for r in ok]),
        "yes" if results and all(r.exact for r in results) else "NO",
    ]


def report(results: Results, args: argparse.Namespace) -> None:
    print(
        f"\n{args.messages} credits of {AMOUNT}, RabbitMQ + PostgreSQL, real `worker run` "
        f"processes; median of {args.repeat} run(s) per row\n"
    )
    widths = (32, 7, 17, 10, 6, 13, 6)
    header = ("", *COLUMNS)
    for shape, rows in results.items():
        processes, concurrency = shape
        print(f"{processes} process(es) x concurrency {concurrency}")
        print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for row, runs in rows.items():
            cells = (row.label, *summarize(row, runs))
            print("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |")
            for r in runs:
                extra = {k: v for k, v in r.stats.items() if k in NOTEWORTHY and v}
                if r.problem or extra or args.repeat > 1:
                    note = f"rate {r.rate:.0f}, {r.seconds:.0f}s wall, {dict(extra)}"
                    print(f"    {row.label}: {note} {r.problem}".rstrip())
        print()
    print("* not every message committed within --timeout: msg/s of the part that did\n")
    print("ratios (median msg/s):")
    for shape, rows in results.items():
        rate = {row.variant + str(row.accounts): _median_rate(runs) for row, runs in rows.items()}
        keyed, cold = rate.get("keyed5", 0.0), rate.get("keyed100", 0.0)
        plain, atomic = rate.get("reference5", 0.0), rate.get("atomic5", 0.0)
        hand = rate.get("hand-written5", 0.0)
        print(
            f"  {shape[0]}x{shape[1]}: keyed hot / keyed cold = {_ratio(keyed, cold)} "
            f"(target >= 0.80); keyed / no key = {_ratio(keyed, plain)}; "
            f"atomic / hand-written = {_ratio(atomic, hand)}; "
            f"keyed / atomic = {_ratio(keyed, atomic)}"
        )


NOTEWORTHY = (
    "retried-transient",
    "retried-connection",
    "parked",
    "paused",
    "in-progress",
    "settlement-lost",
    "settlement-failed",
    "settled-twice",
    "duplicate",
)


def _median_rate(runs: list[Result]) -> float:
    ok = [r.rate for r in runs if r.timed_out or not r.problem]
    return statistics.median(ok) if ok else 0.0


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


# -- the hand-written consumer's process ---------------------------------------------


async def serve_handwritten() -> None:
    """Run benchmarks/rabbitmq_vs_handwritten.py's consumer until SIGTERM (env: rabbit_env)."""
    rabbit, settings = RabbitMQSettings(), Settings()
    url = settings.database_url
    task = asyncio.create_task(handwritten_run(rabbit, url, sys.maxsize, settings.concurrency))
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    now = datetime.now(UTC).isoformat()
    print(json.dumps({"event": "pump started", "timestamp": now}), flush=True)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    print(json.dumps({"event": "pump stopped"}), flush=True)


# -- main ----------------------------------------------------------------------------


Results = dict[tuple[int, int], dict[Row, list[Result]]]


async def run_all(
    args: argparse.Namespace, db: AsyncEngine, vhost: str, logs: Path, results: Results
) -> None:
    """Every row of every shape, ``--repeat`` times, alternating rows; stops at ``--budget``.

    A run disturbed by a restart of a shared server is run again (``--reruns`` times).
    """
    deadline = time.monotonic() + args.budget
    n = 0
    for repeat in range(args.repeat):
        for shape in results:
            for row in sorted(results[shape], key=RUN_ORDER.index):
                for attempt in range(args.reruns + 1):
                    if time.monotonic() > deadline:
                        print(f"--budget of {args.budget:.0f}s spent: stopping", flush=True)
                        return
                    n += 1
                    timeout = min(args.timeout, max(60.0, deadline - time.monotonic()))
                    result = await run_once(row, shape, args, timeout, db, vhost, logs, n)
                    print(
                        f"[{repeat + 1}/{args.repeat}] {shape[0]}x{shape[1]} {row.label}: "
                        f"{result.rate:.0f} msg/s, {result.seconds:.0f}s, {dict(result.stats)}"
                        f"{' DISTURBED' if result.disturbed else ''} {result.problem}",
                        flush=True,
                    )
                    if not result.disturbed or attempt == args.reruns:
                        results[shape][row].append(result)
                        break


@contextlib.asynccontextmanager
async def throwaway_vhost(prefix: str = "hot_rows") -> AsyncIterator[str]:
    """A vhost for this benchmark alone, deleted with everything in it (waiting out a
    broker restart by another user of the server, within bounds); named after the
    benchmark (``prefix``), so a leftover one says whose it is."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    await patiently("adding a vhost", lambda: _ctl("add_vhost", name))
    try:
        await patiently(
            "permissions", lambda: _ctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        )
        yield name
    finally:
        await patiently("deleting the vhost", lambda: _ctl("delete_vhost", name))


async def _ctl(*command: str) -> str:
    try:
        return await asyncio.to_thread(rabbitmqctl, *command)
    except RuntimeError as exc:  # "requires the 'rabbit' app to be running": restarting
        raise ConnectionError(str(exc).splitlines()[0]) from exc


async def main(args: argparse.Namespace) -> int:
    name = f"hot_rows_{uuid.uuid4().hex[:8]}"
    args.database_url = args.postgres.rsplit("/", 1)[0] + f"/{name}"
    logs = Path(tempfile.mkdtemp(prefix="hot_rows_"))
    shapes = [s for s in SHAPES if f"{s[0]}x{s[1]}" in args.shapes.split(",")]
    rows = [r for r in ROWS if not args.only or any(o in r.label for o in args.only.split(","))]
    results: Results = {shape: {row: [] for row in rows} for shape in shapes}
    await admin_sql(args.postgres, f'CREATE DATABASE "{name}"')
    try:
        await asyncio.to_thread(migrate_with_the_example, args.database_url)
        # one connection for the whole benchmark, opened before any worker starts:
        # polling must not compete with the workers for a shared server's last slots
        db = create_engine(args.database_url, pool_size=1, max_overflow=0)
        try:
            async with throwaway_vhost() as vhost:
                await run_all(args, db, vhost, logs, results)
        finally:
            await db.dispose()
    finally:
        await admin_sql(args.postgres, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    report(results, args)
    failed = any(r.problem for rows in results.values() for runs in rows.values() for r in runs)
    if failed or args.keep_logs:
        print(f"\nworker logs: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    return 1 if failed else 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs per row; medians reported")
    parser.add_argument("--quick", action="store_true", help="1,000 messages, one run each")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument("--budget", type=float, default=3600.0, help="seconds for all runs")
    parser.add_argument("--reruns", type=int, default=2, help="per run disturbed from outside")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--shapes", default="1x16,4x16", help="processes x concurrency, of these")
    parser.add_argument("--only", default="", help="rows whose label contains one of these")
    parser.add_argument(
        "--postgres", default="postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--serve-handwritten", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.messages, args.repeat, args.timeout = 1_000, 1, 120.0
    return args


if __name__ == "__main__":
    options = parse()
    if options.serve_handwritten:
        asyncio.run(serve_handwritten())
    else:
        sys.exit(asyncio.run(main(options)))
