"""Test-only handlers for ``worker run`` (WORKER_HANDLERS=tests.kafka.crash_handlers).

``Step`` appends its tag to the file named by ``CRASH_RUNS`` (one line per handler
run, written before anything else happens), then, for a tag starting with ``boom``,
SIGKILLs its own process: a record that kills every worker that runs it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from pydantic import BaseModel

from worker import Context, handler


class Step(BaseModel):
    tag: str


@handler("Step", Step, consumer="step")
async def step(ctx: Context, message: Step) -> None:
    runs = os.environ.get("CRASH_RUNS")
    if runs:  # a few bytes to a local file: blocking for microseconds is fine here
        with Path(runs).open("a") as out:  # noqa: ASYNC230
            out.write(f"{message.tag}\n")
    if message.tag.startswith("boom"):
        os.kill(os.getpid(), signal.SIGKILL)
