"""What a check says: the outcome of each scenario, the first difference with its likely
cause, and what the comparison left out; ``str(report)`` is what ``worker check`` prints."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

SCENARIOS: Mapping[str, str] = {
    "twice": "each message twice, one after the other",
    "twins": "twins at the same moment on two pumps",
    "replicas": "each message on the other replica than the one before",
    "crash": "a crash at every statement boundary, then a redelivery",
    "writer": "a concurrent writer between the handler's read and its write",
    "race": "two different messages at once, one reading before the other commits",
    "order": "newer before older: samples that carry a sequence, newest first",
    "late": "every message redelivered late, newest first, after all the others",
    "lost-ack": "a lost ack: redelivered after its commit",
}
ONCE = "each message applied exactly once"


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
        out.extend(f"  {line}" for line in wrap(self.explanation))
        return out


@dataclass(frozen=True, slots=True)
class Outcome:
    scenario: str
    runs: int
    passed: bool | None  # None: not run
    note: str = ""


@dataclass(slots=True)
class Report:
    """What ``prove_idempotent`` found; ``str(report)`` is what ``worker check`` prints.

    ``left_out``: every column and effect no comparison reads, and why; and what each
    replica got of the handler modules' state of its own."""

    samples: int
    database: str
    outcomes: list[Outcome] = field(default_factory=list)
    finding: Finding | None = None
    runs: int = 0
    seconds: float = 0.0
    left_out: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.finding is None

    def __str__(self) -> str:
        lines = [
            f"worker check: {count(self.samples, 'sample message')} on {self.database}, "
            f"{self.runs} runs in {self.seconds:.1f}s"
        ]
        for outcome in self.outcomes:
            mark = {True: "ok  ", False: "FAIL", None: "-   "}[outcome.passed]
            title = SCENARIOS.get(outcome.scenario, ONCE)
            note = f" ({outcome.note})" if outcome.note else ""
            if outcome.passed is None:
                note = " (not run)"
            lines.append(f"  {mark}  {title}{note}")
            if outcome.scenario == "once":
                for line in self.left_out:
                    lines.extend(f"          {part}" for part in wrap(line, 80, indent="  "))
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


def count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def wrap(text: str, width: int = 88, indent: str = "") -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = indent + word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines
