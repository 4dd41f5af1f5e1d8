"""The checker names each of the mistakes tests/testing/wrong_handlers.py makes on purpose,
in the scenario where it shows, and passes each one's fix; and it says what it left out.

A mistake the checker misses fails its test; a checker that flags everything fails the
fix's. Both databases where the mistake shows on both; the lost update of a token-less
read-modify-write happens only on PostgreSQL (on SQLite the inbox marker's write lock lets
no other writer in), so there the checker names it from the statement instead.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from tests.testing import evaluation
from tests.testing import wrong_handlers as wrong
from tests.testing.apis import RecordingAPI
from worker.registry import Registry
from worker.testing import (
    ESCAPED,
    LOST,
    NEW_ID,
    NO_TOKEN,
    OUTSIDE_CLAIM,
    SCENARIOS,
    UNSTABLE,
    Report,
    Sample,
    Scratch,
    check_idempotent,
)
from worker.testing.scratch import PostgresScratch

MODELS = evaluation.MODELS
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
    assert [o.passed for o in report.outcomes[1:]] == [True] * len(SCENARIOS)  # all agreed


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
        # emulated: the writer's 2 committed between the read of 10 and the write of 8
        assert "available 6 (one after the other) -> 8" in text and "(emulated" in text


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
    # counted as calls, not connections: a client kept open would show the same
    assert f"effects: 2 calls request POST {payments.url} by charge-card (once: 1)" in text
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


async def test_a_crash_that_loses_the_work_is_named_lost_not_escaped(kit_database: Scratch) -> None:
    """The crashed attempt remembered the credit in memory the kit cannot copy; the
    redelivery skipped it. Nothing escaped: the credit was lost, and the report says so."""
    given = [("wrong_wallets", {"id": "w-1", "balance": "0.00", "version": 1})]
    report = await check(wrong.FORGETFUL, CREDITS, kit_database, given=given)
    text = named(report, LOST, "crash")
    assert "the redelivery did not redo the work" in text
    assert "wrong_wallets:" in text


async def test_a_raw_connection_to_the_sqlite_file_fails_at_once(kit_sqlite: Scratch) -> None:
    """Before, the handler's own aiosqlite connection waited on the pump's write lock, the
    delivery was retried until it was dead-lettered, and the report said to fix the samples."""
    given = [("wrong_wallets", {"id": "w-1", "balance": "0.00", "version": 1})]
    started = time.monotonic()
    report = await check(evaluation.RAW_CONNECTION, CREDITS, kit_sqlite, given=given)
    assert time.monotonic() - started < 30
    text = " ".join(named(report, ESCAPED, "once").split())
    assert "aiosqlite.connect(" in text and "a connection of its own" in text


async def test_columns_that_differ_between_exact_runs_are_reported(kit_sqlite: Scratch) -> None:
    report = await check(
        evaluation.RATES,
        [Sample("PaymentReceived", {"account_id": "a-1", "amount": "10"})],
        kit_sqlite,
    )
    assert report.ok, str(report)
    line = "not compared: ev_converted.at (differs between two runs that apply each message once)"
    assert line in report.left_out
    assert line.split(" (")[0] in str(report)


async def test_a_value_the_second_exact_run_left_as_it_was_fails(kit_sqlite: Scratch) -> None:
    """Memory in a class attribute outlives the first run: the second skipped the work. The
    column is not taken for one that changes from run to run and dropped."""
    evaluation.forget()
    ticks = [Sample("Ticked", {"tally_id": "t-1"}, id=f"tick-{n}") for n in (1, 2)]
    given = [("ev_tallies", {"id": "t-1", "n": 0, "last": ""})]
    report = await check(evaluation.CLASS_SEEN, ticks, kit_sqlite, given=given)
    text = named(report, UNSTABLE, "once")
    assert "ev_tallies: 't-1': n 2, then 0 (as at the start)" in text
