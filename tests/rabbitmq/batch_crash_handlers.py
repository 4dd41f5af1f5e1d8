"""``WORKER_HANDLERS=tests.rabbitmq.batch_crash_handlers``: the credit handler, unkeyed (so
batch mode batches it, one savepoint each), a set-based batch handler (``BatchUpsert``), and
with ``WORKER_TEST_HOLD_ACKS=<seconds>`` every batch waits that long between its commit and its
acks: the window a SIGKILL is aimed at."""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from collections.abc import Sequence
from decimal import Decimal

from sqlalchemy import Numeric, bindparam, text

from handlers.credit import CreditRequested, apply_credit
from worker import handler
from worker.context import BatchContext
from worker.logs import get_logger

# its own type: importing handlers.credit registers the keyed CreditRequested handler too
handler("BatchCredit", CreditRequested, consumer="batch-credit")(apply_credit)

_UPSERT = text(
    "INSERT INTO accounts (id, balance, version) VALUES (:a, :x, 1) "
    "ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + excluded.balance, "
    "version = accounts.version + 1"
).bindparams(bindparam("x", type_=Numeric(18, 2)))


@handler("BatchUpsert", CreditRequested, consumer="batch-upsert", batch=True)
async def upsert_credits(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
    """Set-based: one atomic upsert per account, accounts in a fixed order (no deadlocks)."""
    totals: dict[str, Decimal] = defaultdict(Decimal)
    for message in messages:
        totals[message.account_id] += message.amount
    for account, amount in sorted(totals.items()):
        await ctx.session.execute(_UPSERT, {"a": account, "x": amount})


HOLD = os.environ.get("WORKER_TEST_HOLD_ACKS", "")
if HOLD:
    from worker.intake import Work
    from worker.settle import Settlement
    from worker.verdict import Verdict

    settle = Settlement.work

    async def held(self: Settlement, work: Work, verdicts: list[Verdict]) -> None:
        # every unit of work (a type's first runs alone, the next ones share groups)
        get_logger().info("batch committed, acks held", size=len(work.items))
        await asyncio.sleep(float(HOLD))
        await settle(self, work, verdicts)

    Settlement.work = held  # type: ignore[method-assign]
