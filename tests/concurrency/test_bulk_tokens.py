"""Bulk writes, tokens that never move, PostgreSQL's xmin, and what isolation cannot do."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from pathlib import Path
from typing import cast

import pytest
from sqlalchemy import FetchedValue, Integer, Numeric, String, Table, insert, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.orm.exc import StaleDataError

from handlers.pricing import ChangeProductPrice, Product, change_price
from tests.support.processes import json_env, run_cli
from worker.concurrency import (
    TRIGGER_MAINTAINED,
    BulkConflict,
    Policy,
    XminVersioned,
    check_version_tokens,
    guarded_delete,
    guarded_update,
    save,
)
from worker.context import PumpSession, session_factory
from worker.db import Failure, classify, create_engine
from worker.errors import ConfigurationError, PreconditionFailed, RowDeleted
from worker.registry import Context

PRODUCTS = cast(Table, Product.__table__)


async def seed(engine: AsyncEngine, *ids: str) -> None:
    async with engine.begin() as connection:
        for n, product_id in enumerate(ids):
            await connection.execute(
                insert(PRODUCTS).values(id=product_id, name=f"item {n}", price=10, version=1)
            )


def context(engine: AsyncEngine) -> Context:
    return Context(session_factory(engine)(), "m1", "bulk", 1, 1, {})


async def names(engine: AsyncEngine) -> dict[str, tuple[str, int]]:
    async with engine.connect() as connection:
        rows = await connection.execute(select(PRODUCTS.c.id, PRODUCTS.c.name, PRODUCTS.c.version))
        return {row.id: (row.name, row.version) for row in rows}


# -- guarded bulk writes ----------------------------------------------------------------------


async def test_a_plain_bulk_update_silently_overwrites_a_concurrent_change(
    engine: AsyncEngine,
) -> None:
    """The trap: the bulk UPDATE carries no token, so the rename in between is lost."""
    await seed(engine, "p1", "p2")
    async with engine.begin() as connection:  # another writer renames p2 after we read
        await connection.execute(
            update(PRODUCTS).where(PRODUCTS.c.id == "p2").values(name="renamed", version=2)
        )
    async with AsyncSession(engine) as session:
        await session.execute(update(Product).values(name="discontinued"))
        await session.commit()
    assert (await names(engine))["p2"] == ("discontinued", 2)  # the rename is gone, no error


async def test_guarded_update_raises_instead_and_leaves_the_concurrent_change(
    engine: AsyncEngine,
) -> None:
    await seed(engine, "p1", "p2", "p3")
    read = {"p1": 1, "p2": 1, "p3": 1}  # the tokens we decided on
    async with engine.begin() as connection:
        await connection.execute(
            update(PRODUCTS).where(PRODUCTS.c.id == "p2").values(name="renamed", version=2)
        )
    ctx = context(engine)
    try:
        with pytest.raises(BulkConflict) as raised:
            await guarded_update(ctx, Product, read, {"name": "discontinued"})
    finally:
        await AsyncSession.close(ctx.session)  # the pump's rollback
    assert (raised.value.expected, raised.value.affected, raised.value.deleted) == (3, 2, [])
    assert isinstance(raised.value, StaleDataError)  # the pump re-runs the attempt
    assert await names(engine) == {"p1": ("item 0", 1), "p2": ("renamed", 2), "p3": ("item 2", 1)}


async def test_a_guarded_write_over_a_deleted_row_is_a_rejection_not_a_retry(
    engine: AsyncEngine,
) -> None:
    """A row that is gone does not come back: re-running the attempt would loop for ever."""
    await seed(engine, "p1", "p2", "p3")
    async with engine.begin() as connection:
        await connection.execute(PRODUCTS.delete().where(PRODUCTS.c.id == "p3"))
    for write in ("update", "delete"):
        ctx = context(engine)
        try:
            with pytest.raises(RowDeleted) as raised:
                if write == "update":
                    await guarded_update(ctx, Product, {"p1": 1, "p3": 1}, {"name": "x"})
                else:
                    await guarded_delete(ctx, Product, {"p1": 1, "p3": 1})
        finally:
            await AsyncSession.close(ctx.session)
        assert raised.value.subject == "products:p3"
        assert not isinstance(raised.value, StaleDataError)  # recorded and acked, never retried
    assert await names(engine) == {"p1": ("item 0", 1), "p2": ("item 1", 1)}


async def test_guarded_update_and_delete_apply_when_every_token_matches(
    engine: AsyncEngine,
) -> None:
    await seed(engine, "p1", "p2", "p3")
    ctx = context(engine)
    try:
        assert await guarded_update(ctx, Product, {"p1": 1, "p2": 1}, {"name": "sale"}) == 2
        assert await guarded_delete(ctx, Product, {"p3": 1}) == 1
        await AsyncSession.commit(ctx.session)
    finally:
        await AsyncSession.close(ctx.session)
    assert await names(engine) == {"p1": ("sale", 2), "p2": ("sale", 2)}


async def test_guarded_delete_refuses_to_delete_a_changed_row(engine: AsyncEngine) -> None:
    await seed(engine, "p1")
    async with engine.begin() as connection:
        await connection.execute(update(PRODUCTS).values(price=12, version=2))
    ctx = context(engine)
    try:
        with pytest.raises(BulkConflict, match="0 of 1 rows still had their token"):
            await guarded_delete(ctx, Product, {"p1": 1})
    finally:
        await AsyncSession.close(ctx.session)
    assert await names(engine) == {"p1": ("item 0", 2)}


# -- a token nothing generates --------------------------------------------------------------


class _Unchecked(DeclarativeBase):
    pass


class ServerToken(_Unchecked):
    """A token declared server-generated, on a table where nothing generates it."""

    __tablename__ = "server_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    note: Mapped[str] = mapped_column(String(50))
    version: Mapped[int | None] = mapped_column(Integer, server_default=FetchedValue())
    __mapper_args__ = {"version_id_col": version, "version_id_generator": False}


async def test_a_server_generated_token_stays_null_and_a_guard_on_it_guards_nothing(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as connection:
        await connection.run_sync(_Unchecked.metadata.create_all)
        await connection.execute(insert(ServerToken).values(id=1, note="original"))
    table = cast(Table, ServerToken.__table__)
    async with engine.connect() as connection:
        token = await connection.scalar(select(table.c.version))
    assert token is None  # nothing generated it

    async def write(note: str) -> int:
        """A hand-written guard with the token as read: ``version == None`` is ``IS NULL``."""
        async with engine.begin() as connection:
            result = await connection.execute(
                update(table).where(table.c.id == 1, table.c.version == token).values(note=note)
            )
            return int(result.rowcount)

    assert (await write("first"), await write("second")) == (1, 1)  # both "won"
    ctx = context(engine)
    try:
        with pytest.raises(ValueError, match="NULL version token guards nothing"):
            await guarded_update(ctx, ServerToken, {1: token}, {"note": "third"})
    finally:
        await AsyncSession.close(ctx.session)
    async with engine.begin() as connection:
        await connection.run_sync(_Unchecked.metadata.drop_all)


def test_start_refuses_a_server_generated_token_on_sqlite_only() -> None:
    with pytest.raises(ConfigurationError, match=r"ServerToken\.version: a server-generated"):
        check_version_tokens("sqlite", [_Unchecked])
    check_version_tokens("postgresql", [_Unchecked])  # xmin or a trigger can generate it there


def test_a_trigger_maintained_token_may_say_so() -> None:
    class Own(DeclarativeBase):
        pass

    class Triggered(Own):
        __tablename__ = "triggered"
        id: Mapped[int] = mapped_column(Integer, primary_key=True)
        version: Mapped[int] = mapped_column(
            Integer, server_default=FetchedValue(), info={TRIGGER_MAINTAINED: True}
        )
        __mapper_args__ = {"version_id_col": version, "version_id_generator": False}

    check_version_tokens("sqlite", [Own])


def test_worker_run_refuses_such_a_model_at_start(tmp_path: Path) -> None:
    """End to end: a real ``worker run`` exits 2 with one line before it takes any message."""
    (tmp_path / "null_token_handlers.py").write_text(
        "from sqlalchemy import FetchedValue, Integer\n"
        "from sqlalchemy.orm import Mapped, mapped_column\n"
        "from worker.db import Base\n\n\n"
        "class Ledger(Base):\n"
        "    __tablename__ = 'ledger'\n"
        "    id: Mapped[int] = mapped_column(Integer, primary_key=True)\n"
        "    version: Mapped[int] = mapped_column(Integer, server_default=FetchedValue())\n"
        "    __mapper_args__ = {'version_id_col': version, 'version_id_generator': False}\n"
    )
    import os

    done = run_cli(
        json_env(
            {
                "WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'w.db'}",
                "WORKER_HANDLERS": "null_token_handlers",
                "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
            }
        ),
        "run",
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("worker: configuration error: Ledger.version: a server-generated")
    assert "stay NULL" in line


# -- PostgreSQL's xmin ----------------------------------------------------------------------


class _Xmin(DeclarativeBase):
    pass


class XProduct(XminVersioned, _Xmin):
    """The products table, guarded by xmin instead of its version column."""

    __tablename__ = "products"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    price: Mapped[Decimal] = mapped_column(Numeric(18, 2))


async def test_xmin_makes_two_writers_really_collide(postgres_only_url: str) -> None:
    engine = create_engine(postgres_only_url)
    try:
        await seed(engine, "p1")
        async with AsyncSession(engine) as a, AsyncSession(engine) as b:
            row_a, row_b = await a.get_one(XProduct, "p1"), await b.get_one(XProduct, "p1")
            assert row_a.xmin == row_b.xmin and isinstance(row_a.xmin, int)
            row_a.price = Decimal(11)
            await a.commit()
            row_b.price = Decimal(12)
            with pytest.raises(StaleDataError):
                await b.commit()
        async with engine.connect() as connection:
            assert await connection.scalar(select(PRODUCTS.c.price)) == Decimal(11)
    finally:
        await engine.dispose()


async def test_xmin_moves_even_on_a_no_op_update_and_works_with_the_helpers(
    postgres_only_url: str,
) -> None:
    """A no-op UPDATE writes a new row version: every other reader's token is now stale."""
    engine = create_engine(postgres_only_url)
    try:
        await seed(engine, "p1", "p2")
        session: PumpSession = session_factory(engine)()
        ctx = Context(session, "m1", "xmin", 1, 1, {})
        product = await session.get_one(XProduct, "p1")
        loaded = product.xmin
        async with engine.begin() as connection:
            await connection.execute(update(PRODUCTS).values(name=PRODUCTS.c.name))  # no-op
        product.price = Decimal(13)
        assert await save(ctx, product, policy=Policy.MERGE) is True  # conflict, then merged
        assert product.xmin != loaded
        other = await session.get_one(XProduct, "p2")
        assert await guarded_update(ctx, XProduct, {"p2": other.xmin}, {"name": "sale"}) == 1
        with pytest.raises(BulkConflict):
            await guarded_update(ctx, XProduct, {"p2": other.xmin}, {"name": "again"})
        await AsyncSession.close(session)
    finally:
        await engine.dispose()


