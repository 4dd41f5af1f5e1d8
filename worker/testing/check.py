"""``prove_idempotent``: a handler's sample messages through the races the worker exists
for, each run compared with a run that applies every message exactly once.

Every run starts from an empty database (plus the ``given`` rows), runs the registered
handlers on the real pump (two replicas, the memory broker) and delivers the samples
one after another; then the business tables, the outbox, the claims and the rejections
are read and compared (:mod:`worker.testing.tables`). The scenarios, in order:

``twice``     each message twice, one after the other (a producer's retry);
``twins``     each message to both replicas at the same moment;
``crash``     for every boundary of each message's first attempt (each statement on the
              pump's engine, and its commit) a run that crashes there, then redelivers;
``writer``    another writer (the same handler on the same message, under another id)
              commits between the handler's read of a table and its UPDATE or DELETE of
              it; compared with a run that applies both messages once;
``lost-ack``  each message's first ack is lost: it comes back after its commit.

The first scenario that differs ends the check: its report names the run, shows the
table diff and names the likely cause, from what the probe saw (a statement through
another engine, a network call from inside a transaction, an UPDATE whose WHERE is
the primary key alone) and from the shape of the diff (an extra row that differs only
in a column that changes from run to run).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import MetaData

from worker.db import create_engine, redact
from worker.registry import Registry, Runs, registry
from worker.testing.harness import Body, Given, Harness, encode, harness_settings, seeded
from worker.testing.probe import ConcurrentWriter, Crash, Escape, Plan, Trace, WriterOutcome
from worker.testing.scratch import Scratch, scratch_for
from worker.testing.tables import (
    Snapshot,
    TableDiff,
    TableSpec,
    business_tables,
    compare,
    freeze,
    show,
    snapshot,
    table_specs,
    volatile,
    worker_specs,
)

# -- the causes a finding names ------------------------------------------------------------

ESCAPED = "a write escaped the transaction"
NO_TOKEN = "the row was read without a version token"
OUTSIDE_CLAIM = "an effect ran outside a claim"
NEW_ID = "an id was made anew on each attempt"
NO_INBOX = "the handler runs again without the inbox, and its writes are not idempotent"
REPEATED_CALL = "a side effect's call was repeated under another key"
LOST = "a delivery ended without its effects"
NOT_ONCE = "the samples do not apply cleanly once"
UNKNOWN = "the handler's effects depend on how often or when it runs"

SCENARIOS: Mapping[str, str] = {
    "twice": "each message twice, one after the other",
    "twins": "twins at the same moment on two pumps",
    "crash": "a crash at every statement boundary, then a redelivery",
    "writer": "a concurrent writer between the handler's read and its write",
    "lost-ack": "a lost ack: redelivered after its commit",
}
ONCE = "each message applied exactly once"

Effects = Callable[[], Any]
"""Returns (and forgets) the side effects the outside world saw since it was last called:
a list of calls, a set of idempotency keys, ... compared between runs."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One message to deliver: its type, its body (a mapping, a model, JSON bytes), and
    optionally its id (default ``sample-<n>``) and headers."""

    type: str
    body: Body
    id: str | None = None
    headers: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class _Message:
    id: str
    type: str
    body: bytes
    headers: Mapping[str, Any]


@dataclass(slots=True)
class _Run:
    """What one run left: its state, its settlements, what the probe saw."""

    what: str
    snapshot: Snapshot = field(default_factory=dict)
    dead_letters: dict[str, str] = field(default_factory=dict)
    unsettled: str | None = None
    traces: list[Trace] = field(default_factory=list)
    effects: Any = None
    writers: list[WriterOutcome] = field(default_factory=list)

    def network(self) -> Counter[str]:
        return Counter(where for trace in self.traces for where in trace.network)


@dataclass(frozen=True, slots=True)
class Finding:
    """The first difference: which run, what differed, and the likely cause."""

    scenario: str  # a key of SCENARIOS, or "once"
    run: str
    differences: tuple[str, ...]
    cause: str
    explanation: str

    def lines(self) -> list[str]:
        out = [f"run: {self.run}"]
        out.extend(self.differences)
        out.append(f"likely cause: {self.cause}")
        out.extend(f"  {line}" for line in _wrap(self.explanation))
        return out


@dataclass(frozen=True, slots=True)
class Outcome:
    scenario: str
    runs: int
    passed: bool | None  # None: not run
    note: str = ""


@dataclass(slots=True)
class Report:
    """What ``prove_idempotent`` found; ``str(report)`` is what ``worker check`` prints."""

    samples: int
    database: str
    outcomes: list[Outcome] = field(default_factory=list)
    finding: Finding | None = None
    runs: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.finding is None

    def __str__(self) -> str:
        lines = [
            f"worker check: {_count(self.samples, 'sample message')} on {self.database}, "
            f"{self.runs} runs in {self.seconds:.1f}s"
        ]
        for outcome in self.outcomes:
            mark = {True: "ok  ", False: "FAIL", None: "-   "}[outcome.passed]
            title = SCENARIOS.get(outcome.scenario, ONCE)
            note = f" ({outcome.note})" if outcome.note else ""
            if outcome.passed is None:
                note = " (not run)"
            lines.append(f"  {mark}  {title}{note}")
            if outcome.passed is False and self.finding is not None:
                lines.extend(f"          {line}" for line in self.finding.lines())
        if self.finding is None:
            lines.append("idempotent: every scenario left what applying each message once leaves")
        else:
            lines.append(f"NOT idempotent: {self.finding.cause}")
        return "\n".join(lines)


class NotIdempotent(AssertionError):
    """``prove_idempotent`` found a scenario that differs; ``report`` says which and why."""

    def __init__(self, report: Report) -> None:
        super().__init__(str(report))
        self.report = report


async def prove_idempotent(
    samples: Sequence[Sample | Mapping[str, Any]],
    **options: Any,
) -> Report:
    """:func:`check_idempotent`, raising :class:`NotIdempotent` unless every scenario agrees."""
    report = await check_idempotent(samples, **options)
    if not report.ok:
        raise NotIdempotent(report)
    return report


async def check_idempotent(
    samples: Sequence[Sample | Mapping[str, Any]],
    *,
    handlers: Registry | None = None,
    tables: Sequence[str] | None = None,
    given: Given = (),
    models: Sequence[MetaData] = (),
    database: str | Scratch | None = None,
    effects: Effects | None = None,
    scenarios: Sequence[str] | None = None,
    settle_within: float = 30.0,
    writer_wait: float = 0.5,
    **settings: Any,
) -> Report:
    """Run ``samples`` through every scenario; the report of the first that differs.

    ``handlers``: the registry (default: the one ``@handler`` fills). ``tables``: the
    business tables to compare (default: every model table that is not the worker's,
    and every table a handler wrote). ``given``: rows each run starts from. ``models``:
    metadata beyond ``worker.Base``'s. ``database``: None (SQLite files), a
    ``postgresql+asyncpg://`` server URL (throwaway databases on it) or a scratch.
    ``effects``: see :data:`Effects`; without it, connections that a transaction handler
    opens to anything but the database are counted instead. ``settings``: Settings
    fields for the pumps.
    """
    messages = _messages(samples)
    chosen = list(SCENARIOS) if scenarios is None else list(scenarios)
    unknown = [name for name in chosen if name not in SCENARIOS]
    if unknown or not messages:
        problem = f"unknown scenarios {unknown}" if unknown else "no sample messages"
        raise ValueError(f"check_idempotent: {problem}; scenarios are {list(SCENARIOS)}")
    started = time.perf_counter()
    where = "SQLite" if database is None else _describe(database)
    report = Report(len(messages), where)
    setup = _Setup(
        handlers if handlers is not None else registry,
        given,
        tuple(models),
        effects,
        dict(settings),
        settle_within,
        writer_wait,
    )
    async with scratch_for(database) as scratch:
        await _Checker(messages, scratch, setup).check(chosen, report, tables)
    report.seconds = time.perf_counter() - started
    return report


def _describe(database: str | Scratch) -> str:
    if isinstance(database, str):
        return f"PostgreSQL ({redact(database)})"
    return type(database).__name__.removesuffix("Scratch") or "a scratch database"


def _messages(samples: Sequence[Sample | Mapping[str, Any]]) -> list[_Message]:
    found = []
    for n, sample in enumerate(samples, 1):
        if not isinstance(sample, Sample):
            sample = Sample(sample["type"], sample["body"], sample.get("id"), sample.get("headers"))
        found.append(
            _Message(
                sample.id or f"sample-{n}",
                sample.type,
                encode(sample.body),
                dict(sample.headers or {}),
            )
        )
    ids = [m.id for m in found]
    if len(set(ids)) != len(ids):
        raise ValueError("check_idempotent: two samples share an id; give each its own")
    return found


@dataclass(frozen=True, slots=True)
class _Setup:
    """What every run of one check shares (check_idempotent's options)."""

    handlers: Registry
    given: Given
    models: tuple[MetaData, ...]
    effects: Effects | None
    settings: Mapping[str, Any]
    settle_within: float
    writer_wait: float


class _Checker:
    def __init__(self, messages: list[_Message], scratch: Scratch, setup: _Setup) -> None:
        self.messages = messages
        self.scratch = scratch
        self.setup = setup
        self.handlers = setup.handlers
        self.effects = setup.effects
        self.specs: list[TableSpec] = []
        self.volatile: dict[str, frozenset[str]] = {}
        self.runs = 0
        self._scenarios: dict[str, Callable[[_Run], Awaitable[tuple[Finding | None, str]]]] = {
            "twice": self._twice,
            "twins": self._twins,
            "crash": self._crash,
            "writer": self._writer,
            "lost-ack": self._lost_ack,
        }

    async def check(self, chosen: list[str], report: Report, tables: Sequence[str] | None) -> None:
        if self.effects is not None:
            await _drained(self.effects)  # what came before the check is not its
        first = await self.run("once", ONCE, tables=tables)
        second = await self.run("once", ONCE)
        report.runs = self.runs
        finding = self._unclean(first) or self._unclean(second)
        if finding is None:
            self.volatile = volatile(first.snapshot, second.snapshot, self.specs)
        report.outcomes.append(Outcome("once", 2, finding is None))
        for name in chosen:
            if finding is not None:
                report.outcomes.append(Outcome(name, 0, None))
                continue
            before = self.runs
            finding, note = await self._scenarios[name](first)
            report.outcomes.append(Outcome(name, self.runs - before, finding is None, note))
        if finding is None:
            finding = self._unseen(first)
            if finding is not None:
                report.outcomes[0] = Outcome("once", 2, False)
        report.finding = finding
        report.runs = self.runs

    # -- one run ---------------------------------------------------------------------

    async def run(
        self,
        style: str,
        what: str,
        *,
        crash: Crash | None = None,
        race: bool = False,
        messages: list[_Message] | None = None,
        tables: Sequence[str] | None = None,
    ) -> _Run:
        self.runs += 1
        setup = self.setup
        url = await self.scratch.fresh(setup.models)
        await seeded(url, setup.given, setup.models)
        writer = ConcurrentWriter(url, setup.writer_wait, setup.settle_within) if race else None
        worker = Harness(
            setup.handlers,
            url,
            harness_settings(url, {**setup.settings, "batch_size": 1}),  # one delivery a stage
            plan=Plan(crash=crash, writer=writer),
            settle_within=setup.settle_within,
            models=setup.models,
        )
        outcome = _Run(what)
        await worker.start()
        try:
            for message in messages or self.messages:
                await self._deliver(worker, style, message)
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

    async def _deliver(self, worker: Harness, style: str, message: _Message) -> None:
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

    # -- the scenarios ---------------------------------------------------------------

    async def _twice(self, base: _Run) -> tuple[Finding | None, str]:
        run = await self.run("twice", "each message delivered twice, one after the other")
        return self._judge("twice", base, run), ""

    async def _twins(self, base: _Run) -> tuple[Finding | None, str]:
        run = await self.run("twins", "each message to both replicas at the same moment")
        return self._judge("twins", base, run), ""

    async def _lost_ack(self, base: _Run) -> tuple[Finding | None, str]:
        run = await self.run("lost-ack", "each message's first ack lost after its commit")
        return self._judge("lost-ack", base, run), ""

    async def _crash(self, base: _Run) -> tuple[Finding | None, str]:
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
                run = await self.run("once", what, crash=crash)
                finding = self._judge("crash", base, run) or self._uncrashed(run, what)
                if finding is not None:
                    return finding, f"at crash point {points}"
        return None, _count(points, "crash point")

    def _uncrashed(self, run: _Run, what: str) -> Finding | None:
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

    async def _writer(self, base: _Run) -> tuple[Finding | None, str]:
        what = "another writer committed between each handler's read and its write"
        run = await self.run("once", what, race=True)
        raced = [w for w in run.writers if w.state in ("before", "after")]
        serialized = [
            t for t in run.traces if t.writer is not None and t.writer.state == "serialized"
        ]
        if not raced:
            note = "no handler reads a table and then writes to it"
            if serialized:
                note = "SQLite lets no other writer commit inside the handler's transaction"
            unguarded = [sql for trace in serialized for sql in trace.unguarded]
            if unguarded:
                return self._static_no_token(unguarded), note
            return self._judge("writer", base, run), note
        raced_by = {w.message_id: w for w in raced}
        extended: list[_Message] = []
        for message in self.messages:
            writer = raced_by.get(message.id)
            if writer is None:
                extended.append(message)
                continue
            twin = _Message(writer.writer_id, message.type, message.body, message.headers)
            # the writer committed first, or waited behind the handler's lock and came after
            extended.extend((twin, message) if writer.state == "before" else (message, twin))
        expected = await self.run(
            "once", "each message and its writer's, applied once", messages=extended
        )
        finding = self._unclean(expected) or self._judge("writer", expected, run)
        failed = len(run.writers) - len(raced)
        note = f"{len(raced)} writers raced" + (f", {failed} failed" if failed else "")
        return finding, note

    # -- judging ---------------------------------------------------------------------

    def _unclean(self, run: _Run) -> Finding | None:
        """A run that applies each message once must settle, and dead-letter nothing."""
        if not run.dead_letters and run.unsettled is None:
            return None
        lines = [f"{mid}: dead-lettered: {reason}" for mid, reason in run.dead_letters.items()]
        if run.unsettled:
            lines.append(run.unsettled)
        cause, explanation = (
            NOT_ONCE,
            (
                "applied once, one after the other, the samples must all be acked; fix the "
                "samples (or the handler) until they are"
            ),
        )
        escape = _first_escape(run)
        if escape is not None:
            cause, explanation = ESCAPED, _escaped_text(escape)
        return Finding("once", run.what, tuple(lines), cause, explanation)

    def _judge(self, scenario: str, base: _Run, run: _Run) -> Finding | None:
        diffs = compare(base.snapshot, run.snapshot, self.specs, self.volatile)
        lines = [line for diff in diffs for line in diff.lines("once")]
        for mid, reason in run.dead_letters.items():
            if mid not in base.dead_letters:
                lines.append(f"{mid}: dead-lettered here, not once: {reason}")
        if run.unsettled:
            lines.append(run.unsettled)
        effects = self._effects(base, run)
        lines.extend(effects)
        calls = self._calls(base, run)
        lines.extend(calls)
        if not lines:
            return None
        cause, explanation = self._cause(scenario, run, diffs, bool(effects or calls))
        return Finding(scenario, run.what, tuple(lines), cause, explanation)

    def _effects(self, base: _Run, run: _Run) -> list[str]:
        if self.effects is None:
            return []
        want, got = _comparable(base.effects), _comparable(run.effects)
        if want == got:
            return []
        return [f"effects: {show(got)} (once: {show(want)})"]

    def _calls(self, base: _Run, run: _Run) -> list[str]:
        if self.effects is not None:
            return []  # the user's record of effects is the precise one
        want, got = base.network(), run.network()
        return [
            f"network: {count} connections to {where} from inside a transaction handler "
            f"(once: {want[where]})"
            for where, count in sorted(got.items())
            if count > want[where]
        ]

    def _cause(
        self, scenario: str, run: _Run, diffs: list[TableDiff], effects: bool
    ) -> tuple[str, str]:
        escape = _first_escape(run)
        if escape is not None:
            return ESCAPED, _escaped_text(escape)
        if scenario == "writer" and diffs:
            unguarded = next((s for t in run.traces for s in t.unguarded), None)
            return NO_TOKEN, _no_token_text(diffs[0].table, unguarded)
        types = {m.type for m in self.messages}
        handlers = [h for t in types for h in self.handlers.for_type(t)]
        if effects:
            if any(h.runs is Runs.TRANSACTION for h in handlers):
                where = next((w for t in run.traces for w in t.network), "an outside service")
                return OUTSIDE_CLAIM, (
                    f"a handler called {where} from inside its transaction, so a rollback, "
                    "a crash or a redelivery makes the call again. Make the call a "
                    "@side_effect handler (a claim with a lease) and send "
                    "ctx.idempotency_key with it."
                )
            return REPEATED_CALL, (
                "the claim repeats a call whose outcome it never recorded; the provider "
                "counts it once only when it gets the same key: send ctx.idempotency_key."
            )
        renewed = [d for d in diffs if d.repeats and d.volatile]
        if renewed:
            diff = renewed[0]
            columns = ", ".join(sorted(diff.volatile))
            return NEW_ID, (
                f"{diff.table} got a row again that differs from the first only in "
                f"{columns}, whose values change from run to run (uuid4(), a clock): to its "
                "constraints the re-run's row is a new one. Derive the id from "
                "ctx.message_id (uuid5, as ctx.publish does), or publish with ctx.publish."
            )
        if scenario in ("twice", "twins", "lost-ack") and any(not h.inbox for h in handlers):
            return NO_INBOX, (
                "inbox=False skips the marker, so a duplicate runs the handler again: only "
                "an upsert of absolute values may opt out of the inbox."
            )
        if scenario == "crash" and any(d.extra or d.changed for d in diffs):
            return ESCAPED, (
                "the crashed attempt's change survived its rollback: something committed "
                "it on its own (another connection, engine or process). Write through "
                "ctx.session only."
            )
        if any(d.missing for d in diffs) or run.dead_letters:
            return LOST, (
                "a message was acked or dead-lettered without what applying it once writes: "
                "a swallowed error, or a decision taken from state another delivery left."
            )
        return UNKNOWN, ("the tables differ from applying each message once; the diff shows where.")

    def _static_no_token(self, unguarded: list[str]) -> Finding:
        return Finding(
            "writer",
            "a handler read a table, then wrote a row of it",
            tuple(f"unguarded write after a read: {sql}" for sql in dict.fromkeys(unguarded)),
            NO_TOKEN,
            "the UPDATE's WHERE is the primary key alone, with a value computed from what "
            "the handler read. On SQLite the inbox marker holds the one write lock, so no "
            "other writer can commit in between and nothing is lost here; on PostgreSQL "
            "another writer can, and its change is overwritten. Map a version column "
            "(__mapper_args__ = {'version_id_col': ...}); run the check on PostgreSQL "
            "(database=postgresql+asyncpg://...) to see the lost update.",
        )

    def _unseen(self, base: _Run) -> Finding | None:
        """Every scenario agreed, yet the probe saw a write escape: to a table or a
        database the check does not compare."""
        escape = _first_escape(base)
        if escape is None:
            return None
        return Finding(
            "once",
            base.what,
            ("no compared table shows it: the write went somewhere the check does not read",),
            ESCAPED,
            _escaped_text(escape),
        )


def _first_escape(run: _Run) -> Escape | None:
    return next((e for trace in run.traces for e in trace.escaped), None)


def _escaped_text(escape: Escape) -> str:
    return (
        f"{escape.sql} ran through another engine ({escape.engine}) while the handler's "
        "transaction was open: it commits on its own, so neither a rollback nor a "
        "duplicate's rejected marker undoes it. Write through ctx.session only."
    )


def _no_token_text(table: str, unguarded: str | None) -> str:
    write = f" ({unguarded})" if unguarded else ""
    return (
        f"another writer committed to {table} between the handler's read and its write"
        f"{write}, and the handler's write overwrote that change: its WHERE carries no "
        "version token. Map a version column (__mapper_args__ = {'version_id_col': ...}) "
        "or put the version read into the UPDATE's WHERE."
    )


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


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _wrap(text: str, width: int = 88) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines
