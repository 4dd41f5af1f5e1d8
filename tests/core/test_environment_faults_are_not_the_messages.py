"""The environment's faults are never the message's, and a message's own fault is never the
environment's (issue: every give-back bounded, environment faults never counted):

- a database that is read-only (a failover), refuses a privilege (a migration that forgot a
  GRANT) or is out of disk pauses the pump until a probe says it is over: no valid message
  is dead-lettered, none spends a count;
- a statement timeout that tripped in a lock wait is contention, not a failure;
- a handler branch that names a table missing while the same consumer commits other
  messages is that message's failure: it is counted and dead-lettered, and the pump does
  not pause for it;
- a guarded bulk write over a row another writer deleted is a rejection, recorded once.
"""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from handlers.credit import Account, CreditRequested, apply_credit
from handlers.pricing import Product
from tests.support.credits import credit_body
from tests.support.pumps import MakeSettings, RunPumps, engine_for
from tests.support.waiting import wait_for
from worker.brokers.memory import MemoryBroker
from worker.concurrency import guarded_update
from worker.context import Context
from worker.db import Failure, classify, create_engine
from worker.judge import Judge
from worker.registry import Registry
from worker.settings import Settings
from worker.verdict import PAUSED, Verdict


def verbs(broker: MemoryBroker, message_id: str) -> list[str]:
    return [verb for verb, mid, _ in broker.history if mid == message_id]


def counts(broker: MemoryBroker, message_id: str) -> list[int]:
    return [count for _, mid, count in broker.history if mid == message_id]


async def balance(engine: AsyncEngine, account: str) -> Decimal | None:
    async with engine.connect() as connection:
        return (
            await connection.execute(select(Account.balance).where(Account.id == account))
        ).scalar()


def credits() -> Registry:
    registry = Registry()
    registry.handler("Credit", CreditRequested, consumer="credit")(apply_credit)
    return registry


async def admin(url: str, *statements: str) -> None:
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.connect() as connection:
            await connection.execution_options(isolation_level="AUTOCOMMIT")
            for statement in statements:
                await connection.execute(text(statement))
    finally:
        await engine.dispose()


# -- read-only, privileges, disk: pause and probe -------------------------------------------


@pytest.mark.postgres
async def test_a_read_only_database_pauses_and_resumes_without_spending_a_count(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """SQLSTATE 25006 (a standby after a failover, maintenance): not now, for every message.
    Valid credits were dead-lettered; now the pump pauses, and a write check says when the
    database takes writes again. (Read-only for the worker's own role, so that no other test
    sharing the database is affected.)"""
    role = f"worker_ro_{uuid.uuid4().hex[:8]}"
    await admin(
        postgres_only_url,
        f"CREATE ROLE {role} LOGIN",
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}",
        f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}",
        f"ALTER ROLE {role} SET default_transaction_read_only = on",
    )
    url = postgres_only_url.replace("://postgres@", f"://{role}@", 1)
    broker = MemoryBroker()
    settings = make_settings(database_url=url, max_deliveries=2)
    try:
        async with (
            engine_for(url) as engine,
            run_pumps([broker.connect()], [engine], credits(), settings) as [pump],
        ):
            for n in range(10):
                broker.publish(f"m-{n}", "Credit", credit_body("a", "1"))
            await wait_for(lambda: pump.health.outages >= 1, 20, "the pause")
            assert not pump.ready
            await asyncio.sleep(1.0)  # several probes: still read-only, still paused
            assert not pump.health.available
            await admin(postgres_only_url, f"ALTER ROLE {role} RESET default_transaction_read_only")
            await admin(postgres_only_url, terminate(role))  # new sessions read the new default
            await broker.wait_idle(timeout=30)
        async with engine_for(postgres_only_url) as check:
            assert await balance(check, "a") == 10
    finally:
        await drop_role(postgres_only_url, role)
    assert broker.dead_letters == []
    assert all(count == 1 for _, _, count in broker.history)  # no count spent


def terminate(role: str) -> str:
    return f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"


async def drop_role(url: str, role: str) -> None:
    await admin(
        url,
        terminate(role),
        f"REASSIGN OWNED BY {role} TO postgres",
        f"DROP OWNED BY {role}",
        f"DROP ROLE {role}",
    )


