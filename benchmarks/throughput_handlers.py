"""``WORKER_HANDLERS=benchmarks.throughput_handlers``: worker rows of benchmarks/throughput.py.

``THROUGHPUT_VARIANT`` picks the one handler this process registers, for
``ThroughputCredit`` (a ``CreditRequested`` body under a type of its own: importing
:mod:`handlers.credit` registers the keyed reference handler for ``CreditRequested``
already). Unset, nothing is registered (an import for the functions alone).

- ``atomic``: per message, the hand-written consumer's atomic upsert through
  ``ctx.session`` (no read, no token check, nothing to conflict).
- ``reference``: :func:`handlers.credit.apply_credit` without ``key=``: with groups (the
  default, ``WORKER_BATCH_SIZE`` > 1) any key may then be in two groups at once, which
  then wait on each other's rows.
- ``set-based``: a batch handler (``batch=True``): the group's credits summed per
  account in Python, then one multi-row upsert for the whole group.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from decimal import Decimal

from sqlalchemy import text

from handlers.credit import CreditRequested, apply_credit
from worker import Context, handler
from worker.registry import BatchContext

MESSAGE_TYPE = "ThroughputCredit"
CONSUMER = "throughput-credit"
VARIANTS = ("atomic", "reference", "set-based")

# The hand-written consumer's statement (benchmarks/rabbitmq_vs_handwritten.py CREDIT).
# The version moves too, so an ORM writer of the same row still sees a conflict.
CREDIT = text(
    "INSERT INTO accounts (id, balance, version) VALUES (:a, :b, 1) ON CONFLICT (id) "
    "DO UPDATE SET balance = accounts.balance + EXCLUDED.balance, version = accounts.version + 1"
)
# Many rows at once: one row per account (ON CONFLICT may touch a row once per statement).
CREDIT_MANY = text(
    "INSERT INTO accounts (id, balance, version) SELECT a, b, 1 "
    "FROM unnest(CAST(:ids AS text[]), CAST(:amounts AS numeric[])) AS t(a, b) "
    "ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance, "
    "version = accounts.version + 1"
)


async def credit_atomic(ctx: Context, message: CreditRequested) -> None:
    await ctx.session.execute(CREDIT, {"a": message.account_id, "b": message.amount})


async def credit_set_based(ctx: BatchContext, messages: Sequence[CreditRequested]) -> None:
    """One statement for the group; accounts in a fixed order, so groups never deadlock."""
    totals: dict[str, Decimal] = {}
    for message in messages:
        totals[message.account_id] = totals.get(message.account_id, Decimal(0)) + message.amount
    ids = sorted(totals)
    params = {"ids": ids, "amounts": [totals[i] for i in ids]}
    await ctx.session.execute(CREDIT_MANY, params)


def _register(variant: str) -> None:
    if variant == "atomic":
        handler(MESSAGE_TYPE, CreditRequested, consumer=CONSUMER)(credit_atomic)
    elif variant == "reference":
        handler(MESSAGE_TYPE, CreditRequested, consumer=CONSUMER)(apply_credit)
    elif variant == "set-based":
        handler(MESSAGE_TYPE, CreditRequested, consumer=CONSUMER, batch=True)(credit_set_based)
    else:
        raise RuntimeError(f"THROUGHPUT_VARIANT={variant!r}: expected one of {VARIANTS}")


if os.environ.get("THROUGHPUT_VARIANT"):
    _register(os.environ["THROUGHPUT_VARIANT"])
