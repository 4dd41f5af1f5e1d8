"""A replay repeats a handler's recorded writes over another state, and stops where the
handler would have noticed the other writer: a row count that differs, an error, a
generated key used later that came out differently; a lock both took serializes them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from worker.testing.replay import Statement, Transaction, replay, serialized


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'replay.db'}")
    async with engine.begin() as connection:
        await connection.execute(
            text("CREATE TABLE stock (sku TEXT PRIMARY KEY, n INTEGER, version INTEGER)")
        )
        await connection.execute(text("CREATE TABLE item (id INTEGER PRIMARY KEY, sku TEXT)"))
        await connection.execute(text("INSERT INTO stock VALUES ('s-1', 10, 1)"))
    try:
        yield engine
    finally:
        await engine.dispose()


def write(sql: str, parameters: tuple[object, ...], rowcount: int = 1, **done: object) -> Statement:
    return Statement(sql, parameters, False, rowcount, **done)  # type: ignore[arg-type]


async def replayed(engine: AsyncEngine, *statements: Statement) -> tuple[str | None, int]:
    async with engine.connect() as connection:
        why = await replay(connection, [Transaction(list(statements))])
        n = (await connection.execute(text("SELECT n FROM stock"))).scalar_one()
        await connection.rollback()
    return why, n


async def test_a_write_by_key_alone_is_repeated_over_the_other_writers(engine: AsyncEngine) -> None:
    """The lost update: 8, computed from 10 before another writer made it 7, wins."""
    async with engine.begin() as connection:
        await connection.execute(text("UPDATE stock SET n = 7, version = 2"))
    why, n = await replayed(engine, write("UPDATE stock SET n = ? WHERE sku = ?", (8, "s-1")))
    assert (why, n) == (None, 8)


async def test_a_version_in_the_where_finds_no_row(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        await connection.execute(text("UPDATE stock SET n = 7, version = 2"))
    statement = write(
        "UPDATE stock SET n = ?, version = 2 WHERE sku = ? AND version = ?", (8, "s-1", 1)
    )
    why, n = await replayed(engine, statement)
    assert why is not None and "affected 0 rows, not 1" in why
    assert n == 7


async def test_a_generated_key_that_came_out_differently_stops_the_replay(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as connection:  # the other writer took id 1
        await connection.execute(text("INSERT INTO item (sku) VALUES ('other')"))
    parent = write("INSERT INTO item (sku) VALUES (?) RETURNING id", ("s-1",), returned=((1,),))
    child = write("UPDATE stock SET version = ? WHERE sku = ?", (1, "s-1"))
    why, _ = await replayed(engine, parent, child)
    assert why is not None and "generated anew" in why
    why, _ = await replayed(engine, parent)  # nothing uses it: the replay goes on
    assert why is None


def test_a_lock_both_take_serializes_them() -> None:
    locks = Transaction(read={"customer"}, locked={"customer"})
    writes = Transaction([write("INSERT INTO orders (c) VALUES (?)", ("c-1",))], read={"orders"})
    assert serialized([locks], [locks]) == "it read customer with a lock"
    assert serialized([locks], [writes]) is None
    assert serialized([writes], [locks]) is None
    advisory = Transaction(advisory={"SELECT pg_advisory_xact_lock($1) (7,)"})
    assert serialized([advisory], [advisory]) == "both took the same advisory lock"
