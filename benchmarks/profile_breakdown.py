"""Where a message's CPU goes: a py-spy raw profile summed into the pump's stages.

    py-spy record --format raw -o prof.txt --rate 200 -- \\
        python -m benchmarks.pump_path --only "(groups up to 32), reference" --rounds 1
    python -m benchmarks.profile_breakdown prof.txt [--us-per-message 955]

Each sample is charged to the deepest frame of its stack that one of the rules below
names (a handler's SQLAlchemy call inside the handler is the handler's; the pump's
marker statement is the marker's). SQLAlchemy runs its synchronous half in greenlets,
whose stacks py-spy shows from the greenlet's own first frame: those are charged by
that frame (``Session.get``: the handler's read; the ``SessionTransaction.commit``
wrapper: a savepoint's release with its flush; ``_GuardedSession.commit``: the
transaction's commit, a group's included). Samples of the benchmark's own set-up
(publishing, migrations, truncating) are left out. With ``--us-per-message`` the shares
are also printed as microseconds of CPU per message.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

SETUP = re.compile(
    r"^(main|reset|pump_run|asyncpg_run) \(.*benchmarks/|MemoryBroker.publish|worker/migrate.py"
    r"|\(env.py|alembic/|admin_sql|Engine.dispose|<frozen runpy>:189"
    r"|<frozen importlib._bootstrap>"
)
"""Frames of the benchmark's set-up or the process's start (imports), not of the pump:
the whole sample is left out."""

IDLE = re.compile(
    r"\(selectors.py:|Condition.wait |Event.wait |socket.accept |^_worker \(concurrent"
)
"""A stack ending in a wait: a thread sampled while it was blocked, not using the CPU."""

GREENLET_ROOTS: list[tuple[str, str]] = [
    ("Session.get ", "handler: ORM read (session.get)"),
    ("SessionTransaction.commit>", "savepoint: flush of the handler's UPDATE + RELEASE"),
    ("_GuardedSession.commit", "commit (final flush + COMMIT)"),
    ("Session.flush", "commit (final flush + COMMIT)"),
    ("(worker/inbox.py", "inbox marker statement"),
    ("(worker/attempts.py", "delivery counts (autocommitted)"),
    ("AsyncSession.begin_nested", "savepoint: SAVEPOINT"),
    ("Session.execute ", "session.execute (the handler's statements, the batch's locks)"),
    ("Engine.connect ", "new pooled connections (once per connection, not per message)"),
    ("Session.begin_nested", "savepoint: SAVEPOINT"),
]
"""A greenlet's first frame -> what it does."""

OWNERS: list[tuple[str, str]] = [
    ("handlers/", "handler (its own Python and its awaits)"),
    ("throughput_handlers.py", "handler (its own Python and its awaits)"),
    ("worker/transaction.py", "transaction runner (groups: locks, savepoints, verdicts)"),
    ("worker/claim_runner.py", "claim runner (side-effect handlers)"),
    ("worker/inbox.py", "inbox marker statement"),
    ("worker/attempts.py", "delivery counts (autocommitted)"),
    ("worker/intake.py", "intake (lanes, buckets)"),
    ("model_validate_json", "decode (pydantic, once per delivery)"),
    ("worker/settle.py", "settlement (verdicts -> verbs)"),
    ("worker/delivery.py", "settlement (verdicts -> verbs)"),
    ("worker/middleware.py", "middleware (timing, metrics)"),
    ("worker/metrics.py", "middleware (timing, metrics)"),
    ("worker/judge.py", "judge (outcome tallies, logs)"),
    ("worker/verdict.py", "judge (outcome tallies, logs)"),
    ("worker/logs.py", "logging"),
    ("structlog/", "logging"),
    ("worker/brokers/", "broker adapter"),
    ("aio_pika/", "AMQP client (aio-pika, aiormq, pamqp)"),
    ("aiormq/", "AMQP client (aio-pika, aiormq, pamqp)"),
    ("pamqp/", "AMQP client (aio-pika, aiormq, pamqp)"),
    ("aiokafka/", "Kafka client (aiokafka)"),
    ("worker/db.py", "session set-up and clean-up"),
    ("worker/pump.py", "pump loop (a unit's start, its runners in order)"),
    ("Thread._bootstrap", "ops endpoint thread (probes, metrics)"),
]
"""A frame naming one of these -> the stage it is part of (the deepest such frame wins)."""


def categorize(frames: list[str]) -> str | None:
    """The stage a sample belongs to; None for the benchmark's own set-up."""
    if not frames or IDLE.search(frames[-1]) or any(SETUP.search(frame) for frame in frames):
        return None  # the set-up, waiting, or a sample py-spy could not read
    root = frames[0]
    for pattern, label in GREENLET_ROOTS:
        if pattern in root:
            return label
    owner = None
    for frame in frames:
        for pattern, label in OWNERS:
            if pattern in frame:
                owner = label
                break
    if owner is not None:
        return owner
    if any("asyncpg/" in frame for frame in frames):
        return "asyncpg protocol (replies, outside any stage)"
    if any("sqlalchemy/" in frame for frame in frames):
        return "SQLAlchemy, outside any stage"
    if any("asyncio/" in frame or "selectors.py" in frame for frame in frames):
        return "event loop"
    return "other"


def breakdown(path: Path) -> Counter[str]:
    shares: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        label = categorize(stack.split(";") if stack else [])
        if label is not None:
            shares[label] += int(count)
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile", type=Path, nargs="+", help="py-spy --format raw output")
    parser.add_argument("--us-per-message", type=float, nargs="*", default=[])
    args = parser.parse_args()
    tables = [breakdown(path) for path in args.profile]
    labels = sorted({label for table in tables for label in table}, key=lambda x: -tables[0][x])
    header = "| stage | " + " | ".join(p.stem for p in args.profile) + " |"
    print(header)
    print("|---|" + "---|" * len(tables))
    for label in labels:
        cells = []
        for n, table in enumerate(tables):
            total = sum(table.values()) or 1
            share = table[label] / total
            cell = f"{share:.0%}"
            if n < len(args.us_per_message):
                cell += f" ({share * args.us_per_message[n]:.0f} µs)"
            cells.append(cell)
        print(f"| {label} | " + " | ".join(cells) + " |")
    totals = " | ".join(str(sum(t.values())) for t in tables)
    print(f"| samples | {totals} |")


if __name__ == "__main__":
    main()
