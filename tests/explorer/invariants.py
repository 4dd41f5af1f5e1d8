"""The invariants every schedule is checked against (docs/explorer.md lists them).

Each check reads only what the run observed from outside the pump: the broker's journal
(tests/explorer/recording.py), the database's rows, the pumps' public ``stats`` and their
footprints (tests/explorer/footprint.py). A check returns violations, each naming its
invariant, so a failing schedule says which promise it broke and for which message.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.explorer.recording import Journal, Start
from tests.explorer.schedule import Message, Schedule
from tests.explorer.workload import consumers
from worker.brokers.memory import MemoryBroker

APPLIED_ONCE = "applied exactly once"
DEAD_LETTERS = "nothing valid dead-lettered before its own failures reach the limit"
COUNTED = "a delivery count spent only by the message's own failure"
SETTLED_ONCE = "every delivery settled exactly once"
BOUNDED = "no give-back unbounded"
ORDER = "order kept per key and per group"
FOOTPRINT = "per-message structures back to their idle size"

FOOTPRINT_SLACK = 12
"""Entries a pump at rest may gain between two equal tails of messages (tests/explorer/
runner.py ``TAIL`` each, 45 per pump): a tally name or two met for the first time (a key
that happened to be busy, a consumer's first commit), never one per message."""
WORKLOAD_SLACK = 48
"""Entries a pump at rest may gain over a whole faulty workload: new tally names (one per
kind of outcome met), never one per message (that is what the tails measure)."""


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.detail}"


@dataclass
class Observed:
    """What one run of a schedule left behind."""

    journal: Journal
    broker: MemoryBroker
    settled_in_time: bool
    unsettled: list[str]
    effects: Counter[tuple[str, str]]  # (message id, consumer) -> rows
    markers: Counter[tuple[str, str]]  # (message id, consumer) -> inbox markers
    extra: list[Message]  # the warm-up's and tails' plain messages
    pump_stats: dict[str, Counter[str]]
    footprints: dict[str, list[int]]  # pump -> [warm-up, after workload, tail 1, tail 2]
    problems: list[str] = field(default_factory=list)
    cancels: int = 0  # statement faults that raised CancelledError outside any handler


def check(schedule: Schedule, seen: Observed) -> list[Violation]:
    found: list[Violation] = [Violation(BOUNDED, problem) for problem in seen.problems]
    found += _settled_in_time(schedule, seen)
    found += _applied_once(schedule, seen)
    found += _dead_letters(schedule, seen)
    found += _counted(schedule, seen)
    found += _settled_once(seen)
    found += _give_backs(schedule, seen)
    found += _order(seen.journal.starts)
    found += _footprints(seen.footprints)
    return found


def _settled_in_time(schedule: Schedule, seen: Observed) -> list[Violation]:
    if seen.settled_in_time:
        return []
    return [
        Violation(
            BOUNDED,
            f"not settled for good within {schedule.deadline:.0f}s: "
            + ", ".join(seen.unsettled or ["(waiting in the broker)"]),
        )
    ]


def _dead_lettered(broker: MemoryBroker) -> dict[str, str]:
    return {str(letter.message.message_id): letter.reason for letter in broker.dead_letters}


def _applied_once(schedule: Schedule, seen: Observed) -> list[Violation]:
    found = []
    dead = _dead_lettered(seen.broker)
    open_ids = {entry.split(" ", 1)[0] for entry in seen.unsettled}
    for message in (*schedule.messages, *seen.extra):
        for consumer in consumers(message.type, schedule.audit):
            where = (message.id, consumer)
            rows, markers = seen.effects[where], seen.markers[where]
            if rows > 1 or markers > 1:
                found.append(
                    Violation(
                        APPLIED_ONCE, f"{message.id}/{consumer}: {rows} rows, {markers} markers"
                    )
                )
            elif rows != markers:
                found.append(
                    Violation(
                        APPLIED_ONCE,
                        f"{message.id}/{consumer}: {rows} rows but {markers} markers",
                    )
                )
            elif (
                message.valid
                and rows == 0
                and message.id not in dead
                and message.id not in open_ids
            ):
                found.append(
                    Violation(APPLIED_ONCE, f"{message.id}/{consumer}: settled, never applied")
                )
        if not message.valid and message.id not in dead and message.id not in open_ids:
            found.append(
                Violation(
                    DEAD_LETTERS, f"{message.id} can never succeed, yet was not dead-lettered"
                )
            )
    return found


