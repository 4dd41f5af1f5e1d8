"""Throughput: the worker against hand-written consumers and FastStream, in one table.

    python -m benchmarks.throughput [--messages 5000] [--accounts 100] [--runs 3] [--quick]

N ``CreditRequested`` deliveries (1.25 each, over 100 accounts) are queued in
RabbitMQ, then ONE consumer process (prefetch and concurrency 32) drains them into
PostgreSQL. Every row runs in both scenarios, without duplicates and with 30 %
of the deliveries repeating an id published shortly before (a producer retry),
and the rows alternate inside each of ``--runs`` rounds; the table shows medians
and ratios to the hand-written inbox consumer of the same scenario. Rows:

- hand-written aio-pika + asyncpg inbox consumer: ``INSERT ... ON CONFLICT ON
  CONSTRAINT ... DO NOTHING RETURNING``, then the atomic upsert, one transaction,
  ack after the commit (benchmarks/rabbitmq_vs_handwritten.py's statements);
- the same without the marker (atomic upsert, no dedup);
- a FastStream subscriber: ORM read-modify-write of the versioned ``Account``, no
  dedup, a version conflict nacked for redelivery (needs the ``bench`` extra);
- ``worker run`` with ``WORKER_BATCH_SIZE=1`` (no groups: one transaction per
  delivery): the reference handler as registered (``handlers.credit``: ORM
  read-modify-write under the version token, keyed by account), the same function
  without the key, and an atomic-SQL handler (benchmarks/throughput_handlers.py);
- ``worker run`` with its default settings (group commit: deliveries of one type that
  are ready together share a transaction, groups up to ``WORKER_BATCH_SIZE`` = 32): the
  shipped keyed handler, the reference function without the key, a set-based batch
  handler, and a sweep of the group size;
- the transport's ceiling: aio-pika consuming the same queue with no database, acking
  each delivery, and with one ``basic.ack(multiple=True)`` per 32.

msg/s is deliveries settled per second from the consumer's ``pump started`` line
to the moment the benchmark sees the last settlement (the worker's ``/metrics``,
the other consumers' ``drained`` line; both polled every 20 ms, the worker's only
once the queue has handed out its last message: a scrape costs the worker CPU). Every run checks
each balance against the credits of the distinct message ids and the markers
against the ids: "exact" or "wrong" (a no-dedup consumer is wrong with duplicates,
by design). The consumer's CPU per delivery, the worker's peak RSS (VmHWM) and
start-to-ready (spawn to ``/readyz`` 200) are printed too, one extra run at concurrency
64 with groups up to 64, and issue 24's targets, met or missed. ``--profile DIR`` attaches
py-spy to every consumer (raw stacks for benchmarks/profile_breakdown.py).

Needs RabbitMQ (``rabbitmqctl``: a throwaway vhost) and PostgreSQL (a throwaway
database); both are removed afterwards. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import aio_pika
import httpx
from aiormq.exceptions import AMQPError, ChannelInvalidStateError
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.hot_rows import DISTURBANCES, patiently, prepare, throwaway_vhost
from benchmarks.rabbitmq_vs_handwritten import CREDIT, MARK, admin_sql, cleanup, fill
from benchmarks.throughput_handlers import MESSAGE_TYPE
from tests.rabbitmq.rabbit_helpers import all_depths, rabbit_env
from tests.support.migrations import migrate_with_the_example
from tests.support.processes import REPO, WorkerProcess, free_port
from tests.support.rabbitmq import guest_url
from worker.brokers import OutgoingMessage
from worker.brokers.rabbitmq import RabbitMQSettings
from worker.db import create_engine
from worker.errors import BrokerUnavailable

AMOUNT = Decimal("1.25")
SCENARIOS = (0.0, 0.3)  # share of deliveries that repeat an earlier message id
DUPLICATE_WINDOW = 200  # a duplicate repeats one of the last N ids (a producer retry)
POLL = 0.02


@dataclass(frozen=True)
class Row:
    label: str
    handlers: str = "handlers.credit"
    variant: str = ""  # THROUGHPUT_VARIANT of benchmarks/throughput_handlers.py
    batch: int = 0  # WORKER_BATCH_SIZE; 0: the default (groups up to 32), 1: no groups
    concurrency: int = 0  # 0: --concurrency
    dedup: bool = True
    scenarios: tuple[float, ...] = SCENARIOS
    serve: str = ""  # a consumer of this module (--serve), or "" for `worker run`
    tree: str = ""  # --tree: `worker run` from another checkout (before/after, one run)
    writes: bool = True  # False: the transport's ceiling, nothing to check in the database
    uvloop: bool = False  # `worker run` on uvloop's event loop (benchmarks/uvloop_worker.py)

    @property
    def message_type(self) -> str:
        return MESSAGE_TYPE if self.handlers == BENCH else "CreditRequested"


BENCH = "benchmarks.throughput_handlers"  # its rows use its own message type
BASELINE = Row("hand-written inbox (aio-pika + asyncpg)", serve="handwritten")
CEILING = Row(
    "consume-and-ack ceiling, ack each (no database)", serve="ceiling", dedup=False, writes=False
)
CEILING_MULTIPLE = Row(
    "consume-and-ack ceiling, multiple-ack per 32",
    serve="ceiling-multiple",
    dedup=False,
    writes=False,
)
FASTSTREAM = Row("FastStream, ORM read-modify-write, no dedup", serve="faststream", dedup=False)
DEFAULT = "default settings (groups up to 32)"
NO_GROUPS = "WORKER_BATCH_SIZE=1 (no groups)"
SHIPPED = Row(f"worker, {NO_GROUPS}, shipped ORM handler (keyed)", batch=1)
SHIPPED_DEFAULT = Row(f"worker, {DEFAULT}, shipped ORM handler (keyed)")
SET_BASED = Row(f"worker, {DEFAULT}, set-based handler", BENCH, "set-based")
ROWS = (
    BASELINE,
    Row("hand-written atomic, no dedup", serve="handwritten-nodedup", dedup=False),
    CEILING,
    CEILING_MULTIPLE,
    FASTSTREAM,
    SHIPPED,
    Row(f"worker, {NO_GROUPS}, reference ORM, no key", BENCH, "reference", batch=1),
    Row(f"worker, {NO_GROUPS}, atomic-SQL handler", BENCH, "atomic", batch=1),
    SHIPPED_DEFAULT,
    Row(f"worker, {DEFAULT}, reference ORM, no key", BENCH, "reference"),
    SET_BASED,
    *(
        Row(f"  sweep: WORKER_BATCH_SIZE={n}, set-based", BENCH, "set-based", batch=n)
        for n in (8, 128)
    ),
    replace(SHIPPED, label=f"{SHIPPED.label}, uvloop", uvloop=True),
    replace(SHIPPED_DEFAULT, label=f"{SHIPPED_DEFAULT.label}, uvloop", uvloop=True),
    replace(SET_BASED, label=f"{SET_BASED.label}, uvloop", uvloop=True),
    Row(
        "worker, WORKER_BATCH_SIZE=64 at concurrency 64, shipped handler",
        batch=64,
        concurrency=64,
        scenarios=(0.0,),
    ),
)


@dataclass
class Result:
    rate: float = 0.0
    ready: float | None = None  # seconds from spawn to ready
    rss_mb: float | None = None
    exact: bool = False
    problem: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    disturbed: bool = False  # the broker or the database restarted during the run
    cpu_us: float | None = None  # the consumer process's CPU per delivery, from its start
    cpu_at_start: float | None = None  # its CPU seconds when it started consuming


# -- the messages --------------------------------------------------------------------


def deliveries(
    count: int, accounts: int, duplicates: float, seed: str, type: str = "CreditRequested"
) -> list[OutgoingMessage]:
    """``count`` deliveries; a share ``duplicates`` repeats an id (and body) seen shortly before."""
    rng = random.Random(seed)
    out: list[OutgoingMessage] = []
    fresh: list[OutgoingMessage] = []
    for n in range(count):
        if fresh and rng.random() < duplicates:
            out.append(fresh[rng.randrange(max(0, len(fresh) - DUPLICATE_WINDOW), len(fresh))])
            continue
        body = f'{{"account_id": "acct-{n % accounts}", "amount": "{AMOUNT}"}}'.encode()
        message = OutgoingMessage(f"{seed}-{n}", type, body)
        fresh.append(message)
        out.append(message)
    return out


def expected(batch: list[OutgoingMessage], dedup: bool) -> tuple[dict[str, Decimal], int]:
    """Balance per account that an exactly-once consumer must reach, and the distinct ids."""
    seen: dict[str, OutgoingMessage] = {}
    for message in batch:
        seen.setdefault(str(message.message_id), message)
    balances: dict[str, Decimal] = {}
    for message in seen.values() if dedup else batch:
        account = json.loads(message.body)["account_id"]
        balances[account] = balances.get(account, Decimal(0)) + AMOUNT
    return balances, len(seen)


# -- one run -------------------------------------------------------------------------


class ServedProcess(WorkerProcess):
    """A consumer of this module (``--serve <kind>``), ``worker run`` from ``tree``, or
    ``worker run`` on uvloop (``kind`` "uvloop")."""

    def __init__(self, kind: str, env: dict[str, str], log_path: Path, tree: str = "") -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        command = [sys.executable, "-m", "benchmarks.throughput", "--serve", kind]
        if kind == "uvloop":
            command = [sys.executable, "-m", "benchmarks.uvloop_worker", "run"]
        if tree:
            command, env = [sys.executable, "-m", "worker.cli", "run"], {**env, "PYTHONPATH": tree}
        self.process = subprocess.Popen(
            command, env=env, cwd=tree or REPO, stdout=self._log, stderr=subprocess.STDOUT
        )


def consumer_env(
    row: Row, args: argparse.Namespace, rabbit: RabbitMQSettings, port: int, expect: int
) -> dict[str, str]:
    """The environment of one row's consumer process (``expect``: deliveries to drain)."""
    env = rabbit_env(
        rabbit,
        args.database_url,
        WORKER_HANDLERS=row.handlers,
        WORKER_CONCURRENCY=str(row.concurrency or args.concurrency),
        WORKER_DB_MAX_OVERFLOW="0",  # one process's connections stay within concurrency + 2
        WORKER_PURGE_INTERVAL="0",  # no inbox purge or claim sweep during the clock
        WORKER_OUTBOX_RELAY="false",
        WORKER_GRACE_PERIOD="10",
        WORKER_LOG_LEVEL="INFO",
        WORKER_OPS_PORT=str(port),
        WORKER_OPS_HOST="127.0.0.1",
        THROUGHPUT_VARIANT=row.variant,
        THROUGHPUT_EXPECT=str(expect),
    )
    if row.batch:
        env["WORKER_BATCH_SIZE"] = str(row.batch)
    return env


