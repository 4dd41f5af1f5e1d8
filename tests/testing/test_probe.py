"""The probe's faults are real: a simulated crash rolls the attempt back and the broker
redelivers it; a concurrent writer really commits in between; and what it reads from a
statement (reads, writes, an UPDATE guarded by more than its key) is read right."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, update
from sqlalchemy.dialects import sqlite

from handlers.credit import CreditRequested, apply_credit
from tests.testing import wrong_handlers as wrong
from worker.registry import Registry
from worker.testing import Scratch, Settled
from worker.testing.harness import Harness, harness_settings
from worker.testing.probe import Crash, Plan
from worker.testing.scratch import SQLiteScratch
from worker.testing.statements import guarded, read_tables, sets_plain_values, written_table

CREDIT = {"account_id": "acct-1", "amount": "10.00"}


def credits() -> Registry:
    handlers = Registry()
    handlers.handler("CreditRequested", CreditRequested, consumer="credit")(apply_credit)
    return handlers


async def crashed_run(scratch: Scratch, at: int) -> tuple[Harness, list[Any]]:
    url = await scratch.fresh()
    plan = Plan(crash=Crash("c-1", "credit", at))
    worker = Harness(credits(), url, harness_settings(url, {}), plan=plan)
    await worker.start()
    try:
        done = await worker.deliver("CreditRequested", CREDIT, id="c-1")
        rows = await worker.rows("accounts")
    finally:
        await worker.stop()
    assert done.settlements == (Settled("nack", 1), Settled("ack", 2)), done
    return worker, rows


@pytest.mark.parametrize("at", [1, 2, 3, 4, 5, 6])
async def test_a_crash_rolls_the_attempt_back_and_the_delivery_comes_back(
    at: int, kit_database: Scratch
) -> None:
    """A new account's credit has six boundaries: the marker, a read, the account's insert,
    a read, the update, the commit. Wherever it crashes, the redelivery applies it once."""
    worker, rows = await crashed_run(kit_database, at)
    [first, again] = [t for t in worker.probe.traces if t.consumer == "credit"]
    assert len(first.boundaries) == at and first.crashed == first.boundaries[-1]
    assert (at == 6) == (first.crashed == "the commit")
    assert again.crashed is None and again.delivery_count == 2
    assert again.boundaries[-1] == "the commit"
    assert [(r["balance"], r["version"]) for r in rows] == [(Decimal("10.00"), 2)]


async def test_the_concurrent_writer_commits_before_the_handlers_write(
    kit_database: Scratch,
) -> None:
    """On PostgreSQL the writer's credit lands between the handler's read and its update:
    the version token turns the handler's write into a conflict, and its retry adds to
    the writer's. On SQLite no other writer can commit inside the handler's transaction."""
    from worker.testing.probe import ConcurrentWriter

    url = await kit_database.fresh()
    writer = ConcurrentWriter(url, wait=0.5, settle_within=10.0)
    worker = Harness(credits(), url, harness_settings(url, {}), plan=Plan(writer=writer))
    await worker.start()
    try:
        await worker.deliver("CreditRequested", CREDIT, id="c-1")  # creates the account
        await worker.deliver("CreditRequested", CREDIT, id="c-2")  # reads, then updates it
        [row] = await worker.rows("accounts")
    finally:
        await worker.stop()
        await writer.close()
    states = {o.message_id: o.state for o in writer.outcomes.values()}
    if isinstance(kit_database, SQLiteScratch):
        assert states == {}  # the marker holds SQLite's one write lock: no race to run
        assert row["balance"] == Decimal("20.00")
    else:
        # c-1 inserted the account: the writer's insert waited for its commit, then went on
        assert states == {"c-1": "after", "c-2": "before"}
        assert row["balance"] == Decimal("40.00")  # c-1, c-2 and their writers': none lost


def test_what_a_statement_reads_and_writes() -> None:
    sql = 'SELECT a.id FROM "accounts" AS a JOIN products p ON p.id = a.id WHERE a.id = ?'
    assert read_tables(sql) == {"accounts", "products"}
    assert written_table("INSERT INTO wrong_audit (x) VALUES (?)") == "wrong_audit"
    assert written_table("UPDATE accounts SET balance=? WHERE accounts.id = ?") == "accounts"
    assert written_table("DELETE FROM inbox WHERE message_id = ?") == "inbox"
    assert written_table("SELECT 1") is None


def test_an_update_by_its_key_alone_is_unguarded() -> None:
    table = Table(
        "t",
        MetaData(),
        Column("id", String, primary_key=True),
        Column("n", Integer),
        Column("version", Integer),
    )

    class Context:
        def __init__(self, statement: Any) -> None:
            self.compiled = statement.compile(dialect=sqlite.dialect())

    by_key = update(table).where(table.c.id == "x").values(n=1)
    by_version = update(table).where(table.c.id == "x", table.c.version == 3).values(n=1)
    assert guarded(Context(by_key)) is False
    assert guarded(Context(by_version)) is True
    assert guarded(None) is None  # a statement SQLAlchemy did not compile: unknown


def test_a_value_computed_from_the_row_is_not_a_plain_write() -> None:
    assert sets_plain_values("UPDATE t SET n=? WHERE t.id = ?")
    assert sets_plain_values("UPDATE t SET n=$1::NUMERIC(18, 2) WHERE t.id = $2::VARCHAR")
    assert not sets_plain_values("UPDATE t SET n=(t.n + ?) WHERE t.id = ?")
    assert sets_plain_values("UPDATE t SET m=(t.m + ?), n=? WHERE t.id = ?")
    assert sets_plain_values("DELETE FROM t WHERE t.id = ?")


def test_the_wrong_handlers_models_stay_out_of_worker_base() -> None:
    from worker.db import Base

    assert not set(wrong.Base.metadata.tables) & set(Base.metadata.tables)


def test_an_orm_update_guarded_by_a_version_is_guarded() -> None:
    """``update(Model).where(Model.version == seen)``: the ORM compares annotated copies of
    the table's columns, which are still that table's."""

    class Context:
        def __init__(self, statement: Any) -> None:
            self.compiled = statement.compile(dialect=sqlite.dialect())

    stock = wrong.GuardedStock
    by_version = update(stock).where(stock.sku == "s-1", stock.version == 1).values(available=3)
    assert guarded(Context(by_version)) is True
    assert guarded(Context(update(stock).where(stock.sku == "s-1").values(available=3))) is False
