"""worker.db.classify() on real errors, raised by the real drivers through SQLAlchemy.

The pump's settlement depends on the class alone (a duplicate acks, a data error
dead-letters, a lost connection pauses without spending a delivery, a plain error is
counted), and a wrong class often ends in the same verb by another path. So each
class is asserted here directly, for an error the database itself was made to raise.
"""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from tests.support.database import ACCOUNTS, INBOX
from tests.support.processes import free_port
from worker.db import Failure, classify, create_engine, from_database

pytestmark = pytest.mark.timeout(60)


async def raised(call: Awaitable[Any]) -> BaseException:
    """The exception ``call`` raises; the test fails if it raises none."""
    try:
        await call
    except Exception as exc:
        return exc
    pytest.fail("expected the database to refuse")


def code_of(exc: BaseException) -> str | None:
    """The SQLSTATE the server sent, wherever the driver and SQLAlchemy put it."""
    for candidate in (exc, getattr(exc, "orig", None), getattr(exc, "__cause__", None)):
        code = getattr(candidate, "sqlstate", None)
        if isinstance(code, str):
            return code
    orig = getattr(exc, "orig", None)
    code = getattr(getattr(orig, "__cause__", None), "sqlstate", None)
    return code if isinstance(code, str) else None


def account(id: str = "a", balance: Decimal = Decimal(0)) -> Any:
    return ACCOUNTS.insert().values(id=id, balance=balance, version=1)


def marker(message_id: str = "m-1", consumer: str = "credit") -> Any:
    return INBOX.insert().values(message_id=message_id, consumer=consumer)


async def in_transaction(engine: AsyncEngine, *statements: Any) -> None:
    async with engine.begin() as connection:
        for statement in statements:
            await connection.execute(statement)


# -- PostgreSQL (asyncpg) ------------------------------------------------------------------------