def _dead_letters(schedule: Schedule, seen: Observed) -> list[Violation]:
    """A valid message may be dead-lettered only once deliveries it spent on its own account
    reach WORKER_MAX_DELIVERIES: its own failures, the deliveries it had before it arrived,
    one per process death (it may have run beside the killer), give-backs past the
    WORKER_MAX_GIVE_BACKS bound (from there on they count), and for a message sent twice
    (a producer's retry, a twin) the other copy's starts: the durable count is the
    message's, whichever copy starts."""
    found = []
    journal = seen.journal
    messages = {m.id: m for m in schedule.messages}
    for message_id, reason in _dead_lettered(seen.broker).items():
        message = messages.get(message_id)
        if message is None:
            found.append(Violation(DEAD_LETTERS, f"{message_id} (no faults at all): {reason}"))
            continue
        if not message.valid:
            continue
        own = journal.own_failures[message_id]
        twice = message.copies > 1 or message.to_all
        spent = (
            own
            + message.delivered_before
            + journal.deaths
            + _past_the_bound(schedule, journal, message_id)
            + (own + 1 if twice else 0)
            + seen.cancels  # a cancellation outside any handler: the pump decides (_counted)
        )
        if spent < schedule.max_deliveries:
            found.append(
                Violation(
                    DEAD_LETTERS,
                    f"{message_id} ({own} own failure(s), delivered {message.delivered_before} "
                    f"time(s) before, {journal.deaths} death(s), "
                    f"{journal.uncounted[message_id]} uncounted give-back(s)) "
                    f"dead-lettered: {reason}",
                )
            )
    return found


def _counted(schedule: Schedule, seen: Observed) -> list[Violation]:
    """A valid message is given back counted (its delivery count moves) only for its own
    failures, for give-backs past WORKER_MAX_GIVE_BACKS, and for a cancellation a statement
    fault raised outside any handler while it was in flight (whose failure that is, the
    pump decides). An outage, a black hole, a read-only or full database, a refused
    privilege, another handler's session settings never move it (DESIGN rule 13)."""
    found = []
    journal = seen.journal
    for message in schedule.messages:
        if not message.valid:
            continue
        counted = journal.counted[message.id]
        own = journal.own_failures[message.id]
        allowed = own + _past_the_bound(schedule, journal, message.id) + seen.cancels
        if counted > allowed:
            found.append(
                Violation(
                    COUNTED,
                    f"{message.id} given back counted {counted} time(s), "
                    f"{own} own failure(s): {_fates(journal, message.id)}",
                )
            )
    return found


def _past_the_bound(schedule: Schedule, journal: Journal, message_id: str) -> int:
    """The counts a message's give-backs may spend: none before WORKER_MAX_GIVE_BACKS
    uncounted ones; past it, every give-back counts (its uncounted tally stops there), so
    any number (the limit's worth)."""
    if journal.uncounted[message_id] >= schedule.max_give_backs:
        return schedule.max_deliveries
    return 0


def _fates(journal: Journal, message_id: str) -> str:
    return " ".join(
        f"#{a.seq}@{a.pump}:{'/'.join(a.settled) or ('returned' if a.returned else '-')}"
        for a in journal.arrivals
        if a.message_id == message_id
    )


def _settled_once(seen: Observed) -> list[Violation]:
    found = []
    dead_pumps = {a.pump for a in seen.journal.arrivals if a.returned}
    for arrival in seen.journal.arrivals:
        what = f"{arrival.message_id} (arrival {arrival.seq} at {arrival.pump})"
        if len(arrival.settled) > 1:
            found.append(Violation(SETTLED_ONCE, f"{what} settled {arrival.settled}"))
        if arrival.lost and arrival.pump not in dead_pumps:
            found.append(Violation(SETTLED_ONCE, f"{what}: a live pump's settlement was lost"))
        if seen.settled_in_time and not arrival.settled and not arrival.returned:
            found.append(Violation(SETTLED_ONCE, f"{what} never settled, never returned"))
    for pump, stats in seen.pump_stats.items():
        for tally in ("settled-twice", "settlement-failed"):
            if stats[tally]:
                found.append(Violation(SETTLED_ONCE, f"pump {pump}: {tally}={stats[tally]}"))
    return found


def _give_backs(schedule: Schedule, seen: Observed) -> list[Violation]:
    """Uncounted give-backs of one message past WORKER_MAX_GIVE_BACKS, beyond one for each
    environment fault the schedule fires (an outage gives back what is in flight). Each copy
    of a message (a producer's retry, a twin) is bounded on its own."""
    environment = len(schedule.statement_faults) + len(schedule.deaths)
    for message in schedule.messages:
        environment += sum(1 for a in message.plan if a is not None and not a.own)
    copies = {m.id: 2 if m.copies > 1 or m.to_all else 1 for m in schedule.messages}
    found = []
    for message_id, count in sorted(seen.journal.uncounted.items()):
        limit = (schedule.max_give_backs + 2 + environment) * copies.get(message_id, 1)
        if count > limit:
            found.append(
                Violation(
                    BOUNDED, f"{message_id} given back uncounted {count} times (bound {limit})"
                )
            )
    return found


def _order(starts: list[Start]) -> list[Violation]:
    """Per pump, same-key (and same-group) deliveries start in their receive order: no
    delivery starts after one received later than it. A delivery given back and received
    again is a new arrival; a message running again at the same pump (its failed copy's
    twin, its redelivery) may follow others, as any failure reorders, but nothing received
    before it may start after it."""
    found = []
    lanes: dict[tuple[str, str, Any], list[Start]] = defaultdict(list)
    for start in starts:
        if start.key is not None:
            lanes[start.pump, "key", start.key].append(start)
        if start.group is not None:
            lanes[start.pump, "group", start.group].append(start)
    for (pump, kind, name), run in sorted(lanes.items(), key=lambda kv: str(kv[0])):
        latest: Start | None = None
        for start in run:
            if latest is not None and start.seq < latest.seq and not start.again:
                shown = ", ".join(f"{s.message_id}#{s.seq}" for s in run[:16])
                found.append(
                    Violation(
                        ORDER,
                        f"{kind} {name} at {pump}: {start.message_id} (received #{start.seq}) "
                        f"started after {latest.message_id} (received #{latest.seq}); "
                        f"starts in order: {shown}",
                    )
                )
                break
            if latest is None or start.seq > latest.seq:
                latest = start
    return found


def _footprints(footprints: dict[str, list[int]]) -> list[Violation]:
    found = []
    for pump, sizes in sorted(footprints.items()):
        if len(sizes) == 4:
            warm, after, tail1, tail2 = sizes
            if after - warm > WORKLOAD_SLACK:
                found.append(
                    Violation(
                        FOOTPRINT,
                        f"pump {pump} at rest held {warm} entries after the warm-up, "
                        f"{after} after the workload",
                    )
                )
        else:
            tail1, tail2 = sizes[-2:]
        if tail2 - tail1 > FOOTPRINT_SLACK:
            found.append(
                Violation(
                    FOOTPRINT,
                    f"pump {pump} at rest grows with the messages it handled: {tail1} entries, "
                    f"then {tail2} after the same number of messages again",
                )
            )
    return found
