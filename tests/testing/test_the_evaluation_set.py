"""The prover on its evaluation set (tests/testing/evaluation.py), on SQLite and on
PostgreSQL: at least 90 % of the wrong handlers fail with a cause that names their
mistake, and no correct handler fails.

The whole set takes minutes and is marked slow (CI runs it); the default suite runs the
cases marked ``default``: on SQLite one or two of each class the checks of
test_the_checker_names_each_mistake.py do not already cover, on PostgreSQL those where the
databases behave differently (a real writer, a driver connection of its own). Run with
``-s`` to see the table: handler, class, wrong or correct, and what the checker said.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import pytest

from tests.support.services import require_service
from tests.testing import evaluation
from tests.testing.apis import RecordingAPI
from tests.testing.evaluation import CASES, MODELS, Case
from worker.testing import Report, Scratch, check_idempotent

BAR = 0.9


@dataclass(frozen=True, slots=True)
class Result:
    case: Case
    report: Report
    seconds: float

    @property
    def cause(self) -> str | None:
        return self.report.finding.cause if self.report.finding is not None else None

    @property
    def right(self) -> bool:
        """A wrong handler failed with its cause named; a correct one passed."""
        if self.case.wrong:
            return self.cause in self.case.causes
        return self.report.ok

    def row(self, database: str) -> str:
        verdict = "passed" if self.report.ok else f"FAIL: {self.cause}"
        mark = "" if self.right else "  <-- wrong"
        kind = "wrong" if self.case.wrong else "correct"
        return (
            f"| {self.case.name} | {self.case.kind} | {kind} | {database} | {verdict}{mark} "
            f"| {self.seconds:.1f}s |"
        )


async def evaluate(cases: Sequence[Case], scratch: Scratch, database: str) -> list[Result]:
    results = []
    for case in cases:
        evaluation.forget()  # each check as in a process of its own
        started = time.perf_counter()
        report = await check_idempotent(
            case.samples,
            handlers=case.handlers,
            models=MODELS,
            given=case.given,
            database=scratch,
        )
        results.append(Result(case, report, time.perf_counter() - started))
    print(f"\n| handler | class | wrong/correct | database | checker | time |\n|{'---|' * 6}")
    for result in results:
        print(result.row(database))
    return results


def holds_the_bar(results: list[Result]) -> None:
    wrong = [r for r in results if r.case.wrong]
    named = [r for r in wrong if r.right]
    failed_correct = [r for r in results if not r.case.wrong and not r.report.ok]
    missed = "\n\n".join(str(r.report) for r in wrong if not r.right)
    assert len(named) >= BAR * len(wrong), f"{len(named)} of {len(wrong)} named:\n{missed}"
    assert failed_correct == [], "\n\n".join(str(r.report) for r in failed_correct)


@pytest.fixture
async def outside(payments: RecordingAPI) -> AsyncIterator[None]:
    """The payment API the charging cases call; the clients some cases keep open."""
    try:
        yield
    finally:
        await evaluation.close_clients()


def scratch_of(request: pytest.FixtureRequest, database: str) -> Scratch:
    name = {"sqlite": "kit_sqlite", "postgresql": "kit_postgres"}[database]
    scratch: Scratch = request.getfixturevalue(name)
    return scratch


def chosen(cases: Sequence[Case]) -> list[Case]:
    """The cases whose services are here; RabbitMQ's skip (or, under CI, fail) otherwise."""
    if any("rabbitmq" in case.needs for case in cases):
        require_service("127.0.0.1", 5672, "RabbitMQ")
    return list(cases)


@pytest.mark.usefixtures("outside", "audit_engines")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_a_representative_part(database: str, request: pytest.FixtureRequest) -> None:
    part = chosen([case for case in CASES if database in case.default])
    assert {c.wrong for c in part} == {True, False}
    holds_the_bar(await evaluate(part, scratch_of(request, database), database))


@pytest.mark.slow
@pytest.mark.usefixtures("outside", "audit_engines")
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_the_whole_set(database: str, request: pytest.FixtureRequest) -> None:
    cases = chosen(CASES)
    assert len(cases) >= 24
    holds_the_bar(await evaluate(cases, scratch_of(request, database), database))
