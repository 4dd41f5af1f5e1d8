"""The machinery of ``prove_idempotent``: a handler's sample messages through the races the
worker exists for, each run compared with a run that applies every message exactly once.

Every run starts from an empty database (plus the ``given`` rows), runs the registered
handlers on the real pump (the memory broker; each replica on a copy of the handler
modules' state of its own, :mod:`worker.testing.isolation`) and delivers the samples;
then the business tables, the outbox, the claims and the rejections are read and
compared (:mod:`worker.testing.tables`), and so are the calls the handlers made to the
outside (:mod:`worker.testing.effects`). Applying once runs on one replica, twice. The
scenarios, in order:

``twice``     each message twice, one after the other (a producer's retry);
``twins``     each message to both replicas at the same moment;
``replicas``  each message on the other replica than the one before;
``crash``     for every boundary of each message's first attempt (each statement on the
              pump's engine, and its commit) a run that crashes there, then redelivers;
``writer``    another writer (the same handler on the same message, under another id)
              commits between the handler's read of a table and its write to it: really
              on PostgreSQL before an UPDATE or DELETE, emulated elsewhere
              (:mod:`worker.testing.replay`);
``race``      two different samples at once, one reading before the other commits
              (emulated on every database), compared with either applied first;
``order``     samples of one type that carry a sequence, delivered newest first;
``late``      every message redelivered after all the others, newest first;
``lost-ack``  each message's first ack is lost: it comes back after its commit.

The first scenario that differs ends the check: its report names the run, shows the
table diff and names the likely cause (:mod:`worker.testing.causes`), from what the probe
saw (a statement past the transaction, a call to the outside, module state changed), from
runs that tell causes apart (the same run again with module state forgotten before every
stage), and from the shape of the diff. Every column and effect the comparison leaves out
is listed in the report.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import MetaData

from worker.db import create_engine
from worker.registry import Registry, Runs
from worker.testing import causes
from worker.testing.calls import Calls
from worker.testing.causes import (
    LOST,
    NEW_ID,
    NO_INBOX,
    NO_TOKEN,
    NOT_ONCE,
    OUT_OF_ORDER,
    OUTSIDE_CLAIM,
    RACED,
    REPEATED_CALL,
    STATE,
    UNKNOWN,
    UNSTABLE,
)
from worker.testing.harness import Given, Harness, harness_settings, seeded
from worker.testing.isolation import Isolation
from worker.testing.probe import ConcurrentWriter, Crash, Escape, Plan, Trace, WriterOutcome
from worker.testing.replay import Transaction, replay, serialized
from worker.testing.report import ONCE, Finding, Outcome, Report, count
from worker.testing.scratch import Scratch
from worker.testing.statements import written_table
from worker.testing.tables import (
    Snapshot,
    TableDiff,
    TableSpec,
    business_tables,
    compare,
    freeze,
    left_out,
    show,
    snapshot,
    table_specs,
    unstable,
    volatile,
    worker_specs,
)

Effects = Callable[[], Any]
"""Returns (and forgets) the side effects the outside world saw since it was last called:
a list of calls, a set of idempotency keys, ... compared between runs."""

_SEQUENCE = re.compile(
    r"^(?:.*_)?(?:seq|sequence|sequence_number|version|revision|timestamp|ts)$"
    r"|^(?:updated|occurred|sent|changed|published)_at$",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class Message:
    """A sample as the broker carries it."""

    id: str
    type: str
    body: bytes
    headers: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Emulation:
    """After the steps: replay ``replayed`` (a message's recorded writes) over the state,
    read it, undo it, then deliver ``message`` for real."""

    replayed: tuple[Transaction, ...]
    message: Message


@dataclass(frozen=True, slots=True)
class Spec:
    """How one run goes: what is delivered how, on how many replicas, what is injected."""

    what: str
    steps: tuple[tuple[Message, str], ...]  # (message, "once" | "twice" | "twins" | "lost-ack")
    replicas: int = 2
    crash: Crash | None = None
    race: bool = False  # the real concurrent writer
    amnesia: bool = False  # every stage forgets the module state first
    snapshots: bool = False  # read the tables after every step
    emulation: Emulation | None = None


@dataclass(slots=True)
class Run:
    """What one run left: its state, its settlements, what the probe saw."""

    spec: Spec
    snapshot: Snapshot = field(default_factory=dict)
    snapshots: list[Snapshot] = field(default_factory=list)
    start: Snapshot = field(default_factory=dict)  # before the first step, with snapshots
    emulated: Snapshot | None = None  # the state the replay left, when it did what it did
    conflict: str | None = None  # why the replay stopped
    dead_letters: dict[str, str] = field(default_factory=dict)
    unsettled: str | None = None
    traces: list[Trace] = field(default_factory=list)
    effects: Any = None
    writers: list[WriterOutcome] = field(default_factory=list)

    @property
    def what(self) -> str:
        return self.spec.what

    def network(self) -> Counter[str]:
        return Counter(where for trace in self.traces for where in trace.network)

    def state(self) -> list[str]:
        return list(dict.fromkeys(name for trace in self.traces for name in trace.state))

    def escape(self) -> Escape | None:
        return next((e for trace in self.traces for e in trace.escaped), None)


@dataclass(frozen=True, slots=True)
class Setup:
    """What every run of one check shares (check_idempotent's options)."""

    handlers: Registry
    isolation: Isolation
    given: Given
    models: tuple[MetaData, ...]
    effects: Effects | None
    settings: Mapping[str, Any]
    settle_within: float
    writer_wait: float


Scenario = Callable[["Run"], Awaitable[tuple["Finding | None", str]]]


class Checker:
    def __init__(self, messages: list[Message], scratch: Scratch, setup: Setup) -> None:
        self.messages = messages
        self.scratch = scratch
        self.setup = setup
        self.handlers = setup.handlers
        self.effects = setup.effects
        self.specs: list[TableSpec] = []
        self.volatile: dict[str, frozenset[str]] = {}
        self.calls = Calls()
        self.recorded: Run | None = None  # the second run applying once: its recordings
        self.runs = 0
        self.postgres = False
        self._judged: Run | None = None  # the run of the last finding
        self._scenarios: dict[str, Scenario] = {
            "twice": self._twice,
            "twins": self._twins,
            "replicas": self._replicas,
            "crash": self._crash,
            "writer": self._writer,
            "race": self._race,
            "order": self._order,
            "late": self._late,
            "lost-ack": self._lost_ack,
        }

    def _once(self, what: str = ONCE, messages: Sequence[Message] | None = None) -> Spec:
        steps = tuple((m, "once") for m in (self.messages if messages is None else messages))
        return Spec(what, steps, replicas=1)

    async def check(self, chosen: list[str], report: Report, tables: Sequence[str] | None) -> None:
        if self.effects is not None:
            await _drained(self.effects)  # what came before the check is not its
        first = await self.run(self._once(), tables=tables)
        second = await self.run(replace(self._once(), snapshots=True))
        self.recorded = second
        report.runs = self.runs
        finding = self._unclean(first) or self._unclean(second) or self._unstable(first, second)
        if finding is None:
            self.volatile = volatile(first.snapshot, second.snapshot, self.specs)
            self.calls = Calls.between(first.traces, second.traces)
        report.left_out = [
            *left_out(self.specs, self.volatile),
            *self.calls.notes,
            *self.setup.isolation.described(first.state() + second.state()),
        ]
        report.outcomes.append(Outcome("once", 2, finding is None))
        for name in chosen:
            if finding is not None:
                report.outcomes.append(Outcome(name, 0, None))
                continue
            before = self.runs
            finding, note = await self._scenarios[name](first)
            if finding is not None:
                finding = await self._named(finding)
            report.outcomes.append(Outcome(name, self.runs - before, finding is None, note))
        if finding is None:
            finding = self._unseen(first)
            if finding is not None:
                report.outcomes[0] = Outcome("once", 2, False)
        report.finding = finding
        report.runs = self.runs

    # -- one run ---------------------------------------------------------------------

    async def run(self, spec: Spec, *, tables: Sequence[str] | None = None) -> Run:
        self.runs += 1
        setup = self.setup
        url = await self.scratch.fresh(setup.models)
        self.postgres = url.startswith("postgresql")
        await seeded(url, setup.given, setup.models)
        writer = None
        if spec.race:
            own = setup.isolation.replica().registry  # the writer is a process of its own
            writer = ConcurrentWriter(url, setup.writer_wait, setup.settle_within, own)
        worker = Harness(
            setup.handlers,
            url,
            harness_settings(url, {**setup.settings, "batch_size": 1}),  # one delivery a stage
            replicas=spec.replicas,
            plan=Plan(crash=spec.crash, writer=writer),
            settle_within=setup.settle_within,
            models=setup.models,
            isolation=setup.isolation,
            amnesia=spec.amnesia,
        )
        outcome = Run(spec)
        await worker.start()
        try:
            if spec.snapshots and self.specs:
                outcome.start = await snapshot(worker.engine, self.specs)
            for message, style in spec.steps:
                await _deliver(worker, style, message)
                if spec.snapshots and self.specs:
                    outcome.snapshots.append(await snapshot(worker.engine, self.specs))
            if spec.emulation is not None:
                await self._emulate(worker, spec.emulation, outcome)
        except TimeoutError as exc:
            outcome.unsettled = str(exc)
        finally:
            await worker.stop()
            if writer is not None:
                await writer.close()
        outcome.traces = worker.probe.traces
        outcome.dead_letters = {
            str(d.message.message_id): d.reason for d in worker.broker.dead_letters
        }
        if writer is not None:
            outcome.writers = list(writer.outcomes.values())
        if self.effects is not None:
            outcome.effects = await _drained(self.effects)
        engine = create_engine(url, pool_size=1)
        try:
            if not self.specs:
                written = {t for trace in outcome.traces for t in trace.written}
                names = list(tables) if tables else business_tables(setup.models, written)
                claimers = [h.consumer for h in self.handlers if h.runs is Runs.CLAIM]
                self.specs = await table_specs(engine, names, setup.models)
                self.specs += worker_specs(claimers)
            outcome.snapshot = await snapshot(engine, self.specs)
        finally:
            await engine.dispose()
        return outcome

    async def _emulate(self, worker: Harness, emulation: Emulation, outcome: Run) -> None:
        await worker.settled()
        engine = create_engine(worker.database_url, pool_size=1)
        try:
            async with engine.connect() as connection:
                outcome.conflict = await replay(connection, emulation.replayed)
                if outcome.conflict is None:
                    outcome.emulated = await snapshot(connection, self.specs)
                await connection.rollback()
        finally:
            await engine.dispose()
        await _deliver(worker, "once", emulation.message)

    # -- the scenarios ---------------------------------------------------------------

    def _styled(self, what: str, style: str, messages: Sequence[Message] | None = None) -> Spec:
        chosen = self.messages if messages is None else messages
        return Spec(what, tuple((m, style) for m in chosen))

    async def _twice(self, base: Run) -> tuple[Finding | None, str]:
        run = await self.run(
            self._styled("each message delivered twice, one after the other", "twice")
        )
        return self._judge("twice", base, run), ""

    async def _twins(self, base: Run) -> tuple[Finding | None, str]:
        run = await self.run(
            self._styled("each message to both replicas at the same moment", "twins")
        )
        return self._judge("twins", base, run), ""

    async def _replicas(self, base: Run) -> tuple[Finding | None, str]:
        if len(self.messages) < 2:
            return None, "one sample: nothing to share"
        run = await self.run(
            self._styled("each message on the other replica than the one before", "once")
        )
        note = "3 samples or more show a replica's stale memory" if len(self.messages) < 3 else ""
        return self._judge("replicas", base, run), note

    async def _lost_ack(self, base: Run) -> tuple[Finding | None, str]:
        run = await self.run(
            self._styled("each message's first ack lost after its commit", "lost-ack")
        )
        return self._judge("lost-ack", base, run), ""

    async def _late(self, base: Run) -> tuple[Finding | None, str]:
        # newest first: the oldest message's redelivery comes last, after everything newer
        steps = tuple((m, "once") for m in (*self.messages, *reversed(self.messages)))
        run = await self.run(
            Spec("each message applied once, then each redelivered again, newest first", steps)
        )
        return self._judge("late", base, run), ""

    async def _order(self, base: Run) -> tuple[Finding | None, str]:
        found = _sequenced(self.messages)
        if found is None:
            return None, "no samples of one type carry an increasing sequence field"
        field_name, reordered = found
        run = await self.run(
            self._styled(
                f"samples that carry {field_name} delivered newest first", "once", reordered
            )
        )
        finding = self._judge("order", base, run)
        if finding is None:
            return None, f"by {field_name}"
        refused = self._refused(base, run)
        if refused:
            return None, f"by {field_name}; the handler refused {count(refused, 'older message')}"
        return finding, f"by {field_name}"

    def _refused(self, base: Run, run: Run) -> int:
        """Messages refused in ``run`` but not in ``base``: recorded rejections, dead letters."""
        rejected = {row.get("message_id") for row in run.snapshot.get("rejections", [])} - {
            row.get("message_id") for row in base.snapshot.get("rejections", [])
        }
        letters = set(run.dead_letters) - set(base.dead_letters)
        return len(rejected | letters)

    async def _crash(self, base: Run) -> tuple[Finding | None, str]:
        points = 0
        for trace in base.traces:
            if not trace.first:
                continue
            for at, boundary in enumerate(trace.boundaries, 1):
                points += 1
                place = boundary if boundary == "the commit" else f"statement {at}: {boundary}"
                what = (
                    f"{trace.message_id} ({trace.consumer}) crashed before {place}; "
                    "then redelivered"
                )
                crash = Crash(trace.message_id, trace.consumer, at)
                run = await self.run(replace(self._once(what), crash=crash))
                finding = self._judge("crash", base, run) or self._uncrashed(run, what)
                if finding is not None:
                    if finding.cause == UNKNOWN:
                        finding = await self._crash_cause(finding, base, run, trace.message_id)
                    return finding, f"at crash point {points}"
        return None, count(points, "crash point")

    async def _crash_cause(self, finding: Finding, base: Run, run: Run, message_id: str) -> Finding:
        """A crash run that differs, with nothing seen pass the transaction: was the
        crashed message's work lost (the state equals applying the others only), or did
        the crashed attempt's change survive its rollback (the state has it twice)?"""
        others = [m for m in self.messages if m.id != message_id]
        without = await self.run(self._once("the others applied once, without it", others))
        if not compare(without.snapshot, run.snapshot, self.specs, self.volatile):
            return replace(finding, cause=LOST, explanation=causes.CRASH_UNDONE)
        doubled: list[Message] = []
        for message in self.messages:
            doubled.append(message)
            if message.id == message_id:
                doubled.append(replace(message, id=f"{message.id}~again"))
        twice = await self.run(self._once("it applied twice, under two ids", doubled))
        if not compare(twice.snapshot, run.snapshot, self.specs, self.volatile):
            return replace(finding, cause=causes.ESCAPED, explanation=causes.CRASH_SURVIVED)
        return finding

    def _uncrashed(self, run: Run, what: str) -> Finding | None:
        """The crash must have happened, or the run proved nothing."""
        if any(trace.crashed for trace in run.traces):
            return None
        return Finding(
            "crash",
            what,
            ("the attempt never reached that point: it ran differently than once",),
            UNKNOWN,
            "the handler's statements differ between two runs of the same message; the "
            "crash scenario needs the same statements every time",
        )

    async def _writer(self, base: Run) -> tuple[Finding | None, str]:
        finding, raced, note = None, set[str](), ""
        if self.postgres:
            finding, raced, note = await self._real_writer(base)
            if finding is not None:
                return finding, note
        emulated = locked = noticed = 0
        for index, message in enumerate(self.messages):
            if message.id in raced:
                continue
            replayed = self._recorded(message.id)
            if replayed is None or not any(t.read & t.written() for t in replayed):
                continue
            if serialized(replayed, replayed) is not None:
                locked += 1  # the writer, doing the same, would wait for the handler's lock
                continue
            writer = replace(message, id=f"{message.id}~writer")
            prefix = self.messages[:index]
            spec = Spec(
                f"{writer.id} committed between {message.id}'s read and its write (emulated)",
                tuple((m, "once") for m in (*prefix, writer)),
                replicas=1,
                emulation=Emulation(tuple(replayed), message),
            )
            run = await self.run(spec)
            emulated += 1
            noticed += run.conflict is not None
            finding = self._judge_emulated("writer", run, [run.snapshot])
            if finding is not None:
                break
        parts = [note] if note else []
        if emulated:
            parts.append(f"{count(emulated, 'writer')} emulated{_noticed(noticed)}")
        if locked:
            parts.append(f"{locked} serialized by a lock")
        if not parts:
            parts.append("no handler reads a table and then writes to it")
        return finding, ", ".join(parts)

    async def _real_writer(self, base: Run) -> tuple[Finding | None, set[str], str]:
        """On PostgreSQL: the writer commits for real, inside the handler's UPDATE or DELETE."""
        run = await self.run(
            replace(
                self._styled(
                    "another writer committed between each handler's read and its write", "once"
                ),
                race=True,
            )
        )
        raced = [w for w in run.writers if w.state in ("before", "after")]
        if not raced:
            return self._judge("writer", base, run, effects=False), set(), ""
        raced_by = {w.message_id: w for w in raced}
        extended: list[Message] = []
        for message in self.messages:
            writer = raced_by.get(message.id)
            if writer is None:
                extended.append(message)
                continue
            twin = Message(writer.writer_id, message.type, message.body, message.headers)
            # the writer committed first, or waited behind the handler's lock and came after
            extended.extend((twin, message) if writer.state == "before" else (message, twin))
        expected = await self.run(
            self._once("each message and its writer's, applied once", extended)
        )
        finding = self._unclean(expected) or self._judge("writer", expected, run, effects=False)
        failed = len(run.writers) - len(raced)
        note = f"{len(raced)} writers raced" + (f", {failed} failed" if failed else "")
        return finding, set(raced_by), note

    async def _race(self, base: Run) -> tuple[Finding | None, str]:
        if len(self.messages) < 2:
            return None, "one sample: nothing to race"
        assert self.recorded is not None
        raced, noticed, skipped = 0, 0, []
        for index in range(1, len(self.messages)):
            first, second = self.messages[index - 1], self.messages[index]
            replayed = self._recorded(first.id)
            others = self._recorded(second.id)
            if replayed is None or others is None:
                continue  # a side effect's claim, or nothing committed
            read = set().union(*(t.read for t in replayed)) if replayed else set()
            written = set().union(*(t.written() for t in others)) if others else set()
            if not read & written:
                continue
            why = serialized(replayed, others)
            if why is not None:
                skipped.append(f"{first.id}: {why}")
                continue
            spec = Spec(
                f"{first.id} read, then {second.id} committed, then {first.id} wrote (emulated)",
                tuple((m, "once") for m in (*self.messages[: index - 1], second)),
                replicas=1,
                emulation=Emulation(tuple(replayed), first),
            )
            run = await self.run(spec)
            raced += 1
            noticed += run.conflict is not None
            in_order = (
                self.recorded.snapshots[index] if len(self.recorded.snapshots) > index else None
            )
            serial = [run.snapshot] + ([in_order] if in_order is not None else [])
            finding = self._judge_emulated("race", run, serial)
            if finding is not None:
                return finding, f"{count(raced, 'pair')} raced"
        note = (
            f"{count(raced, 'pair')} raced{_noticed(noticed)}"
            if raced
            else "no two samples touch the same rows"
        )
        if skipped:
            note += "; serialized by a lock: " + "; ".join(skipped)
        return None, note

    def _recorded(self, message_id: str) -> list[Transaction] | None:
        """The committed transactions of a message's handlers when applied once, in order;
        None when a handler of it is a side effect's claim (its call is not replayable)."""
        assert self.recorded is not None
        found: list[Transaction] = []
        for trace in self.recorded.traces:
            if trace.message_id != message_id:
                continue
            if trace.runs is Runs.CLAIM:
                return None
            found.extend(trace.transactions)
        return found or None

    # -- judging ---------------------------------------------------------------------

    def _unclean(self, run: Run) -> Finding | None:
        """A run that applies each message once must settle, and dead-letter nothing."""
        if not run.dead_letters and run.unsettled is None:
            return None
        lines = [f"{mid}: dead-lettered: {reason}" for mid, reason in run.dead_letters.items()]
        if run.unsettled:
            lines.append(run.unsettled)
        cause, explanation = NOT_ONCE, causes.FIX_SAMPLES
        escape = run.escape()
        named = [causes.from_reason(reason) for reason in run.dead_letters.values()]
        if escape is not None:
            cause, explanation = causes.escaped(escape)
        elif any(named):
            cause, explanation = next(n for n in named if n is not None)
        return Finding("once", run.what, tuple(lines), cause, explanation)

    def _unstable(self, first: Run, second: Run) -> Finding | None:
        """Two runs that each apply every message once must leave as many rows."""
        lines = unstable(first.snapshot, second.snapshot, second.start, self.specs)
        if not lines:
            return None
        changed = first.state() + second.state()
        if changed:
            return Finding("once", second.what, tuple(lines), STATE, causes.state(changed))
        return Finding("once", second.what, tuple(lines), UNSTABLE, causes.UNSTABLE_TEXT)

    def _judge(self, scenario: str, base: Run, run: Run, *, effects: bool = True) -> Finding | None:
        diffs = compare(base.snapshot, run.snapshot, self.specs, self.volatile)
        lines = [line for diff in diffs for line in diff.lines("once")]
        for mid, reason in run.dead_letters.items():
            if mid not in base.dead_letters:
                lines.append(f"{mid}: dead-lettered here, not once: {reason}")
        if run.unsettled:
            lines.append(run.unsettled)
        calls: list[str] = []
        if effects:
            calls = [
                *self._effects(base, run),
                *self.calls.compare(base.traces, run.traces),
                *self._network(base, run),
            ]
        lines.extend(calls)
        if not lines:
            return None
        self._judged = run
        cause, explanation = self._cause(scenario, base, run, diffs, calls)
        return Finding(scenario, run.what, tuple(lines), cause, explanation)

    def _judge_emulated(self, scenario: str, run: Run, serial: list[Snapshot]) -> Finding | None:
        """An emulated race must leave what one of the serial orders leaves."""
        if run.emulated is None:
            return None  # the replay stopped where the handler would have noticed
        all_diffs = [compare(s, run.emulated, self.specs, self.volatile) for s in serial]
        if any(not diffs for diffs in all_diffs):
            return None
        self._judged = run
        diffs = all_diffs[0]
        lines = [line for diff in diffs for line in diff.lines("one after the other")]
        table = diffs[0].table
        traces = self.recorded.traces if self.recorded is not None else []
        unguarded = next(
            (u for t in traces for u in t.unguarded if written_table(u) == table), None
        )
        if unguarded is not None and any(d.changed for d in diffs):
            cause, explanation = NO_TOKEN, causes.no_token(table, unguarded, True, self.postgres)
        else:
            cause, explanation = RACED, causes.raced(table, True, self.postgres)
        return Finding(scenario, run.what, tuple(lines), cause, explanation)

    def _effects(self, base: Run, run: Run) -> list[str]:
        if self.effects is None:
            return []
        want, got = _comparable(base.effects), _comparable(run.effects)
        if want == got:
            return []
        return [f"effects: {show(got)} (once: {show(want)})"]

    def _network(self, base: Run, run: Run) -> list[str]:
        """Connections to addresses no call the kit saw went to: a protocol it does not
        know, seen only when a connection is opened."""
        want, got = base.network(), run.network()
        known = {e.address for r in (base, run) for t in r.traces for e in t.effects if e.address}
        return [
            f"network: {count} connections to {where} from inside a transaction handler "
            f"(once: {want[where]})"
            for where, count in sorted(got.items())
            if count > want[where] and where not in known
        ]

    def _cause(
        self, scenario: str, base: Run, run: Run, diffs: list[TableDiff], calls: list[str]
    ) -> tuple[str, str]:
        """What the probe saw decides first; then the scenario and the shape of the diff."""
        escape = run.escape()
        if escape is not None:
            return causes.escaped(escape)
        for reason in run.dead_letters.values():
            named = causes.from_reason(reason)
            if named is not None:
                return named
        if calls:
            return self._call_cause(base, run)
        if scenario == "writer" and diffs:
            unguarded = next((s for t in run.traces for s in t.unguarded), None)
            if unguarded is not None and any(d.changed for d in diffs):
                return NO_TOKEN, causes.no_token(diffs[0].table, unguarded, False, True)
            return RACED, causes.raced(diffs[0].table, False, True)
        renewed = [d for d in diffs if d.repeats and d.volatile]
        if renewed:
            diff = renewed[0]
            return NEW_ID, causes.new_id(diff.table, ", ".join(sorted(diff.volatile)))
        return self._diff_cause(scenario, run, diffs)

    def _diff_cause(self, scenario: str, run: Run, diffs: list[TableDiff]) -> tuple[str, str]:
        no_inbox = any(not h.inbox for h in self._handlers())
        if scenario == "order":
            found = _sequenced(self.messages)
            return OUT_OF_ORDER, causes.out_of_order(found[0] if found else None)
        if scenario == "late" and no_inbox and self._older(run):
            return OUT_OF_ORDER, causes.out_of_order(None)
        if scenario == "late" and no_inbox:
            return NO_INBOX, causes.NO_INBOX_TEXT
        if scenario in ("twice", "twins", "lost-ack") and no_inbox:
            return NO_INBOX, causes.NO_INBOX_TEXT
        if scenario == "crash":
            if any(d.extra for d in diffs):
                return causes.ESCAPED, causes.CRASH_SURVIVED
            if any(d.missing for d in diffs):
                return LOST, causes.CRASH_UNDONE
            return UNKNOWN, "the crash left the tables different from applying each message once."
        if any(d.missing for d in diffs) or run.dead_letters:
            return LOST, causes.LOST_TEXT
        return UNKNOWN, "the tables differ from applying each message once; the diff shows where."

    def _call_cause(self, base: Run, run: Run) -> tuple[str, str]:
        more = self.calls.more(base.traces, run.traces)
        if more is None and self.effects is not None:
            more = (
                "transaction"
                if any(h.runs is Runs.TRANSACTION for h in self._handlers())
                else "claim"
            )
        if more is None:
            return LOST, causes.LOST_EFFECT
        if more == "claim":
            return REPEATED_CALL, causes.REPEATED
        where = next(
            (e.target for t in run.traces if t.runs is Runs.TRANSACTION for e in t.effects),
            None,
        ) or next((w for t in run.traces for w in t.network), "an outside service")
        return OUTSIDE_CLAIM, causes.outside_claim(where)

    def _older(self, run: Run) -> bool:
        """Whether ``run`` left what applying once left before the last message: an older
        state written over the newer one."""
        earlier = self.recorded.snapshots[:-1] if self.recorded is not None else []
        return any(not compare(s, run.snapshot, self.specs, self.volatile) for s in earlier)

    def _handlers(self) -> list[Any]:
        types = {m.type for m in self.messages}
        return [h for t in types for h in self.handlers.for_type(t)]

    async def _named(self, finding: Finding) -> Finding:
        """A finding from a run in which handlers changed module state: the same run with
        that state forgotten before every stage tells whether the difference comes from it."""
        if finding.cause not in (LOST, UNKNOWN, NO_INBOX, NEW_ID, OUT_OF_ORDER):
            return finding
        run = self._judged
        if run is None or not run.state() or run.spec.amnesia or run.spec.emulation:
            return finding
        again = await self.run(replace(run.spec, amnesia=True))
        if compare(run.snapshot, again.snapshot, self.specs, self.volatile):
            return replace(finding, cause=STATE, explanation=causes.state(run.state()))
        return finding

    def _unseen(self, base: Run) -> Finding | None:
        """Every scenario agreed, yet the probe saw something pass the transaction: to a
        table or a database the check does not compare, or a commit of the handler's."""
        escape = base.escape()
        if escape is None:
            return None
        cause, explanation = causes.escaped(escape)
        return Finding(
            "once",
            base.what,
            ("no compared table shows it: the write went somewhere the check does not read",),
            cause,
            explanation,
        )


def _noticed(n: int) -> str:
    """How many replays stopped where the handler would have met the other's change (a
    version conflict, a unique key): those were not judged, the retry decides."""
    return f", {n} stopped where the handler sees the change" if n else ""


def _sequenced(messages: Sequence[Message]) -> tuple[str, list[Message]] | None:
    """A field the samples of one type carry whose values increase in the samples' order
    (a sequence, a version, a timestamp), and the samples with those delivered newest
    first; None when no type has one."""
    by_type: dict[str, list[int]] = {}
    for index, message in enumerate(messages):
        by_type.setdefault(message.type, []).append(index)
    for positions in by_type.values():
        if len(positions) < 2:
            continue
        bodies = []
        for index in positions:
            try:
                body = json.loads(messages[index].body)
            except ValueError:
                body = None
            bodies.append(body if isinstance(body, dict) else {})
        for name in bodies[0]:
            if not _SEQUENCE.match(name):
                continue
            values = [body.get(name) for body in bodies]
            if not _increasing(values):
                continue
            reordered = list(messages)
            for index, source in zip(positions, reversed(positions), strict=True):
                reordered[index] = messages[source]
            return name, reordered
    return None


def _increasing(values: list[Any]) -> bool:
    if any(not isinstance(v, int | float | str) or isinstance(v, bool) for v in values):
        return False
    if len({type(v) for v in values}) != 1:
        return False
    return all(a < b for a, b in itertools.pairwise(values))


async def _deliver(worker: Harness, style: str, message: Message) -> None:
    publish = worker.broker.publish
    if style == "twins":
        publish(message.id, message.type, message.body, dict(message.headers), to_all=True)
    elif style == "lost-ack":
        publish(message.id, message.type, message.body, dict(message.headers), lose_acks=1)
    else:
        publish(message.id, message.type, message.body, dict(message.headers))
    await worker.settled()
    if style == "twice":
        publish(message.id, message.type, message.body, dict(message.headers))
        await worker.settled()


def _comparable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return Counter(freeze(item) for item in value)
    if isinstance(value, set | frozenset):
        return frozenset(freeze(item) for item in value)
    return freeze(value)


async def _drained(effects: Effects) -> Any:
    value = effects()
    if isinstance(value, Awaitable):
        value = await value
    return value
