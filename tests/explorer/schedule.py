"""A schedule: one run's workload and faults, every choice drawn from one seed.

``generate(seed)`` is a pure function of the seed (its own ``random.Random``, nothing read
from the clock or the environment), so a failing run is replayed by its seed alone. What
the seed does not fix is the interleaving the event loop and the database's I/O choose;
faults are therefore pinned to what a replay meets again in the same order: a message's
Nth handler invocation, the Nth statement the worker sends, the Nth settlement.

A message's ``plan`` says what its handler does on its 1st, 2nd, ... invocation (nothing,
or an :class:`Action`); ``always`` what it does on every invocation after the plan. A
message with an ``always`` can never succeed: it is invalid, and must end dead-lettered.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

DATABASES = ("sqlite", "postgresql")
KEYS = ("k0", "k1", "k2", "k3")
GROUPS = 3

RAISES = ("RuntimeError", "CancelledError", "Abort")
"""What a handler raises: an ordinary exception, a cancellation that is not the worker's
own, and a BaseException subclass that is neither (tests/explorer/workload.py ``Abort``)."""

SQLSTATES = {
    # each class worker/db.py classify tells apart, as the real server raises it
    "postgresql": (
        "40001",  # serialization failure: retried in process
        "40P01",  # deadlock: retried in process
        "08006",  # connection failure while the server answers pings
        "57P01",  # the server terminates this backend (pg_terminate_backend)
        "3D000",  # no such database
        "53300",  # too many connections
        "25006",  # read-only transaction
        "42501",  # a row-level security policy refuses the row
        "53100",  # disk full
        "53400",  # temp_file_limit exceeded (a real sort over the limit)
        "42P01",  # a table the handler names is missing
        "55P03",  # lock_timeout
        "23505",  # a business unique constraint, not the inbox's
    ),
    "sqlite": (
        "40001",  # "database is locked"
        "08006",  # "unable to open database file"
        "25006",  # "attempt to write a readonly database"
        "53100",  # SQLITE_FULL: a real write larger than the room left
        "42P01",  # a real missing table
        "23505",  # a real business unique violation
    ),
}

OWN_FAILURES = frozenset(
    {"RuntimeError", "CancelledError", "Abort", "22P02", "22003", "23505", "42P01", "42501",
     "53400"}
)  # fmt: skip
"""Outcomes that are the message's own failure: each may spend one delivery. A row a
security policy refuses (42501 with its "row-level security" text) and one query over
``temp_file_limit`` (53400) are the message's, as worker/db.py judges them (issue 31,
defect 6); a missing privilege (42501 on a table) would be the environment's."""

