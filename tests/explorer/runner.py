"""One schedule, run: warm up, play the workload under its faults, rest, measure, check.

1. The pumps start on an empty database; a few plain messages warm them up, and each
   pump's footprint at rest is measured.
2. The workload is published at once (in its order, so a replay hands out the same
   deliveries) and the faults are armed. The run waits, bounded by the schedule's
   deadline, until the broker holds nothing unsettled and nothing waiting to come back.
3. The faults are disarmed and the database healed; each pump at rest is measured again,
   then after a tail of plain messages, then after a second, equal tail.
4. The pumps stop (bounded), and the invariants are checked against the journal, the
   database's rows and the pumps' stats.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.explorer.faults import Injector, Outages, Paths
from tests.explorer.fleet import Fleet
from tests.explorer.footprint import footprint
from tests.explorer.invariants import Observed, Violation, check
from tests.explorer.recording import Journal
from tests.explorer.schedule import KEYS, Message, Schedule
from tests.explorer.workload import Plans, publish_args
from tests.support.layout import layout_of
from worker.brokers.memory import MemoryBroker
from worker.settings import Settings

WARM_UP = 8
TAIL = 45
"""Plain messages per pump in each of the two tails that measure growth at rest."""
REST_WITHIN = 30.0


@dataclass
class Report:
    schedule: Schedule
    violations: list[Violation]
    seconds: float
    fired: list[str]
    footprints: dict[str, list[int]]


def settings_for(schedule: Schedule, url: str) -> Settings:
    """The pumps' settings: the schedule's limits, short timers (a schedule takes seconds)."""
    return Settings(
        database_url=url,
        inbox_layout=layout_of(url),
        concurrency=schedule.concurrency,
        batch_size=schedule.batch_size,
        max_deliveries=schedule.max_deliveries,
        max_give_backs=schedule.max_give_backs,
        retry_backoff=0.005,
        retry_backoff_max=0.05,
        retry_budget=0.5,
        handler_timeout=2.0,
        marker_lock_timeout=0.3,
        grace_period=0.3,
        db_probe_backoff_max=0.2,
        purge_interval=0,
    )


async def run(schedule: Schedule, url: str, direct: AsyncEngine) -> Report:
    """Run ``schedule`` against the empty database at ``url`` (each pump through a proxy of
    its own on PostgreSQL); ``direct`` reads the results without the faults."""
    started = time.monotonic()
    journal = Journal()
    broker = MemoryBroker()
    outages = Outages()
    injector = Injector(schedule, outages)
    plans = Plans(schedule, journal, outages)
    settings = settings_for(schedule, url)
    paths = Paths(url, schedule.concurrency + 2, injector, outages)
    fleet = Fleet(broker, journal, plans, settings, paths, schedule.audit)
    deaths = {death.after: death.pump for death in schedule.deaths}

    def on_settled(settlements: int) -> None:
        slot = deaths.pop(settlements, None) if plans.acting else None
        if slot is not None:
            fleet.kill(slot)

    journal.on_settled = on_settled
    footprints: dict[str, list[int]] = {}
    extra: list[Message] = []
    settled_in_time, unsettled = True, []
    try:
        for slot in range(schedule.pumps):
            await fleet.start(slot)
        extra += await _plain(broker, "w", WARM_UP)
        await broker.wait_idle(REST_WITHIN)
        _measure(fleet, footprints)

        plans.acting = injector.active = True
        for n, message in enumerate(schedule.messages):
            broker.publish(
                message.id,
                message.type,
                copies=message.copies,
                to_all=message.to_all,
                delivered_before=message.delivered_before,
                **publish_args(message, n),
            )
        try:
            await broker.wait_idle(schedule.deadline)
            await fleet.settled()
        except TimeoutError:
            settled_in_time = False
            unsettled = _unsettled(journal, broker)
        plans.acting = injector.active = False
        await outages.end()

        if settled_in_time:
            _measure(fleet, footprints)
            for tail in ("t", "u"):
                extra += await _plain(broker, tail, TAIL * schedule.pumps)
                await broker.wait_idle(REST_WITHIN)
                _measure(fleet, footprints)
    finally:
        plans.acting = injector.active = False
        await outages.end()
        await fleet.stop()
        await paths.close()
    seen = Observed(
        journal=journal,
        broker=broker,
        settled_in_time=settled_in_time,
        unsettled=unsettled,
        effects=await _count(direct, "explorer_effects"),
        markers=await _count(direct, "inbox"),
        extra=extra,
        pump_stats={m.label: m.pump.stats for m in fleet.all()},
        footprints={k: v for k, v in footprints.items() if len(v) >= 2},
        problems=fleet.problems,
        cancels=sum(1 for fired in injector.fired if fired.endswith("cancel")),
    )
    return Report(
        schedule, check(schedule, seen), time.monotonic() - started, injector.fired, footprints
    )


async def _plain(broker: MemoryBroker, prefix: str, count: int) -> list[Message]:
    """``count`` plain messages of both types and every key: what a quiet hour brings."""
    messages = []
    for n in range(count):
        if n % 3 == 2:
            message = Message(f"{prefix}{n:03d}", "Bulk")
        else:
            message = Message(f"{prefix}{n:03d}", "Op", key=KEYS[n % len(KEYS)])
        broker.publish(message.id, message.type, **publish_args(message, n))
        messages.append(message)
    return messages


def _measure(fleet: Fleet, footprints: dict[str, list[int]]) -> None:
    for member in fleet.members.values():
        footprints.setdefault(member.label, []).append(footprint(member.pump, member.given()))


def _unsettled(journal: Journal, broker: MemoryBroker) -> list[str]:
    """The ids not settled for good (their last delivery unsettled, given back, or waiting
    in the broker), each with where its deliveries went."""
    last = {a.message_id: a for a in journal.arrivals}
    open_ids = {str(mid) for mid, a in last.items() if not {"ack", "dead-letter"} & set(a.settled)}
    open_ids.update(str(m.message_id) for m in broker.ready)
    return [f"{mid} ({_history(journal, mid)})" for mid in sorted(open_ids)]


def _history(journal: Journal, message_id: str) -> str:
    steps = []
    for a in journal.arrivals:
        if a.message_id == message_id:
            fate = "/".join(a.settled) or ("returned" if a.returned else "unsettled")
            steps.append(f"#{a.seq}@{a.pump}:{fate}")
    return " ".join(steps) or "never delivered"


async def _count(engine: AsyncEngine, table: str) -> Counter[tuple[str, str]]:
    columns = (text("message_id"), text("consumer"))
    query = select(*columns, func.count()).select_from(text(table)).group_by(*columns)
    async with engine.connect() as connection:
        rows = await connection.execute(query)
        return Counter({(row[0], row[1]): int(row[2]) for row in rows})
