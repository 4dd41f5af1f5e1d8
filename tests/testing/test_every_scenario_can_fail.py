"""Each scenario on its own finds a handler that its duplicates break: none is a check that
cannot fail. The handler: an upsert without the inbox that adds an outbox row of its own
with a new uuid4() each time (tests/testing/wrong_handlers.py, RENAMING); every scenario
that runs it twice leaves a second event."""

from __future__ import annotations

import pytest

from tests.testing import wrong_handlers as wrong
from tests.testing.apis import RecordingAPI
from worker.testing import NEW_ID, NO_TOKEN, OUTSIDE_CLAIM, Sample, Scratch, check_idempotent

RENAME = [Sample("ProfileRenamed", {"profile_id": "p-1", "name": "Ada"})]


@pytest.mark.parametrize("scenario", ["twice", "twins", "lost-ack"])
async def test_the_scenario_alone_names_the_new_id(scenario: str, kit_sqlite: Scratch) -> None:
    report = await check_idempotent(
        RENAME,
        handlers=wrong.RENAMING,
        models=[wrong.Base.metadata],
        database=kit_sqlite,
        scenarios=[scenario],
    )
    assert report.finding is not None, str(report)
    assert (report.finding.scenario, report.finding.cause) == (scenario, NEW_ID), str(report)


async def test_the_crash_scenario_alone_names_the_call_it_repeats(
    payments: RecordingAPI, kit_sqlite: Scratch
) -> None:
    report = await check_idempotent(
        [Sample("ChargeCard", {"card": "c-1", "amount": "9.99"})],
        handlers=wrong.CHARGING,
        models=[wrong.Base.metadata],
        database=kit_sqlite,
        scenarios=["crash"],
    )
    assert report.finding is not None, str(report)
    assert (report.finding.scenario, report.finding.cause) == ("crash", OUTSIDE_CLAIM)


async def test_the_writer_scenario_alone_names_the_missing_token(kit_sqlite: Scratch) -> None:
    report = await check_idempotent(
        [Sample("StockReserved", {"sku": "s-1", "quantity": 2})],
        handlers=wrong.RACY,
        models=[wrong.Base.metadata],
        database=kit_sqlite,
        given=[("wrong_stock", {"sku": "s-1", "available": 10})],
        scenarios=["writer"],
    )
    assert report.finding is not None, str(report)
    assert (report.finding.scenario, report.finding.cause) == ("writer", NO_TOKEN)
