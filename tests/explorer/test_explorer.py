"""The fault-schedule explorer (docs/explorer.md): seeded schedules of faults against the real
pump, on SQLite and PostgreSQL, each checked against the invariants.

- ``test_schedule``: the default suite's schedules, a fixed list of seeds (the ones that
  found a defect, and a few of each kind), each a few seconds when the pump is right;
- ``WORKER_EXPLORE=N``: N more schedules (``test_exploration``: ``-k exploration``), from seed
  ``WORKER_EXPLORE_FROM`` (default: a random one, printed), optionally only on
  ``WORKER_EXPLORE_DB=sqlite`` or ``postgresql``;
- ``WORKER_EXPLORE_SEED=S``: replay one schedule (``test_replay``).
"""

from __future__ import annotations

import os
import random
import time

import pytest

from tests.explorer.explore import explore, replay_command, verdict
from tests.explorer.schedule import generate

SEEDS: dict[int, str] = {
    # found on the code before issue 31's fixes, by `WORKER_EXPLORE=60 WORKER_EXPLORE_FROM=0`
    # and by replaying the generator's schedules that hold a given fault (docs/explorer.md,
    # "What it found"); each is its defect's regression test now
    20: "SQLite, 2 pumps, batch: memory at rest grows by one entry per message (defect 11)",
    5: "PostgreSQL, 2 pumps, batch: memory at rest grows per message (defect 11)",
    24: "PostgreSQL: a redelivery's handler meets a refused database; the count not refunded "
    "while it is down dead-letters it (defect 1)",
    4: "SQLite, 2 pumps: handlers raising CancelledError and a BaseException (defect 5)",
    47: "PostgreSQL: a handler raising CancelledError / a BaseException (defect 5)",
    197: "SQLite, groups: a statement raises CancelledError outside any handler (defect 5's "
    "class beyond the handler: its deliveries never settle); groups overtaken in per-message "
    "mode (defect 8's mechanism)",
    529: "SQLite: one write larger than the room left (SQLITE_FULL), every time (defect 6)",
    63: "PostgreSQL: one query over temp_file_limit (53400), every time (defect 6)",
    371: "PostgreSQL: a row-level security refusal (42501), every time (defect 6)",
    51: "SQLite, batch: redeliveries of a key overtake its first deliveries (defect 9)",
    16: "PostgreSQL, batch, groups: a group's deliveries overtake one parked behind a key "
    "(defect 8)",
    2374: "PostgreSQL: black holes longer than the handler timeout are counted as the "
    "message's failures: a valid message dead-lettered with HandlerTimeout (defect 2)",
}
"""The default suite's schedules: seed -> what it found or covers."""


@pytest.mark.parametrize("seed", sorted(SEEDS), ids=lambda s: f"{s}-{generate(s).database}")
def test_schedule(seed: int, request: pytest.FixtureRequest) -> None:
    report = explore(seed, request)
    if report.violations:
        pytest.fail(verdict(report), pytrace=False)


def test_replay(request: pytest.FixtureRequest) -> None:
    seed = os.environ.get("WORKER_EXPLORE_SEED")
    if seed is None:
        pytest.skip("WORKER_EXPLORE_SEED=<seed> replays one schedule")
    report = explore(int(seed), request, quiet=False)
    print(generate(int(seed)).describe())
    if report.violations:
        pytest.fail(verdict(report), pytrace=False)


@pytest.mark.timeout(24 * 3600)  # each schedule is bounded by its own deadline
def test_exploration(request: pytest.FixtureRequest) -> None:
    count = int(os.environ.get("WORKER_EXPLORE", "0"))
    if count <= 0:
        pytest.skip("WORKER_EXPLORE=<n> explores n more schedules")
    first = int(os.environ.get("WORKER_EXPLORE_FROM", random.randrange(1_000_000)))
    only = os.environ.get("WORKER_EXPLORE_DB")
    print(f"exploring {count} schedules from seed {first}")
    failed: list[str] = []
    seed, ran, started = first, 0, time.monotonic()
    while ran < count:
        schedule = generate(seed)
        seed += 1
        if only and schedule.database != only:
            continue
        ran += 1
        report = explore(schedule.seed, request)
        outcome = "FAIL" if report.violations else "ok"
        print(f"  {schedule.seed} {schedule.database} {report.seconds:5.1f}s {outcome}", flush=True)
        for violation in report.violations[:3]:
            print(f"      {violation}", flush=True)
        if report.violations:
            failed.append(verdict(report))
    print(f"{ran} schedules in {time.monotonic() - started:.0f}s, {len(failed)} failed")
    if failed:
        pytest.fail(
            f"{len(failed)} of {ran} schedules failed:\n\n" + "\n\n".join(failed), pytrace=False
        )


def test_a_seed_is_a_schedule() -> None:
    """The replay promise: a seed always yields the same schedule, and seeds differ."""
    assert generate(7) == generate(7)
    assert generate(7) != generate(8)
    assert "python -m pytest tests/explorer -k replay" in replay_command(7)