def spawn(row: Row, env: dict[str, str], path: Path) -> WorkerProcess:
    if row.uvloop:
        return ServedProcess("uvloop", env, path)
    if row.serve or row.tree:
        return ServedProcess(row.serve, env, path, row.tree)
    return WorkerProcess(env, path)


def _timestamp(line: dict[str, Any]) -> float:
    return datetime.fromisoformat(line["timestamp"]).timestamp()


def cpu_seconds(pid: int) -> float | None:
    """A process's user + system CPU time so far (None: it is gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


def _peak_rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


async def _settled(client: httpx.AsyncClient, port: int) -> int:
    """Acks + dead letters so far, from the worker's /metrics (-1: not answering yet)."""
    try:
        response = await client.get(f"http://127.0.0.1:{port}/metrics")
    except httpx.HTTPError:
        return -1
    total = 0
    for line in response.text.splitlines():
        if line.startswith("worker_settlements_total{") and (
            'verb="ack"' in line or 'verb="dead-letter"' in line
        ):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


@contextlib.asynccontextmanager
async def _ready_count(rabbit: RabbitMQSettings) -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """Messages in the work queue not handed to a consumer yet (a passive declare);
    -1 while the broker does not answer (another user of the server restarts it)."""
    connection = await patiently("watching the queue", lambda: aio_pika.connect(rabbit.url))
    try:
        channel = await connection.channel()

        async def count() -> int:
            try:
                queue = await channel.declare_queue(rabbit.queue, passive=True)
            except (OSError, AMQPError, ConnectionError, ChannelInvalidStateError):
                return -1
            return queue.declaration_result.message_count or 0

        yield count
    finally:
        with contextlib.suppress(OSError, AMQPError, ConnectionError):
            await connection.close()


