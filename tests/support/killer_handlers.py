"""``WORKER_HANDLERS=tests.support.killer_handlers``: the reference credit handler, keyed by
account as shipped, for messages of type ``Credit``; a message whose id is in
``WORKER_TEST_KILLERS`` (comma-separated) ends the process at once instead, as an
out-of-memory kill, a segfault in a C extension or an eviction would (``os._exit(137)``:
no cleanup, nothing settled). Each run of a killer first appends its id to the file named
by ``WORKER_TEST_DEATHS``, so a test can count who died how often."""

from __future__ import annotations

import os
from pathlib import Path

from handlers.credit import CreditRequested, apply_credit
from worker import Context, handler

KILLERS = frozenset(filter(None, os.environ.get("WORKER_TEST_KILLERS", "").split(",")))
DEATHS = os.environ.get("WORKER_TEST_DEATHS")


@handler("Credit", CreditRequested, consumer="credit-or-die", key=lambda m: m.account_id)
async def credit_or_die(ctx: Context, message: CreditRequested) -> None:
    if ctx.message_id in KILLERS:
        if DEATHS:  # a few bytes to a local file, then the end: nothing async matters now
            with Path(DEATHS).open("a") as out:  # noqa: ASYNC230
                out.write(f"{ctx.message_id} {ctx.delivery_count}\n")
        os._exit(137)
    await apply_credit(ctx, message)