@pytest.fixture
async def pg(postgres_only_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(postgres_only_url, pool_size=4)
    yield engine
    await engine.dispose()


@pytest.mark.postgres
async def test_pg_business_unique_violation_is_an_error(pg: AsyncEngine) -> None:
    await in_transaction(pg, account())
    exc = await raised(in_transaction(pg, account()))
    assert code_of(exc) == "23505"  # a real unique violation, of the accounts' primary key
    assert classify(exc) is Failure.ERROR


@pytest.mark.postgres
async def test_pg_unique_violation_on_another_tables_unique_constraint_is_an_error(
    pg: AsyncEngine,
) -> None:
    await in_transaction(pg, text("CREATE TABLE orders (id INT PRIMARY KEY, number TEXT UNIQUE)"))
    await in_transaction(pg, text("INSERT INTO orders VALUES (1, 'A-1')"))
    exc = await raised(in_transaction(pg, text("INSERT INTO orders VALUES (2, 'A-1')")))
    assert code_of(exc) == "23505"
    assert classify(exc) is Failure.ERROR


@pytest.mark.postgres
async def test_pg_inbox_constraint_violation_is_a_duplicate(pg: AsyncEngine) -> None:
    await in_transaction(pg, marker())
    exc = await raised(in_transaction(pg, marker()))
    assert code_of(exc) == "23505"
    assert classify(exc) is Failure.DUPLICATE
    # the same message for another consumer is no duplicate: it inserts
    await in_transaction(pg, marker(consumer="audit"))


@pytest.mark.postgres
async def test_pg_serialization_failure_is_transient(pg: AsyncEngine) -> None:
    await in_transaction(pg, account())
    update = text("UPDATE accounts SET balance = balance + 1 WHERE id = 'a'")
    async with pg.connect() as first, pg.connect() as second:
        for connection in (first, second):
            await connection.execution_options(isolation_level="REPEATABLE READ")
            await connection.execute(text("SELECT balance FROM accounts WHERE id = 'a'"))
        await first.execute(update)
        await first.commit()  # the second transaction's snapshot predates this write
        exc = await raised(second.execute(update))
        await second.rollback()
    assert code_of(exc) == "40001"
    assert classify(exc) is Failure.TRANSIENT


@pytest.mark.postgres
async def test_pg_deadlock_is_transient(pg: AsyncEngine) -> None:
    await in_transaction(pg, account("a"), account("b"))

    def lock(id: str) -> Any:
        return text(f"UPDATE accounts SET balance = balance + 1 WHERE id = '{id}'")

    async def crosswise(connection: AsyncConnection, mine: str, theirs: str) -> None:
        await connection.execute(text("SET deadlock_timeout = '50ms'"))
        await connection.execute(lock(mine))
        await asyncio.sleep(0.2)  # the other transaction takes its first row meanwhile
        await connection.execute(lock(theirs))

    async with pg.connect() as first, pg.connect() as second:
        outcomes = await asyncio.gather(
            crosswise(first, "a", "b"), crosswise(second, "b", "a"), return_exceptions=True
        )
        await first.rollback()
        await second.rollback()
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(failures) == 1, outcomes  # PostgreSQL broke the cycle by failing one of them
    assert code_of(failures[0]) == "40P01"
    assert classify(failures[0]) is Failure.TRANSIENT


@pytest.mark.postgres
async def test_pg_too_many_connections_is_a_connection_failure(postgres_only_url: str) -> None:
    role = f"worker_limit_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres_only_url, pool_size=1)
    await in_transaction(admin, text(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 1"))
    limited = create_engine(postgres_only_url.replace("postgres@", f"{role}@", 1), pool_size=2)
    try:
        async with limited.connect() as held:
            await held.execute(text("SELECT 1"))
            exc = await raised(limited.connect().__aenter__())
        assert code_of(exc) == "53300"
        assert classify(exc) is Failure.CONNECTION
    finally:
        await limited.dispose()
        async with admin.connect() as connection:
            await connection.execution_options(isolation_level="AUTOCOMMIT")
            await connection.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"),
                {"r": role},
            )
            await connection.execute(text(f"DROP ROLE {role}"))
        await admin.dispose()


@pytest.mark.postgres
async def test_pg_admin_shutdown_of_the_connection_is_a_connection_failure(
    pg: AsyncEngine,
) -> None:
    async with pg.connect() as victim, pg.connect() as admin:
        pid = await victim.scalar(text("SELECT pg_backend_pid()"))

        async def terminate_soon() -> None:
            await asyncio.sleep(0.3)
            await admin.execute(text(f"SELECT pg_terminate_backend({pid})"))

        killer = asyncio.create_task(terminate_soon())
        exc = await raised(victim.execute(text("SELECT pg_sleep(10)")))  # killed mid-statement
        await killer
    async with pg.connect() as idle, pg.connect() as admin:  # killed between statements
        pid = await idle.scalar(text("SELECT pg_backend_pid()"))
        await idle.commit()
        await admin.execute(text(f"SELECT pg_terminate_backend({pid})"))
        await asyncio.sleep(0.2)
        later = await raised(idle.execute(text("SELECT 1")))
    # The server sends FATAL 57P01 and hangs up; asyncpg reports the hang-up mid-statement
    # as ConnectionDoesNotExistError (08003) quoting the server's message.
    assert code_of(exc) in ("57P01", "08003")
    assert "terminating connection due to administrator command" in str(exc)
    assert classify(exc) is Failure.CONNECTION
    assert classify(later) is Failure.CONNECTION


@pytest.mark.postgres
async def test_pg_refused_connection_is_a_connection_failure() -> None:
    engine = create_engine(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/x", pool_size=1)
    try:
        exc = await raised(engine.connect().__aenter__())
    finally:
        await engine.dispose()
    assert isinstance(exc, OSError | DBAPIError)
    assert from_database(exc)
    assert classify(exc) is Failure.CONNECTION


@pytest.mark.parametrize("reads_first", [False, True], ids=["at-once", "after-startup"])
async def test_a_server_that_hangs_up_is_a_connection_failure(reads_first: bool) -> None:
    """A proxy in front of a dead server (pgbouncer, a Service) accepts, then hangs up."""

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if reads_first:
            await reader.read(100)  # the startup message
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = create_engine(f"postgresql+asyncpg://postgres@127.0.0.1:{port}/x", pool_size=1)
    try:
        exc = await raised(engine.connect().__aenter__())
    finally:
        await engine.dispose()
        server.close()
        await server.wait_closed()
    assert from_database(exc)
    assert classify(exc) is Failure.CONNECTION


@pytest.mark.postgres
async def test_pg_missing_table_is_a_schema_failure(pg: AsyncEngine) -> None:
    exc = await raised(in_transaction(pg, text("SELECT * FROM table_from_a_later_migration")))
    assert code_of(exc) == "42P01"
    assert classify(exc) is Failure.SCHEMA


@pytest.mark.postgres
async def test_pg_lock_timeout_is_locked(pg: AsyncEngine) -> None:
    await in_transaction(pg, account())
    async with pg.connect() as holder, pg.connect() as waiter:
        await holder.execute(text("SELECT * FROM accounts WHERE id = 'a' FOR UPDATE"))
        await waiter.execute(text("SET LOCAL lock_timeout = '50ms'"))
        exc = await raised(waiter.execute(text("UPDATE accounts SET balance = 1 WHERE id = 'a'")))
        await waiter.rollback()
        await holder.rollback()
    assert code_of(exc) == "55P03"
    assert classify(exc) is Failure.LOCKED


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("statement", "sqlstate"),
    [
        pytest.param(account(balance=Decimal("9" * 40)), "22003", id="numeric-overflow"),
        pytest.param(account(id="x" * 1000), "22001", id="string-too-long-for-varchar-64"),
        pytest.param(account(id="nul\x00byte"), "22021", id="nul-byte"),
        pytest.param(text("SELECT 1 / 0"), "22012", id="division-by-zero"),
    ],
)
async def test_pg_data_exceptions_are_data(pg: AsyncEngine, statement: Any, sqlstate: str) -> None:
    exc = await raised(in_transaction(pg, statement))
    assert code_of(exc) == sqlstate
    assert classify(exc) is Failure.DATA


# -- SQLite (aiosqlite) --------------------------------------------------------------------------


@pytest.fixture
async def lite(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url, pool_size=4)
    yield engine
    await engine.dispose()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_sqlite_busy_file_is_transient(lite: AsyncEngine, database_url: str) -> None:
    impatient = create_async_engine(database_url, connect_args={"timeout": 0.05})
    try:
        async with lite.connect() as writer:
            await writer.execute(account("a"))  # holds the write lock until it ends
            exc = await raised(in_transaction(impatient, account("b")))
            await writer.rollback()
    finally:
        await impatient.dispose()
    assert isinstance(exc, DBAPIError) and isinstance(exc.orig, sqlite3.OperationalError)
    assert "locked" in str(exc.orig)
    assert classify(exc) is Failure.TRANSIENT


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_sqlite_inbox_violation_is_a_duplicate(lite: AsyncEngine) -> None:
    await in_transaction(lite, marker())
    exc = await raised(in_transaction(lite, marker()))
    assert classify(exc) is Failure.DUPLICATE
    await in_transaction(lite, marker(consumer="audit"))


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_sqlite_other_unique_violations_are_errors(lite: AsyncEngine) -> None:
    await in_transaction(lite, account())
    primary_key = await raised(in_transaction(lite, account()))
    await in_transaction(lite, text("CREATE TABLE orders (id INT PRIMARY KEY, number TEXT UNIQUE)"))
    await in_transaction(lite, text("INSERT INTO orders VALUES (1, 'A-1')"))
    unique = await raised(in_transaction(lite, text("INSERT INTO orders VALUES (2, 'A-1')")))
    assert "UNIQUE constraint failed: orders.number" in str(unique)
    assert classify(primary_key) is Failure.ERROR
    assert classify(unique) is Failure.ERROR


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_sqlite_integer_beyond_64_bits_is_data(lite: AsyncEngine) -> None:
    await in_transaction(lite, text("CREATE TABLE counters (id INT PRIMARY KEY, n INTEGER)"))
    insert = text("INSERT INTO counters VALUES (1, :n)").bindparams(n=2**64)
    exc = await raised(in_transaction(lite, insert))
    assert isinstance(exc, OverflowError)  # sqlite3 refuses to bind it: nothing wraps it
    assert from_database(exc)
    assert classify(exc) is Failure.DATA


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_an_exhausted_connection_pool_is_not_the_messages_fault(database_url: str) -> None:
    """Every connection of the pool is busy (slow handlers, a pool sized below the
    concurrency to fit max_connections): a wait, never a failure to count."""
    engine = create_async_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=0.05)
    try:
        async with engine.connect() as busy:
            await busy.execute(text("SELECT 1"))
            exc = await raised(in_transaction(engine, text("SELECT 1")))
    finally:
        await engine.dispose()
    assert "QueuePool limit of size 1 overflow 0 reached" in str(exc)
    assert classify(exc) in (Failure.TRANSIENT, Failure.CONNECTION)


# -- where an error came from ----------------------------------------------------------------


async def test_a_handlers_own_refused_connection_is_an_error_not_a_lost_database() -> None:
    port = free_port()  # nothing listens there: a real refusal from the kernel
    exc = await raised(asyncio.open_connection("127.0.0.1", port))
    assert isinstance(exc, ConnectionRefusedError)
    assert not from_database(exc)
    assert classify(exc) is Failure.ERROR

    def blocking_call() -> None:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()

    exc = await raised(asyncio.to_thread(blocking_call))
    assert isinstance(exc, ConnectionRefusedError)
    assert classify(exc) is Failure.ERROR


async def test_a_refused_sqlite_file_is_from_the_database(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path}/missing/dir/worker.db", pool_size=1)
    try:
        exc = await raised(in_transaction(engine, text("SELECT 1")))
    finally:
        await engine.dispose()
        # aiosqlite stops the failed connection's thread on its own, and that thread still
        # answers a future on this loop: let it finish before the loop closes
        for thread in threading.enumerate():
            if thread.name.endswith("(_connection_worker_thread)"):
                await asyncio.to_thread(thread.join, 5)
    assert from_database(exc)
    assert classify(exc) is Failure.CONNECTION