async def _ready(client: httpx.AsyncClient, port: int) -> bool:
    try:
        return (await client.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200
    except httpx.HTTPError:
        return False


async def run_once(
    row: Row,
    duplicates: float,
    args: argparse.Namespace,
    db: AsyncEngine,
    vhost: str,
    logs: Path,
    n: int,
) -> Result:
    tag = f"tp{n}-{uuid.uuid4().hex[:6]}"
    rabbit = RabbitMQSettings(url=guest_url(vhost), queue=tag, exchange=f"{tag}.in")
    port = free_port()
    env = consumer_env(row, args, rabbit, port, args.messages)
    await prepare(db, args.accounts)
    batch = deliveries(args.messages, args.accounts, duplicates, tag, row.message_type)
    await patiently("queueing the messages", lambda: fill(rabbit, batch))
    result = Result()
    path = logs / f"{tag}.log"
    spawned = time.time()
    process = spawn(row, env, path)
    profiler = start_profiler(args, process, tag, row)
    try:
        ended = await drained(process, row, port, rabbit, args, result, spawned)
        result.rss_mb = _peak_rss_mb(process.process.pid)
        used = cpu_seconds(process.process.pid)
        if ended is not None and used is not None and result.cpu_at_start is not None:
            result.cpu_us = (used - result.cpu_at_start) / args.messages * 1e6
    finally:
        process.signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(process.wait, 30)
        except subprocess.TimeoutExpired:
            process.kill()
            result.problem = result.problem or "no exit after SIGTERM"
        if profiler is not None:
            await asyncio.to_thread(profiler.wait, 60)
    started = process.events("pump started")
    if ended is not None and started:
        result.rate = args.messages / (ended - _timestamp(started[0]))
    lines = process.log_lines()
    result.disturbed = any(line.get("event") in DISTURBANCES for line in lines)
    stopped = process.events("pump stopped")
    if stopped:
        result.stats = {k: v for k, v in stopped[-1].items() if isinstance(v, int)}
    dead = (await patiently("counting dead letters", lambda: all_depths(rabbit))).get(
        rabbit.dead_letter_queue, 0
    )
    await patiently("deleting the queues", lambda: cleanup(rabbit))
    result.exact, wrong = await check(db, batch, row.dedup, dead)
    if not row.writes:
        result.exact, wrong = True, ""
    if wrong and not result.problem and (row.dedup or duplicates == 0):
        result.problem = wrong
    return result


def start_profiler(
    args: argparse.Namespace, process: WorkerProcess, tag: str, row: Row
) -> subprocess.Popen[bytes] | None:
    """``--profile DIR``: py-spy attached to the consumer until it exits (raw stacks)."""
    if not args.profile:
        return None
    name = "".join(c if c.isalnum() else "-" for c in row.label).strip("-")[:60]
    out = Path(args.profile) / f"{name}-{tag}.txt"
    command = ["py-spy", "record", "--format", "raw", "--rate", "200", "-o", str(out)]
    command += ["--pid", str(process.process.pid)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def run_disturbed(
    row: Row,
    scenario: float,
    args: argparse.Namespace,
    db: AsyncEngine,
    vhost: str,
    logs: Path,
    n: int,
) -> Result:
    """:func:`run_once`, again (twice at most) when a shared server went away during it
    (the benchmark's own database connection too: the pool opens a new one)."""
    for attempt in range(3):
        try:
            result = await run_once(row, scenario, args, db, vhost, logs, n * 10 + attempt)
        except (
            OSError,
            AMQPError,
            ChannelInvalidStateError,  # a RuntimeError: the broker closed the channel
            ConnectionError,
            BrokerUnavailable,
            DBAPIError,
        ) as exc:
            result = Result(problem=f"disturbed: {type(exc).__name__}: {exc}"[:300])
        else:
            if not result.disturbed:
                return result
        print(f"    {row.label}: disturbed from outside, run again", flush=True)
        await asyncio.sleep(5)
    return result


async def drained(
    process: WorkerProcess,
    row: Row,
    port: int,
    rabbit: RabbitMQSettings,
    args: argparse.Namespace,
    result: Result,
    spawned: float,
) -> float | None:
    """When the consumer settled its last delivery (None: it did not, see the problem)."""
    deadline = time.monotonic() + args.timeout
    async with httpx.AsyncClient(timeout=2.0) as client, _ready_count(rabbit) as queued:
        while True:
            if process.process.poll() is not None:
                tail = process.log_path.read_text(errors="replace").strip().splitlines()[-3:]
                result.problem = f"exited early: {' | '.join(tail)[:400]}"
                return None
            if time.monotonic() > deadline:
                result.problem = f"not drained within {args.timeout:.0f}s"
                return None
            if result.cpu_at_start is None and process.logged("pump started"):
                result.cpu_at_start = cpu_seconds(process.process.pid)
            if row.serve:
                if process.logged("drained"):
                    return time.time()
            else:
                if result.ready is None and await _ready(client, port):
                    result.ready = time.time() - spawned
                # /metrics costs the worker CPU: scrape only once the queue has handed out
                # everything (what is left is at most the prefetch, a fraction of a second
                # of work); until then ask the broker
                ready = result.ready is not None and await queued() <= 0
                if ready and await _settled(client, port) >= args.messages:
                    return time.time()
            await asyncio.sleep(POLL)


async def check(
    db: AsyncEngine, batch: list[OutgoingMessage], dedup: bool, dead: int
) -> tuple[bool, str]:
    """Exact: every balance is 1.25 x its distinct credits, one marker per id (dedup)."""
    want, distinct = expected(batch, dedup=True)
    async with db.connect() as connection:
        rows = (await connection.execute(text("SELECT id, balance FROM accounts"))).all()
        markers = (await connection.execute(text("SELECT count(*) FROM inbox"))).scalar_one()
    found = {row[0]: Decimal(row[1]) for row in rows}
    wrong = sum(1 for a in set(want) | set(found) if found.get(a, 0) != want.get(a, 0))
    problems = []
    if wrong:
        problems.append(f"{wrong} balances wrong")
    if dedup and markers != distinct:
        problems.append(f"{markers} markers for {distinct} ids")
    if dead:
        problems.append(f"{dead} dead letters")
    return not problems, ", ".join(problems)


# -- the consumers that are not the worker (run with --serve) ------------------------


def _say(event: str, **extra: Any) -> None:
    now = datetime.now().astimezone().isoformat()
    print(json.dumps({"event": event, "timestamp": now, **extra}), flush=True)


async def serve_handwritten(dedup: bool) -> None:
    """benchmarks/rabbitmq_vs_handwritten.py's consumer; without the marker for no dedup."""
    import aio_pika
    import asyncpg  # type: ignore[import-untyped]

    from handlers.credit import CreditRequested
    from worker.brokers.rabbitmq import declare_topology
    from worker.settings import Settings

    rabbit, settings = RabbitMQSettings(), Settings()
    count, concurrency = int(os.environ["THROUGHPUT_EXPECT"]), settings.concurrency
    dsn = settings.database_url.replace("postgresql+asyncpg", "postgresql")
    pool = await asyncpg.create_pool(dsn, min_size=concurrency, max_size=concurrency + 2)
    connection = await aio_pika.connect_robust(rabbit.url)
    acked = 0
    done = asyncio.Event()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal acked
        body = CreditRequested.model_validate_json(message.body)
        async with pool.acquire() as db, db.transaction():
            if not dedup or await db.fetchval(MARK, message.message_id) is not None:
                await db.execute(CREDIT, body.account_id, body.amount)
        await message.ack()  # after the commit
        acked += 1
        if acked == count:
            done.set()

    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=concurrency)
        queue = await declare_topology(channel, rabbit)
        await queue.consume(on_message)
        _say("pump started")
        await done.wait()
        _say("drained", acked=acked)
        await asyncio.Event().wait()  # until SIGTERM
    finally:
        await connection.close()
        await pool.close()


async def serve_ceiling(multiple: int) -> None:
    """The transport's ceiling: aio-pika consuming the same queue, no database, no decode;
    each delivery acked (``multiple`` 1), or one ``basic.ack(multiple=True)`` for every
    ``multiple`` deliveries, with the prefetch the worker asks for with groups of that
    size (worker.pump.Pump.prefetch: at least two full groups)."""
    import aio_pika

    from worker.brokers.rabbitmq import declare_topology
    from worker.settings import Settings

    rabbit, settings = RabbitMQSettings(), Settings()
    count, concurrency = int(os.environ["THROUGHPUT_EXPECT"]), settings.concurrency
    prefetch = concurrency if multiple == 1 else max(concurrency, 2 * multiple)
    connection = await aio_pika.connect_robust(rabbit.url)
    acked = 0
    done = asyncio.Event()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal acked
        acked += 1
        if multiple == 1:
            await message.ack()
        elif acked % multiple == 0 or acked == count:
            await message.ack(multiple=True)
        if acked == count:
            done.set()

    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        queue = await declare_topology(channel, rabbit)
        await queue.consume(on_message)
        _say("pump started")
        await done.wait()
        _say("drained", acked=acked)
        await asyncio.Event().wait()  # until SIGTERM
    finally:
        await connection.close()


async def serve_faststream() -> None:
    """FastStream's RabbitMQ subscriber; the handler reads, adds and commits with the ORM."""
    from faststream import AckPolicy
    from faststream.rabbit import Channel, RabbitBroker, RabbitQueue
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from handlers.credit import Account, CreditRequested
    from worker.settings import Settings

    rabbit, settings = RabbitMQSettings(), Settings()
    count, concurrency = int(os.environ["THROUGHPUT_EXPECT"]), settings.concurrency
    engine = create_async_engine(settings.database_url, pool_size=concurrency + 2, max_overflow=0)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    broker = RabbitBroker(
        rabbit.url, default_channel=Channel(prefetch_count=concurrency), log_level=30
    )
    done = asyncio.Event()
    acked = 0

    # a version conflict raises StaleDataError: nacked and redelivered (not lost)
    @broker.subscriber(RabbitQueue(rabbit.queue, declare=False), ack_policy=AckPolicy.NACK_ON_ERROR)
    async def on_credit(body: CreditRequested) -> None:
        nonlocal acked
        async with sessions() as session, session.begin():
            account = await session.get(Account, body.account_id)
            assert account is not None  # the benchmark creates every account first
            account.balance += body.amount
        acked += 1
        if acked == count:
            done.set()

    await broker.start()
    try:
        _say("pump started")
        await done.wait()
        _say("drained", acked=acked)
        await asyncio.Event().wait()  # until SIGTERM
    finally:
        await broker.stop()
        await engine.dispose()


def serve(kind: str) -> None:
    async def main() -> None:
        if kind == "faststream":
            task = asyncio.create_task(serve_faststream())
        elif kind.startswith("ceiling"):
            task = asyncio.create_task(serve_ceiling(32 if kind == "ceiling-multiple" else 1))
        else:
            task = asyncio.create_task(serve_handwritten(dedup=kind == "handwritten"))
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        _say("pump stopped")

    asyncio.run(main())


# -- the report ----------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def report(results: dict[Row, dict[float, list[Result]]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.messages} CreditRequested deliveries over {args.accounts} accounts, "
        f"RabbitMQ + PostgreSQL on loopback, 1 consumer process at concurrency "
        f"{args.concurrency}; median of {args.runs} runs, rows alternating\n"
    )
    base = {d: _median([r.rate for r in results[BASELINE][d] if not r.problem]) for d in SCENARIOS}
    header = (
        "consumer",
        "msg/s",
        "vs inbox",
        "balances",
        "msg/s 30% dup",
        "vs inbox",
        "balances",
        "CPU µs/msg",
        "RSS MB",
        "ready s",
    )
    widths = (max([50, *(len(row.label) for row in results)]), 7, 8, 8, 13, 8, 8, 10, 6, 7)
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in results:
        cells = [row.label]
        everything: list[Result] = []
        for scenario in SCENARIOS:
            runs = results[row].get(scenario, [])
            everything += runs
            if scenario not in row.scenarios or not runs:
                cells += ["", "", ""]
                continue
            rate = _median([r.rate for r in runs if r.rate and not r.problem])
            baseline = base[scenario]
            cells.append(f"{rate:.0f}" if rate else "failed")
            cells.append(f"{rate / baseline:.2f}x" if rate and baseline else "-")
            exact = "exact" if runs and all(r.exact for r in runs) else "wrong"
            cells.append(exact if row.writes else "-")
        rss = _median([r.rss_mb for r in everything if r.rss_mb is not None and not row.serve])
        ready = _median([r.ready for r in everything if r.ready is not None])
        cpu = _median([r.cpu_us for r in runs_without_duplicates(results[row])])
        cells.append(f"{cpu:.0f}" if cpu else "-")
        cells.append(f"{rss:.0f}" if rss else "-")
        cells.append(f"{ready:.2f}" if ready else "-")
        print("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |")
    print(
        "\nCPU: the consumer process's CPU time per delivery from its start of consuming to"
        " its last settlement (no duplicates); RSS: the worker process's peak (VmHWM);"
        " ready: spawn to /readyz 200."
    )
    targets(results)
    problems = [
        f"  {row.label} ({scenario:.0%} dup): {r.problem}"
        for row, by in results.items()
        for scenario, runs in by.items()
        for r in runs
        if r.problem
    ]
    if problems:
        print("problems:\n" + "\n".join(problems))