@pytest.mark.postgres
async def test_a_missing_grant_pauses_until_it_is_granted(
    postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """SQLSTATE 42501: a migration that forgot a GRANT. The pod would stay Ready and valid
    messages went to the dead-letter queue after a few minutes; now the pump pauses and a
    privilege check tells when the grant is there."""
    role = f"worker_app_{uuid.uuid4().hex[:8]}"
    await admin(
        postgres_only_url,
        f"CREATE ROLE {role} LOGIN",
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}",
        f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}",
        f"REVOKE INSERT, UPDATE ON accounts FROM {role}",
    )
    url = postgres_only_url.replace("://postgres@", f"://{role}@", 1)
    broker = MemoryBroker()
    settings = make_settings(database_url=url, max_deliveries=2)
    try:
        async with (
            engine_for(url) as engine,
            run_pumps([broker.connect()], [engine], credits(), settings) as [pump],
        ):
            for n in range(5):
                broker.publish(f"m-{n}", "Credit", credit_body("a", "1"))
            await wait_for(lambda: pump.health.outages >= 1, 20, "the pause")
            await asyncio.sleep(1.0)
            assert not pump.health.available  # the privilege check says: not yet
            await admin(postgres_only_url, f"GRANT INSERT, UPDATE ON accounts TO {role}")
            await broker.wait_idle(timeout=30)
        async with engine_for(postgres_only_url) as check:
            assert await balance(check, "a") == 5
    finally:
        await drop_role(postgres_only_url, role)
    assert broker.dead_letters == []
    assert all(count == 1 for _, _, count in broker.history)


def test_out_of_resources_is_the_environments_fault_never_a_counted_attempt() -> None:
    """53xxx (disk full, out of memory) while the ping still answers ended in a counted
    "attempts exhausted"; it pauses now, uncounted."""

    class DiskFull(Exception):
        sqlstate = "53100"

    from sqlalchemy.exc import DBAPIError

    error = DBAPIError("INSERT ...", {}, DiskFull("could not extend file: No space left"))
    assert classify(error) is Failure.RESOURCES and Failure.RESOURCES.environment
    judge = Judge(Settings(), _Log(), _counter(), None, None)  # type: ignore[arg-type]
    verdict = judge.decide(_delivery(), "credit", 1, error, Failure.RESOURCES, deadline=0.0)
    assert isinstance(verdict, Verdict)
    assert verdict.outcome is PAUSED.outcome and not verdict.counted


