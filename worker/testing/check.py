"""``prove_idempotent``: a handler's sample messages through the races the worker exists
for, each run compared with a run that applies every message exactly once.

This module is the API: :class:`Sample`, :func:`prove_idempotent` and
:func:`check_idempotent`; :mod:`worker.testing.checker` runs the scenarios (its docstring
says what each does), :mod:`worker.testing.report` is what they say.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import MetaData

from worker.db import redact
from worker.registry import Registry, registry
from worker.testing.checker import Checker, Effects, Message, Setup
from worker.testing.harness import Body, Given, encode
from worker.testing.isolation import Isolation
from worker.testing.report import SCENARIOS, NotIdempotent, Report
from worker.testing.scratch import Scratch, scratch_for

__all__ = ["SCENARIOS", "Effects", "NotIdempotent", "Report", "Sample", "check_idempotent"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One message to deliver: its type, its body (a mapping, a model, JSON bytes), and
    optionally its id (default ``sample-<n>``) and headers."""

    type: str
    body: Body
    id: str | None = None
    headers: Mapping[str, Any] | None = None


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
    ``effects``: see :data:`Effects`; the calls the kit sees itself (HTTP requests,
    publishes, mails) are compared either way. ``settings``: Settings fields for the
    pumps.
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
    served = handlers if handlers is not None else registry
    setup = Setup(
        served,
        Isolation(served),
        given,
        tuple(models),
        effects,
        dict(settings),
        settle_within,
        writer_wait,
    )
    async with scratch_for(database) as scratch:
        await Checker(messages, scratch, setup).check(chosen, report, tables)
    report.seconds = time.perf_counter() - started
    return report


def _describe(database: str | Scratch) -> str:
    if isinstance(database, str):
        return f"PostgreSQL ({redact(database)})"
    return type(database).__name__.removesuffix("Scratch") or "a scratch database"


def _messages(samples: Sequence[Sample | Mapping[str, Any]]) -> list[Message]:
    found = []
    for n, sample in enumerate(samples, 1):
        if not isinstance(sample, Sample):
            sample = Sample(sample["type"], sample["body"], sample.get("id"), sample.get("headers"))
        found.append(
            Message(
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
