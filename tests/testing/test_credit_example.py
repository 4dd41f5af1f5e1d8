"""An example to copy: the shipped credit handler, tested the way the worker runs it.

In a project of your own, ``pip install idempotent-worker`` brings the pytest plugin (the
``worker_harness`` and ``worker_database`` fixtures); import the module that registers your
handler, deliver messages through the real pump, and let ``prove_idempotent`` throw the
races at it. ``pytest --worker-database postgresql+asyncpg://user@host/postgres`` runs the
same tests on throwaway PostgreSQL databases.
"""

from __future__ import annotations

from decimal import Decimal

import handlers.credit  # noqa: F401 - importing it registers the CreditRequested handler
from worker.testing import HarnessFactory, Sample, Scratch, prove_idempotent

CREDITS = [
    Sample("CreditRequested", {"account_id": "acct-1", "amount": "10.00"}),
    Sample("CreditRequested", {"account_id": "acct-1", "amount": "2.50"}),
]


async def test_a_credit_is_applied_once_however_often_it_arrives(
    worker_harness: HarnessFactory,
) -> None:
    credit = {"account_id": "acct-1", "amount": "10.00"}
    async with worker_harness() as worker:
        first = await worker.deliver("CreditRequested", credit, id="credit-1")
        retried = await worker.deliver("CreditRequested", credit, id="credit-1")
        twins = await worker.deliver_concurrently("CreditRequested", credit, id="credit-2")

        assert first.acked and first.outcomes == {"committed": 1}
        assert retried.acked and retried.outcomes == {"duplicate": 1}
        assert twins.outcomes == {"committed": 1, "duplicate": 1}
        [account] = await worker.rows("accounts")
        assert account["balance"] == Decimal("20.00")  # credit-1 once, credit-2 once


async def test_a_bad_credit_is_dead_lettered_with_its_reason(
    worker_harness: HarnessFactory,
) -> None:
    async with worker_harness() as worker:
        bad = await worker.deliver("CreditRequested", {"account_id": "acct-1", "amount": "ten"})
        assert bad.dead_letter is not None and "amount" in bad.dead_letter


async def test_the_credit_handler_is_idempotent(worker_database: Scratch) -> None:
    await prove_idempotent(CREDITS, database=worker_database)  # raises NotIdempotent if not
