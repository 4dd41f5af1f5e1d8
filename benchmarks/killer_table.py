"""A message that kills the process, among valid ones: who ends in the dead-letter queue.

    python -m benchmarks.killer_table [--valid 399] [--max-deliveries 5] [--only NAME] [--quiet 8]

One ``worker run`` (RabbitMQ quorum queue, PostgreSQL, ``WORKER_CONCURRENCY=16``),
restarted each time it dies as a cluster would restart it, over ``--valid`` credits and
one whose handler ends the process at once (``os._exit(137)``: an out-of-memory kill, a
segfault, an eviction). Four rows: ``WORKER_BATCH_SIZE=1`` (no groups) and the worker's
default settings (group commit, groups up to 32), each with the delivery counts of the
broker (which counts every return of everything a dead process held) and of the database
(the default: attempts that started). A run ends after ``--quiet`` seconds with nothing
applied and nothing left in the queues. The table is the one of the issue that asked for
suspects to run alone, re-measured on this code.

Needs RabbitMQ (``rabbitmqctl`` for a throwaway vhost) and PostgreSQL (a throwaway
database); both are removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.hot_rows import throwaway_vhost
from benchmarks.rabbitmq_vs_handwritten import admin_sql
from tests.rabbitmq.rabbit_helpers import publish, rabbit_env, take_dead_letters, unsettled
from tests.support.credits import credit
from tests.support.database import scalar
from tests.support.migrations import migrate_with_the_example
from tests.support.processes import Fleet
from tests.support.rabbitmq import guest_url
from worker.brokers.rabbitmq import RabbitMQSettings

ADMIN = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
APPLIED = "SELECT count(*) FROM inbox WHERE message_id LIKE 'ok-%'"
QUIET = 8.0
"""Seconds with nothing applied and nothing in the queues that end a run (RabbitMQ's queue
statistics lag by up to 5 s): the default of ``--quiet``."""


@dataclass(frozen=True)
class Mode:
    name: str
    batch_size: int  # WORKER_BATCH_SIZE; 0: the default (groups up to 32)
    counts: str


MODES = (
    Mode("WORKER_BATCH_SIZE=1 (no groups), counts=broker", 1, "broker"),
    Mode("WORKER_BATCH_SIZE=1 (no groups), counts=database", 1, "database"),
    Mode("default settings (groups up to 32), counts=broker", 0, "broker"),
    Mode("default settings (groups up to 32), counts=database", 0, "database"),
)
WIDTH = max(len(mode.name) for mode in MODES)


@dataclass
class Outcome:
    deaths: int
    applied: int
    dead_letters: int
    valid_dead_lettered: int
    seconds: float


async def run(
    mode: Mode, vhost: str, valid: int, max_deliveries: int, quiet: float = QUIET
) -> Outcome:
    database = f"bench_killer_{uuid.uuid4().hex[:8]}"
    await admin_sql(ADMIN, f'CREATE DATABASE "{database}"')
    url = ADMIN.rsplit("/", 1)[0] + f"/{database}"
    queue = f"killer_{uuid.uuid4().hex[:8]}"
    rabbit = RabbitMQSettings(
        url=guest_url(vhost), queue=queue, exchange=queue, retry_delays=[0.2, 1.0]
    )
    try:
        await asyncio.to_thread(migrate_with_the_example, url)
        with tempfile.TemporaryDirectory() as folder:
            deaths_file = Path(folder) / "deaths"
            env = rabbit_env(
                rabbit, url, WORKER_HANDLERS="tests.support.killer_handlers",
                WORKER_CONCURRENCY="16", WORKER_MAX_DELIVERIES=str(max_deliveries),
                WORKER_DELIVERY_COUNTS=mode.counts, WORKER_GRACE_PERIOD="5",
                WORKER_LOG_LEVEL="WARNING", WORKER_TEST_KILLERS="killer",
                WORKER_TEST_DEATHS=str(deaths_file),
            )  # fmt: skip
            if mode.batch_size:
                env["WORKER_BATCH_SIZE"] = str(mode.batch_size)
            stream = [
                credit(f"ok-{n:03d}", f"acct-{n % 10}", "1.00", "Credit") for n in range(valid)
            ]
            stream.insert(valid // 2, credit("killer", "x", "1", "Credit"))
            await publish(rabbit, stream)
            fleet = Fleet(env, Path(folder))
            started = time.monotonic()
            try:
                fleet.start("w")
                deadline = started + 600
                quiet_since, last = time.monotonic(), -1
                while time.monotonic() < deadline:
                    if fleet.live["w"].process.poll() is not None:
                        fleet.restart_exited()
                    applied = await scalar(url, APPLIED)
                    if applied != last or unsettled(vhost, rabbit):
                        quiet_since, last = time.monotonic(), applied
                    elif time.monotonic() - quiet_since > quiet:
                        break  # nothing left, and the broker's queue stats agree
                    await asyncio.sleep(0.5)
                await fleet.stop()
            finally:
                fleet.kill_all()
            seconds = time.monotonic() - started
            deaths = len(deaths_file.read_text().splitlines()) if deaths_file.exists() else 0
        applied = await scalar(url, APPLIED)
        letters = await take_dead_letters(rabbit)
        dead = Counter(str(letter.message_id) for letter in letters)
        return Outcome(
            deaths=deaths,
            applied=int(applied),
            dead_letters=sum(dead.values()),
            valid_dead_lettered=sum(n for mid, n in dead.items() if mid != "killer"),
            seconds=seconds,
        )
    finally:
        await admin_sql(ADMIN, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


async def main(valid: int, max_deliveries: int, only: str | None, quiet: float = QUIET) -> int:
    modes = [m for m in MODES if only is None or only in m.name]
    results: list[tuple[Mode, Outcome]] = []
    async with throwaway_vhost("bench_killer") as vhost:
        for mode in modes:
            results.append((mode, await run(mode, vhost, valid, max_deliveries, quiet)))
    print(f"\npython -m benchmarks.killer_table --valid {valid} --max-deliveries {max_deliveries}")
    widths = (-WIDTH, 6, 14, 12, 19, 5)
    header = ("mode", "deaths", "valid applied", "dead letters", "valid dead-lettered", "s")
    print(
        " ".join(
            f"{h:<{-w}}" if w < 0 else f"{h:>{w}}" for h, w in zip(header, widths, strict=True)
        )
    )
    for mode, out in results:
        print(
            f"{mode.name:<{WIDTH}} {out.deaths:>6} {f'{out.applied} of {valid}':>14} "
            f"{out.dead_letters:>12} {out.valid_dead_lettered:>19} {out.seconds:>5.0f}"
        )
    # every credit applied or dead-lettered (never both), and the killer dead-lettered
    unsettled = [
        mode.name
        for mode, out in results
        if out.applied + out.valid_dead_lettered != valid
        or out.dead_letters - out.valid_dead_lettered != 1
    ]
    if unsettled:
        print(
            "not every message was applied or dead-lettered when the run ended (a worker that"
            f" could not start, or a longer --quiet needed): {', '.join(unsettled)}"
        )
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--valid", type=int, default=399)
    parser.add_argument("--max-deliveries", type=int, default=5)
    parser.add_argument("--only", help="run the modes whose name contains this")
    parser.add_argument(
        "--quiet", type=float, default=QUIET, help="seconds with nothing happening that end a run"
    )
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.valid, args.max_deliveries, args.only, args.quiet)))