def runs_without_duplicates(by: dict[float, list[Result]]) -> list[Result]:
    return [r for r in by.get(0.0, []) if r.cpu_us is not None and not r.problem]


def _rate(results: dict[Row, dict[float, list[Result]]], row: Row) -> float | None:
    return _median([r.rate for r in results[row].get(0.0, []) if r.rate and not r.problem])


def targets(results: dict[Row, dict[float, list[Result]]]) -> None:
    """Issue 24's targets, met or missed, from this run (no duplicates)."""
    rate = {row: _rate(results, row) for row in (BASELINE, CEILING, CEILING_MULTIPLE,
            FASTSTREAM, SHIPPED, SHIPPED_DEFAULT, SET_BASED)}  # fmt: skip
    ceiling = max((r for r in (rate[CEILING], rate[CEILING_MULTIPLE]) if r), default=None)
    checks = [
        (
            "shipped keyed ORM handler, default settings / hand-written inbox",
            SHIPPED_DEFAULT,
            BASELINE,
            1.0,
        ),
        (
            "set-based batch handler, default settings / consume-and-ack ceiling",
            SET_BASED,
            None,
            0.5,
        ),
        ("shipped handler, WORKER_BATCH_SIZE=1 / hand-written inbox", SHIPPED, BASELINE, 0.5),
        ("shipped handler, WORKER_BATCH_SIZE=1 / FastStream", SHIPPED, FASTSTREAM, 1.5),
    ]
    print("\ntargets (no duplicates):")
    for label, row, base, wanted in checks:
        numerator, denominator = rate[row], rate[base] if base is not None else ceiling
        if not numerator or not denominator:
            print(f"  {label}: not measured in this run")
            continue
        ratio = numerator / denominator
        verdict = "met" if ratio >= wanted else "missed"
        print(f"  {label}: {ratio:.2f}x (target >= {wanted}x): {verdict}")