INVALID = {
    # what an invalid message does on every invocation, by database (a value the database
    # refuses, SQLSTATE class 22, is dead-lettered at its first occurrence: only here)
    "postgresql": ("RuntimeError", "CancelledError", "Abort", "22P02", "23505", "53400", "42501",
                   "40001", "25006", "die"),
    "sqlite": ("RuntimeError", "CancelledError", "Abort", "22003", "23505", "53100", "40001",
               "25006", "die"),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Action:
    """What a handler invocation does before its write: ``raise`` (``code`` the class),
    ``sqlstate`` (a statement fails with ``code``), ``outage`` (the database becomes
    unreachable for ``seconds``: ``code`` refuse, reset or blackhole, then a statement),
    ``die`` (the process dies in the handler and restarts), or ``session`` (PostgreSQL:
    the handler sets its connection's session isolation to ``code``, and succeeds)."""

    kind: str
    code: str = ""
    seconds: float = 0.0

    @property
    def own(self) -> bool:
        """Whether this ending is the message's own failure (it may spend a delivery)."""
        return self.kind == "die" or self.code in OWN_FAILURES

    def __str__(self) -> str:
        if self.kind == "raise":
            return f"raise {self.code}"
        if self.kind == "sqlstate":
            return f"SQLSTATE {self.code}"
        if self.kind == "outage" and self.code == "reset":
            return "reset the database's connections"
        if self.kind == "outage":
            return f"{self.code} the database for {self.seconds}s"
        if self.kind == "session":
            return f"leave the connection in {self.code}"
        return "the process dies"


@dataclass(frozen=True, slots=True)
class Message:
    id: str
    type: str  # "Op": an ordinary handler, keyed; "Bulk": a batch handler
    key: str | None = None
    group: int | None = None
    copies: int = 1  # 2: a producer's retry, the same id twice
    to_all: bool = False  # one copy to each pump at once
    delivered_before: int = 0  # it arrives as a redelivery
    plan: tuple[Action | None, ...] = ()
    always: Action | None = None

    @property
    def valid(self) -> bool:
        return self.always is None

    def action(self, invocation: int) -> Action | None:
        """What the ``invocation``-th call of its handler does (1-based)."""
        if invocation <= len(self.plan):
            return self.plan[invocation - 1]
        return self.always

    def describe(self) -> str:
        parts = [self.type]
        if self.key is not None:
            parts.append(f"key={self.key}")
        if self.group is not None:
            parts.append(f"group={self.group}")
        if self.copies > 1:
            parts.append(f"copies={self.copies}")
        if self.to_all:
            parts.append("to_all")
        if self.delivered_before:
            parts.append(f"delivered_before={self.delivered_before}")
        if any(self.plan):
            steps = ", ".join(f"#{n}: {a}" for n, a in enumerate(self.plan, 1) if a is not None)
            parts.append(f"plan[{steps}]")
        if self.always is not None:
            parts.append(f"always[{self.always}]")
        return f"{self.id} " + " ".join(parts)


@dataclass(frozen=True, slots=True)
class StatementFault:
    """The ``n``-th statement the workers send (counted from the workload's start) meets
    ``kind``: ``lost`` (its connection drops), ``outage`` (the database becomes unreachable
    for ``seconds``), ``blackhole`` (PostgreSQL: no byte moves for ``seconds``) or
    ``cancel`` (the statement raises CancelledError: a cancellation not the worker's own)."""

    n: int
    kind: str
    seconds: float = 0.0

    def __str__(self) -> str:
        timed = f" for {self.seconds}s" if self.seconds else ""
        return f"statement #{self.n}: {self.kind}{timed}"


@dataclass(frozen=True, slots=True)
class Death:
    """Pump ``pump`` dies (its consumer crashes, the broker takes its deliveries back) when
    the broker has seen ``after`` settlements; a new pump takes its place."""

    after: int
    pump: int

    def __str__(self) -> str:
        return f"pump {self.pump} dies after {self.after} settlements"


@dataclass(frozen=True, slots=True)
class Schedule:
    seed: int
    database: str
    batch_size: int
    pumps: int
    concurrency: int
    max_deliveries: int
    max_give_backs: int
    audit: bool  # a second handler (its own consumer) on Op
    messages: tuple[Message, ...]
    statement_faults: tuple[StatementFault, ...] = ()
    deaths: tuple[Death, ...] = ()
    outage_seconds: float = field(init=False)

    def __post_init__(self) -> None:
        seconds = sum(f.seconds for f in self.statement_faults)
        for message in self.messages:
            seconds += sum(a.seconds for a in message.plan if a is not None)
        object.__setattr__(self, "outage_seconds", seconds)

    @property
    def deadline(self) -> float:
        """Seconds the workload may take to settle for good: generous for the timed pauses
        and give-back delays a correct pump takes, short of a loop that never ends."""
        dying = sum(1 for m in self.messages for a in (*m.plan, m.always) if a and a.kind == "die")
        return 25.0 + 2.0 * self.outage_seconds + 2.0 * (dying + len(self.deaths))

    def describe(self) -> str:
        mode = "per-message" if self.batch_size == 1 else f"batch_size={self.batch_size}"
        lines = [
            f"seed {self.seed}: {self.database}, {mode}, {self.pumps} pump(s), "
            f"concurrency={self.concurrency}, max_deliveries={self.max_deliveries}, "
            f"max_give_backs={self.max_give_backs}, audit handler={self.audit}, "
            f"{len(self.messages)} messages",
        ]
        lines += [f"  {fault}" for fault in self.statement_faults]
        lines += [f"  {death}" for death in self.deaths]
        lines += [f"  {m.describe()}" for m in self.messages if m.plan or m.always]
        plain = sum(1 for m in self.messages if not m.plan and not m.always)
        lines.append(f"  ... and {plain} messages without faults")
        return "\n".join(lines)


def generate(seed: int) -> Schedule:
    """The schedule of ``seed``: the same one on every machine and every run."""
    rng = random.Random(seed)
    database = rng.choice(DATABASES)
    pumps = rng.choice((1, 2))
    max_deliveries = rng.choice((3, 3, 4, 5))
    groups = rng.random() < 0.3
    count = rng.randint(24, 40)
    # how rough the schedule is: a light one shows what a quiet hour does to the pump
    rates = (rng.choice((0.05, 0.12, 0.25)), rng.choice((0.0, 0.02, 0.05)))
    messages = tuple(
        _message(rng, n, database, pumps, max_deliveries, groups, rates) for n in range(count)
    )
    faults = tuple(
        sorted(
            (_statement_fault(rng, database, count) for _ in range(rng.choice((0, 0, 1, 2)))),
            key=lambda f: f.n,
        )
    )
    deaths: tuple[Death, ...] = ()
    if rng.random() < 0.15:
        deaths = (Death(rng.randint(1, count), rng.randrange(pumps)),)
    return Schedule(
        seed=seed,
        database=database,
        batch_size=rng.choice((1, 8)),
        pumps=pumps,
        concurrency=rng.choice((2, 3, 4)),
        max_deliveries=max_deliveries,
        max_give_backs=rng.choice((3, 4)),
        audit=rng.random() < 0.3,
        messages=messages,
        statement_faults=faults,
        deaths=deaths,
    )


def _message(
    rng: random.Random,
    n: int,
    database: str,
    pumps: int,
    max_deliveries: int,
    groups: bool,
    rates: tuple[float, float],
) -> Message:
    faulty, invalid = rates
    op = rng.random() < 0.7
    copies = 2 if rng.random() < 0.1 else 1
    plan: tuple[Action | None, ...] = ()
    if rng.random() < faulty:
        length = rng.randint(1, 3)
        if rng.random() < 0.4:  # the same fault on each of its first invocations: flapping
            plan = (_action(rng, database),) * length
        else:
            plan = tuple(
                _action(rng, database) if rng.random() < 0.7 else None for _ in range(length)
            )
    always = None
    if not plan and rng.random() < invalid:  # no plan before: a blackhole lets it through
        code = rng.choice(INVALID[database])
        if code == "die":
            always = Action("die")
        elif code in RAISES:
            always = Action("raise", code)
        else:
            always = Action("sqlstate", code)
    return Message(
        id=f"m{n:02d}",
        type="Op" if op else "Bulk",
        key=rng.choice((*KEYS, None)) if op else None,
        group=rng.randrange(GROUPS) if groups else None,
        copies=copies,
        to_all=pumps == 2 and copies == 1 and rng.random() < 0.12,
        delivered_before=rng.randint(1, max_deliveries - 2) if rng.random() < 0.2 else 0,
        plan=plan,
        always=always,
    )


def _action(rng: random.Random, database: str) -> Action:
    kinds = ("raise", "sqlstate", "outage", "die", "session")
    kind = rng.choices(kinds, weights=(7, 6, 5, 1, 1 if database == "postgresql" else 0))[0]
    if kind == "raise":
        return Action("raise", rng.choice(("RuntimeError", *RAISES)))
    if kind == "sqlstate":
        return Action("sqlstate", rng.choice(SQLSTATES[database]))
    if kind == "outage":
        hows = ("refuse", "reset", "blackhole") if database == "postgresql" else ("refuse", "reset")
        how = rng.choice(hows)
        if how == "blackhole":  # shorter and longer than the handler timeout (2 s)
            return Action("outage", how, rng.choice((0.5, 2.5, 4.0)))
        return Action("outage", how, 0.0 if how == "reset" else rng.choice((0.3, 0.8, 1.5, 3.0)))
    if kind == "session":
        return Action("session", "REPEATABLE READ")
    return Action("die")


def _statement_fault(rng: random.Random, database: str, messages: int) -> StatementFault:
    kinds = ("lost", "outage", "cancel", "blackhole") if database == "postgresql" else (
        "lost", "outage", "cancel"
    )  # fmt: skip
    kind = rng.choice(kinds)
    seconds = 0.0
    if kind == "outage":
        seconds = rng.choice((0.3, 0.8, 1.5, 3.0))
    elif kind == "blackhole":
        seconds = rng.choice((0.5, 2.5, 4.0))
    return StatementFault(rng.randint(1, 5 * messages), kind, seconds)
