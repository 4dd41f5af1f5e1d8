"""The handlers shipped in handlers/ pass every scenario, served from the registry ``@handler``
fills (as ``worker run`` and ``worker check`` serve them)."""

from __future__ import annotations

import pytest

import handlers
from tests.testing.apis import RecordingAPI
from worker.registry import registry
from worker.testing import SCENARIOS, Sample, Scratch, prove_idempotent

assert handlers.__all__  # imported for its registrations


def served(message_type: str, *consumers: str) -> None:
    """The default registry serves exactly the shipped handler for this type (a test that
    registered another one there would make this check something else)."""
    assert [h.consumer for h in registry.for_type(message_type)] == list(consumers)


@pytest.mark.timeout(300)
async def test_the_credit_handler_passes(kit_database: Scratch) -> None:
    served("CreditRequested", "credit")
    samples = [
        Sample("CreditRequested", {"account_id": "acct-1", "amount": "10.00"}),
        Sample("CreditRequested", {"account_id": "acct-1", "amount": "2.50"}),
        Sample("CreditRequested", {"account_id": "acct-2", "amount": "7.25"}),
    ]
    report = await prove_idempotent(samples, database=kit_database)
    assert [o.passed for o in report.outcomes] == [True] * (len(SCENARIOS) + 1)


@pytest.mark.timeout(300)
async def test_the_pricing_handler_passes(kit_database: Scratch) -> None:
    served("ChangeProductPrice", "pricing")
    product = {"id": "p-1", "name": "Widget", "price": "9.99", "version": 1}
    samples = [
        Sample(
            "ChangeProductPrice", {"product_id": "p-1", "price": "12.50", "expected_version": 1}
        ),
        # decided on version 1 too: a precondition failure, recorded and acked
        Sample(
            "ChangeProductPrice", {"product_id": "p-1", "price": "11.00", "expected_version": 1}
        ),
        Sample(
            "ChangeProductPrice", {"product_id": "p-1", "price": "13.00", "expected_version": 2}
        ),
    ]
    await prove_idempotent(samples, database=kit_database, given=[("products", product)])


async def test_the_welcome_email_handler_passes(
    mail_api: RecordingAPI, kit_sqlite: Scratch
) -> None:
    served("SendWelcomeEmail", "welcome-email")
    samples = [Sample("SendWelcomeEmail", {"user_id": "u-1", "email": "u-1@example.com"})]
    report = await prove_idempotent(samples, database=kit_sqlite, effects=mail_api.drain)
    assert report.ok
    assert mail_api.calls > report.runs  # the crashes made it call again, with the same key