# -- main ----------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> int:
    name = f"throughput_{uuid.uuid4().hex[:8]}"
    args.database_url = args.postgres.rsplit("/", 1)[0] + f"/{name}"
    every = [*ROWS, *tree_rows(args.tree)]
    rows = [r for r in every if not args.only or any(o in r.label for o in args.only.split("|"))]
    if BASELINE not in rows:
        rows.insert(0, BASELINE)
    results: dict[Row, dict[float, list[Result]]] = {row: {} for row in every}
    logs = Path(tempfile.mkdtemp(prefix="throughput_"))
    await admin_sql(args.postgres, f'CREATE DATABASE "{name}"')
    failed = False
    try:
        await asyncio.to_thread(migrate_with_the_example, args.database_url)
        db = create_engine(args.database_url, pool_size=1, max_overflow=0)
        try:
            async with throwaway_vhost("throughput") as vhost:
                n = 0
                for run in range(args.runs):
                    for scenario in SCENARIOS:
                        for row in rows:
                            if scenario not in row.scenarios:
                                continue
                            n += 1
                            result = await run_disturbed(row, scenario, args, db, vhost, logs, n)
                            results[row].setdefault(scenario, []).append(result)
                            failed = failed or bool(result.problem)
                            print(
                                f"[{run + 1}/{args.runs}] {scenario:.0%} dup  {row.label}: "
                                f"{result.rate:.0f} msg/s, ready {result.ready}, "
                                f"rss {result.rss_mb}, {result.stats} {result.problem}",
                                flush=True,
                            )
        finally:
            await db.dispose()
    finally:
        await admin_sql(args.postgres, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    report(results, args)
    if failed:
        print(f"\nconsumer logs: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    return 1 if failed else 0


def tree_rows(trees: list[str]) -> list[Row]:
    """The shipped handler's rows and the set-based row again, each from a ``NAME=PATH``
    checkout (before/after in one run). Their group size is set outright (32 for the
    default rows): an older checkout may have another default."""
    extra = []
    for spec in trees:
        name, _, path = spec.partition("=")
        for row in (SHIPPED, SHIPPED_DEFAULT, SET_BASED):
            label = f"{row.label} [{name}]"
            extra.append(replace(row, label=label, tree=path, batch=row.batch or 32))
    return extra


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take")
    parser.add_argument("--quick", action="store_true", help="1,000 deliveries, one run")
    parser.add_argument("--only", default="", help="rows whose label contains one of these (|)")
    parser.add_argument(
        "--postgres", default="postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also run the shipped-handler and set-based worker rows from this checkout",
    )
    parser.add_argument(
        "--profile", default="", metavar="DIR", help="py-spy each consumer, raw stacks in DIR"
    )
    parser.add_argument("--serve", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.messages, args.runs = 1000, 1
    return args


if __name__ == "__main__":
    options = parse()
    if options.serve:
        serve(options.serve)
    else:
        sys.exit(asyncio.run(main(options)))