def test_xmin_is_refused_on_sqlite() -> None:
    with pytest.raises(ConfigurationError, match=r"XProduct\.xmin: a server-generated"):
        check_version_tokens("sqlite", [_Xmin])


# -- isolation levels: within one attempt, not across think time ------------------------------


async def test_repeatable_read_raises_a_serialization_failure_the_pump_retries(
    postgres_only_url: str,
) -> None:
    engine = create_engine(postgres_only_url)
    try:
        await seed(engine, "p1")
        rr = engine.execution_options(isolation_level="REPEATABLE READ")
        async with rr.connect() as a, rr.connect() as b:
            await a.execute(select(PRODUCTS.c.price))
            await b.execute(select(PRODUCTS.c.price))
            await a.execute(update(PRODUCTS).values(price=PRODUCTS.c.price + 1))
            await a.commit()
            with pytest.raises(DBAPIError) as raised:
                await b.execute(update(PRODUCTS).values(price=PRODUCTS.c.price + 2))
        assert classify(raised.value) is Failure.TRANSIENT  # 40001: retried on a fresh session
    finally:
        await engine.dispose()


async def test_serializable_cannot_see_the_senders_think_time_but_expected_version_can(
    postgres_only_url: str,
) -> None:
    """The sender read version 1; someone moved it to 2; the command arrives afterwards."""
    engine = create_engine(postgres_only_url)
    try:
        await seed(engine, "p1")
        async with engine.begin() as connection:
            await connection.execute(update(PRODUCTS).values(price=20, version=2))
        serializable = engine.execution_options(isolation_level="SERIALIZABLE")
        async with AsyncSession(serializable) as naive:  # no expected version: it just writes
            product = await naive.get_one(Product, "p1")
            product.price = Decimal(15)
            await naive.commit()  # no serialization failure: nothing overlapped in time
        async with engine.begin() as connection:
            await connection.execute(update(PRODUCTS).values(price=20, version=3))
        session: PumpSession = session_factory(serializable)()
        try:
            with pytest.raises(PreconditionFailed):
                message = ChangeProductPrice(product_id="p1", price=Decimal(15), expected_version=1)
                await change_price(Context(session, "m1", "pricing", 1, 1, {}), message)
        finally:
            await AsyncSession.close(session)
        async with engine.connect() as connection:
            assert await connection.scalar(select(PRODUCTS.c.price)) == Decimal(20)
    finally:
        await engine.dispose()


async def test_concurrent_bulk_writers_on_one_row_one_wins(engine: AsyncEngine) -> None:
    await seed(engine, "p1")

    async def writer(name: str) -> str:
        ctx = context(engine)
        try:
            await guarded_update(ctx, Product, {"p1": 1}, {"name": name})
            await AsyncSession.commit(ctx.session)
            return "won"
        except BulkConflict:
            return "lost"
        finally:
            await AsyncSession.close(ctx.session)

    results = await asyncio.gather(writer("a"), writer("b"), writer("c"))
    assert sorted(results) == ["lost", "lost", "won"]
    assert (await names(engine))["p1"][1] == 2
