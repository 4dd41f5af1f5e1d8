"""The checker names each of the four mistakes tests/testing/wrong_handlers.py makes on
purpose, in the scenario where it shows, and passes each one's fix.

A mistake the checker misses fails its test; a checker that flags everything fails the
fix's. Both databases where the mistake shows on both; the lost update of a token-less
read-modify-write happens only on PostgreSQL (on SQLite the inbox marker's write lock lets
no other writer in), so there the checker names it from the statement instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from tests.testing import wrong_handlers as wrong
from tests.testing.apis import RecordingAPI
from worker.registry import Registry
from worker.testing import (
    ESCAPED,
    NEW_ID,
    NO_TOKEN,
    OUTSIDE_CLAIM,
    Report,
    Sample,
    Scratch,
    check_idempotent,
)
from worker.testing.scratch import PostgresScratch

MODELS = [wrong.Base.metadata]
CREDITS = [
    Sample("WalletCredited", {"wallet_id": "w-1", "amount": "5.00"}),
    Sample("WalletCredited", {"wallet_id": "w-1", "amount": "1.25"}),
]
STOCK = [
    ("wrong_stock", {"sku": "s-1", "available": 10}),
    ("wrong_guarded_stock", {"sku": "s-1", "available": 10, "version": 1}),
]
RESERVATIONS = [
    Sample("StockReserved", {"sku": "s-1", "quantity": 2}),
    Sample("StockReserved", {"sku": "s-1", "quantity": 3}),
]
CHARGE = [Sample("ChargeCard", {"card": "c-1", "amount": "9.99"})]
RENAME = [Sample("ProfileRenamed", {"profile_id": "p-1", "name": "Ada"})]


async def check(
    handlers: Registry, samples: list[Sample], database: Scratch, **options: Any
) -> Report:
    return await check_idempotent(
        samples, handlers=handlers, models=MODELS, database=database, **options
    )


def named(report: Report, cause: str, scenario: str) -> str:
    assert report.finding is not None, f"the checker found nothing:\n{report}"
    assert (report.finding.cause, report.finding.scenario) == (cause, scenario), str(report)
    return str(report)


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("audit_engines")
async def test_a_write_through_a_second_engine_is_named(kit_database: Scratch) -> None:
    report = await check(wrong.ESCAPING, CREDITS, kit_database)
    if isinstance(kit_database, PostgresScratch):
        # the audit row a crashed attempt wrote through its own engine outlives the rollback
        text = named(report, ESCAPED, "crash")
        assert "wrong_audit:" in text and "(extra)" in text
    else:
        # SQLite has one writer, the pump's transaction: the kit fails the write at once
        text = named(report, ESCAPED, "once")
        assert "EscapedWrite" in text
    assert "INSERT INTO wrong_audit" in text and "through another engine" in text


@pytest.mark.usefixtures("audit_engines")
async def test_a_write_to_a_database_the_check_does_not_read_is_named(
    kit_sqlite: Scratch, tmp_path: Path
) -> None:
    """No compared table shows the audit rows in a database of their own: the statement
    through another engine is named all the same."""
    audit = f"sqlite+aiosqlite:///{tmp_path / 'audit.db'}"
    engine = create_async_engine(audit)
    async with engine.begin() as connection:
        await connection.run_sync(wrong.Base.metadata.create_all)
    await engine.dispose()
    wrong.AUDIT_DATABASE["url"] = audit
    report = await check(wrong.ESCAPING_ELSEWHERE, CREDITS, kit_sqlite)
    text = named(report, ESCAPED, "once")
    assert "no compared table shows it" in text and "audit.db" in text
    assert [o.passed for o in report.outcomes[1:]] == [True] * 5  # every scenario agreed


@pytest.mark.timeout(300)
async def test_the_same_writes_through_the_session_pass(kit_database: Scratch) -> None:
    report = await check(wrong.ESCAPING_FIXED, CREDITS, kit_database)
    assert report.ok, str(report)


@pytest.mark.timeout(300)
async def test_a_read_modify_write_without_a_version_token_is_named(kit_database: Scratch) -> None:
    report = await check(wrong.RACY, RESERVATIONS, kit_database, given=STOCK)
    text = named(report, NO_TOKEN, "writer")
    assert "UPDATE wrong_stock SET available" in text or "wrong_stock:" in text
    if isinstance(kit_database, PostgresScratch):
        # the real lost update: 10 - 2 - 3 with both writers' reservations, 5 without one
        assert "wrong_stock:" in text and "available 0 (once) -> 5" in text
    else:
        assert "unguarded write after a read: UPDATE wrong_stock" in text


@pytest.mark.timeout(300)
async def test_the_same_write_with_a_version_token_passes(kit_database: Scratch) -> None:
    report = await check(wrong.RACY_FIXED, RESERVATIONS, kit_database, given=STOCK)
    assert report.ok, str(report)
    writer = next(o for o in report.outcomes if o.scenario == "writer")
    if isinstance(kit_database, PostgresScratch):
        assert writer.note == "2 writers raced"  # the race ran, and the token won it


@pytest.mark.timeout(300)
async def test_the_same_write_under_a_row_lock_passes(kit_database: Scratch) -> None:
    """with_for_update(): on PostgreSQL the writer waits for the handler's commit; SQLite
    leaves FOR UPDATE out of its SQL, and the checker still sees that the read locked."""
    report = await check(wrong.RACY_LOCKED, RESERVATIONS, kit_database, given=STOCK)
    assert report.ok, str(report)


async def test_an_http_call_outside_a_claim_is_named(
    payments: RecordingAPI, kit_sqlite: Scratch
) -> None:
    report = await check(wrong.CHARGING, CHARGE, kit_sqlite)
    text = named(report, OUTSIDE_CLAIM, "crash")
    assert f"connections to {payments.url.split('/')[2]}" in text
    assert payments.calls >= 3  # once, once, and the crashed attempt's call repeated


async def test_an_http_call_outside_a_claim_is_named_from_the_effects(
    payments: RecordingAPI, kit_sqlite: Scratch
) -> None:
    report = await check(wrong.CHARGING, CHARGE, kit_sqlite, effects=payments.drain)
    text = named(report, OUTSIDE_CLAIM, "crash")
    assert "effects:" in text


async def test_the_same_call_under_a_claim_passes(
    payments: RecordingAPI, kit_sqlite: Scratch
) -> None:
    payments.dedup = True  # the fix sends ctx.idempotency_key, which the provider honours
    report = await check(wrong.CHARGING_FIXED, CHARGE, kit_sqlite, effects=payments.drain)
    assert report.ok, str(report)


async def test_a_new_uuid4_for_an_outbox_event_on_every_attempt_is_named(
    kit_database: Scratch,
) -> None:
    report = await check(wrong.RENAMING, RENAME, kit_database)
    text = named(report, NEW_ID, "twice")
    assert "outbox:" in text and "message_id" in text


async def test_the_same_event_through_ctx_publish_passes(kit_database: Scratch) -> None:
    report = await check(wrong.RENAMING_FIXED, RENAME, kit_database)
    assert report.ok, str(report)
