"""``WORKER_HANDLERS=benchmarks.hot_rows_handlers``: the credit variants of benchmarks/hot_rows.py.

``HOT_ROWS_VARIANT`` picks the one handler this process registers for ``HotCredit``
(a ``CreditRequested`` body under its own type: importing :mod:`handlers.credit`
registers the reference handler for ``CreditRequested`` already, without a key).
One variant per process, because a single keyed handler changes the whole pump
(it prefetches three times the concurrency).

- ``reference``: :func:`handlers.credit.apply_credit`, read-modify-write under the
  version token; a conflict re-runs the attempt on a fresh session.
- ``keyed``: the same function, serialized per account inside the process.
- ``for-update``: reads the row with ``SELECT ... FOR UPDATE``: writers of one row
  queue on its lock in the database instead of colliding on its token.
- ``atomic``: one ``UPDATE ... SET balance = balance + :amount``; the database adds,
  nothing is read, nothing conflicts.
- ``keyed-for-update``: ``for-update`` serialized per account inside the process, so
  each process has at most one transaction waiting for a row's lock.
"""

from __future__ import annotations

import os

from sqlalchemy import select, text

from handlers.credit import Account, CreditRequested, apply_credit
from worker import Context, handler

MESSAGE_TYPE = "HotCredit"
VARIANTS = ("reference", "keyed", "for-update", "atomic", "keyed-for-update")

# The version moves too: an ORM writer that read the row before this statement must
# see a conflict, or its write (balance it read + its amount) would erase this one.
ATOMIC_CREDIT = text(
    "UPDATE accounts SET balance = balance + :amount, version = version + 1 "
    "WHERE id = :id RETURNING id"
)


async def credit_for_update(ctx: Context, message: CreditRequested) -> None:
    """Lock the row first: later writers of it wait for this commit instead of conflicting."""
    query = select(Account).where(Account.id == message.account_id).with_for_update()
    account = await ctx.session.scalar(query)
    if account is None:  # the first credit creates the account, as the reference does
        await apply_credit(ctx, message)
        return
    account.balance += message.amount


async def credit_atomic(ctx: Context, message: CreditRequested) -> None:
    """Let the database add: no read, no token check, no conflict to retry."""
    params = {"amount": message.amount, "id": message.account_id}
    if await ctx.session.scalar(ATOMIC_CREDIT, params) is None:  # no such account yet
        await apply_credit(ctx, message)


def _register(variant: str) -> None:
    consumer = f"hot-{variant}"
    if variant == "reference":
        handler(MESSAGE_TYPE, CreditRequested, consumer=consumer)(apply_credit)
    elif variant == "keyed":
        keyed = handler(
            MESSAGE_TYPE, CreditRequested, consumer=consumer, key=lambda m: m.account_id
        )
        keyed(apply_credit)
    elif variant == "for-update":
        handler(MESSAGE_TYPE, CreditRequested, consumer=consumer)(credit_for_update)
    elif variant == "atomic":
        handler(MESSAGE_TYPE, CreditRequested, consumer=consumer)(credit_atomic)
    elif variant == "keyed-for-update":
        keyed = handler(
            MESSAGE_TYPE, CreditRequested, consumer=consumer, key=lambda m: m.account_id
        )
        keyed(credit_for_update)
    else:
        raise RuntimeError(f"HOT_ROWS_VARIANT={variant!r}: expected one of {', '.join(VARIANTS)}")


_register(os.environ.get("HOT_ROWS_VARIANT", "reference"))
