"""``WORKER_HANDLERS=tests.rabbitmq.naive_handlers``: the check-then-insert handler.

No unique constraint, no version token: the design notes' broken baseline, run
through the same real pump and broker so the acceptance test can show it fail.
Its tables (``naive_accounts``, ``naive_inbox``) are created by the test with
plain SQL. Only worker processes import this module: importing it registers the
handler in the process's default registry, beside the shipped ones.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

from pydantic import BaseModel
from sqlalchemy import text

from worker import Context, handler


class NaiveCredit(BaseModel):  # its own model: importing handlers.credit would register it too
    account_id: str
    amount: Decimal


@handler("CreditRequested", NaiveCredit, consumer="naive", inbox=False)
async def naive_credit(ctx: Context, message: NaiveCredit) -> None:
    session = ctx.session
    seen = text("SELECT 1 FROM naive_inbox WHERE message_id = :m")
    if (await session.execute(seen, {"m": ctx.message_id})).first() is not None:
        return
    await asyncio.sleep(0.002)  # the work between check and save: where the race lives
    balance = await session.scalar(
        text("SELECT balance FROM naive_accounts WHERE id = :a"), {"a": message.account_id}
    )
    await session.execute(
        text("UPDATE naive_accounts SET balance = :b WHERE id = :a"),
        {"b": (balance or Decimal(0)) + message.amount, "a": message.account_id},
    )
    await session.execute(
        text("INSERT INTO naive_inbox (message_id) VALUES (:m)"), {"m": ctx.message_id}
    )