async def test_a_full_sqlite_file_pauses_instead_of_dead_lettering(
    tmp_path: Path, sqlite_template: Path, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """SQLite's "database or disk is full" (simulated with PRAGMA max_page_count): 6 of 20
    valid credits were dead-lettered, with no pause. Now it pauses until there is room."""
    import shutil

    path = tmp_path / "worker.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite+aiosqlite:///{path}"
    limit = {"pages": 0}

    async with engine_for(url) as engine:
        async with engine.connect() as connection:
            used = (await connection.execute(text("PRAGMA page_count"))).scalar()
        limit["pages"] = int(used or 0)  # no room for another page

        @event.listens_for(engine.sync_engine, "checkout")
        def cap(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute(f"PRAGMA max_page_count = {limit['pages']}")
            cursor.close()

        await engine.dispose()  # the pool's connections take the cap from here on
        broker = MemoryBroker()
        settings = make_settings(database_url=url, max_deliveries=2)
        async with run_pumps([broker.connect()], [engine], credits(), settings) as [pump]:
            for n in range(200):
                broker.publish(f"m-{n}", "Credit", credit_body(f"account-number-{n:040d}", "1"))
            await wait_for(lambda: pump.health.outages >= 1, 20, "the pause")
            limit["pages"] = 1_000_000  # room again
            await broker.wait_idle(timeout=60)
        assert broker.dead_letters == []
        for n in range(200):
            assert await balance(engine, f"account-number-{n:040d}") == 1
    assert all(count == 1 for _, _, count in broker.history)


async def test_a_read_only_sqlite_file_pauses_instead_of_dead_lettering(
    tmp_path: Path, sqlite_template: Path, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """SQLite's "attempt to write a readonly database" (PRAGMA query_only, as a file that
    lost its write permission or a read-only mount): the environment's, so a pause until
    the file takes writes again, never a counted failure."""
    import shutil

    path = tmp_path / "worker.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite+aiosqlite:///{path}"
    read_only = {"on": True}

    async with engine_for(url) as engine:

        @event.listens_for(engine.sync_engine, "checkout")
        def query_only(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute(f"PRAGMA query_only = {int(read_only['on'])}")
            cursor.close()

        broker = MemoryBroker()
        settings = make_settings(database_url=url, max_deliveries=2)
        async with run_pumps([broker.connect()], [engine], credits(), settings) as [pump]:
            for n in range(20):
                broker.publish(f"m-{n}", "Credit", credit_body("a", "1"))
            await wait_for(lambda: pump.health.outages >= 1, 20, "the pause")
            await asyncio.sleep(1.0)  # several probes: still read-only, still paused
            assert not pump.health.available
            read_only["on"] = False  # writable again
            await broker.wait_idle(timeout=60)
        assert broker.dead_letters == []
        assert await balance(engine, "a") == 20
    assert all(count == 1 for _, _, count in broker.history)


# -- a statement timeout in a lock wait is contention ------------------------------------------


@pytest.mark.postgres
async def test_a_statement_timeout_in_a_lock_wait_is_contention(postgres_only_url: str) -> None:
    async with engine_for(postgres_only_url) as engine:
        async with engine.begin() as connection:
            await connection.execute(text("INSERT INTO accounts VALUES ('held', 0, 1)"))
        async with engine.connect() as holder, engine.connect() as waiter:
            await holder.execute(text("BEGIN"))
            await holder.execute(text("UPDATE accounts SET balance = 1 WHERE id = 'held'"))
            await waiter.execute(text("SET statement_timeout = '100ms'"))
            try:
                await waiter.execute(text("UPDATE accounts SET balance = 2 WHERE id = 'held'"))
            except Exception as exc:
                lock_wait: BaseException = exc
            else:
                pytest.fail("the lock wait did not time out")
            await waiter.rollback()
            await waiter.execute(text("SET statement_timeout = '100ms'"))  # rolled back too
            try:
                await waiter.execute(text("SELECT pg_sleep(1)"))
            except Exception as exc:
                slow_query: BaseException = exc
            else:
                pytest.fail("the slow query did not time out")
            await holder.rollback()
    assert classify(lock_wait) is Failure.TRANSIENT  # someone else holds the row: retry
    assert classify(slow_query) is Failure.ERROR  # the message's own slow statement


# -- a missing table that other messages don't miss is this message's failure ------------------


async def test_a_branch_naming_a_missing_table_is_the_messages_failure(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """It looped for ever (uncounted, "schema behind the code") and paused the whole pump
    each time: 91 of 249 valid messages finished in the test window."""
    registry = Registry()

    @registry.handler("Credit", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        if message.account_id == "audit":  # a branch nobody migrated a table for
            await ctx.session.execute(text("INSERT INTO audit_trail VALUES (1)"))
        await apply_credit(ctx, message)

    broker = MemoryBroker()
    settings = make_settings(max_deliveries=3)
    async with run_pumps([broker.connect()], [engine], registry, settings) as [pump]:
        for n in range(20):
            broker.publish(f"m-{n}", "Credit", credit_body("a", "1"))
        await wait_for(lambda: pump.stats["committed"] >= 20, 20, "the valid ones")
        broker.publish("bad", "Credit", credit_body("audit", "1"))
        for n in range(20, 40):
            broker.publish(f"m-{n}", "Credit", credit_body("a", "1"))
        await broker.wait_idle(timeout=30)
        assert pump.health.outages == 0  # never a pause of the whole pump
    assert verbs(broker, "bad") == ["nack", "nack", "dead-letter"]
    assert counts(broker, "bad") == [1, 2, 3]
    assert await balance(engine, "a") == 40


# -- a guarded write over a deleted row is a rejection --------------------------------------------


async def test_a_guarded_write_over_a_deleted_row_is_recorded_once_not_retried(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """guarded_update on a row already deleted looped for ever: the handler ran 201 times."""
    runs = 0
    registry = Registry()

    @registry.handler("Reprice", CreditRequested, consumer="reprice")
    async def reprice(ctx: Context, message: CreditRequested) -> None:
        nonlocal runs
        runs += 1
        await guarded_update(ctx, Product, {"gone": 1}, {"price": message.amount})

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings()):
        broker.publish("r-1", "Reprice", credit_body("x", "2"))
        await broker.wait_idle(timeout=20)
    assert runs == 1
    assert verbs(broker, "r-1") == ["ack"]
    async with engine.connect() as connection:
        rows = (await connection.execute(text("SELECT reason, subject FROM rejections"))).all()
    assert [tuple(row) for row in rows] == [("deleted", "products:gone")]


# -- helpers for the pure-judge case ---------------------------------------------------------------


class _Log:
    def __getattr__(self, _name: str) -> Any:
        return lambda *args, **kwargs: None


def _counter() -> Any:
    from collections import Counter

    return Counter()


def _delivery() -> Any:
    from worker.delivery import Delivery

    class _Settler:
        pass

    return Delivery("m-1", "Credit", b"{}", {}, 1, _Settler(), None)  # type: ignore[arg-type]
