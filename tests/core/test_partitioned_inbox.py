"""The partitioned inbox on PostgreSQL: dedup stays exact across partitions, and a duplicate
is still a unique violation of exactly the inbox constraint (worker/partitions.py).

Two copies of one message are forced into different partitions by giving the first an
explicit ``stored_at`` in another partition (a freshly converted inbox writes into the old
table's partition until its first boundary, so "now" is ``inbox_legacy``, the first
partition made ahead a regular one, nine years ahead DEFAULT); the second copy waits for the first's
transaction exactly as it waits on the plain table's index entry, then is a duplicate (the
first committed) or goes on (it rolled back). The race across a boundary under real clocks
and several processes is tests/concurrency/test_partitioned_inbox_race.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from tests.support.database import own_database
from tests.support.layout import INBOX_LAYOUT
from worker import inbox, leases, partitions, retention, rollover
from worker.context import session_factory
from worker.db import Failure, classify, create_engine, is_inbox_violation
from worker.leases import Claim, Held
from worker.migrate import upgrade

pytestmark = pytest.mark.postgres

WAIT = 0.4  # how long the first copy holds its transaction open
# a minute into the first regular partition, the one the conversion made ahead
AHEAD = (
    "(SELECT min(substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM [(]''([^'']+)')"
    "::timestamptz) + interval '1 minute' FROM pg_inherits i "
    "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'inbox'::regclass "
    "AND c.relname ~ '^inbox_p[0-9]')"
)
FUTURE = "now() + interval '9 years'"  # no partition: DEFAULT
PAST = "now() - interval '30 days'"  # the old table's range


PERIOD = timedelta(hours=1)


async def _a_partition_ahead(url: str) -> None:
    """A regular partition after the old table's, whatever the clock: the conversion makes
    one only when its first period boundary falls within a period of now (late in an hour
    the old table covers up to the boundary after next, and the housekeeping makes the
    next partition later)."""
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.connect() as connection:
            now = await retention.database_now(connection)
            await rollover.make_ahead(connection, PERIOD, now + 2 * PERIOD, now, rollover.Pass())
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def partitioned_url() -> Iterator[str]:
    with own_database("worker_partitioned") as url:
        upgrade(url, inbox_layout="partitioned", partition_period=PERIOD)
        asyncio.run(_a_partition_ahead(url))
        yield url


@pytest.fixture
async def engine(partitioned_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(partitioned_url, pool_size=6)
    async with engine.begin() as connection:
        await connection.execute(text("TRUNCATE inbox"))
    yield engine
    await engine.dispose()


async def partition_of(engine: AsyncEngine, message_id: str) -> list[str]:
    async with engine.connect() as connection:
        rows = await connection.execute(
            text("SELECT tableoid::regclass::text FROM inbox WHERE message_id = :m"),
            {"m": message_id},
        )
        return list(rows.scalars())


async def hold_copy(
    engine: AsyncEngine, message_id: str, release: asyncio.Event, commit: bool
) -> None:
    """The first copy: its marker in a partition made ahead, held open."""
    async with engine.connect() as connection:
        await connection.execute(
            text(f"INSERT INTO inbox (message_id, consumer, stored_at) VALUES (:m, 'c', {AHEAD})"),
            {"m": message_id},
        )
        await release.wait()
        if commit:
            await connection.commit()
        else:
            await connection.rollback()


async def second_copy(engine: AsyncEngine, message_id: str) -> tuple[str, float]:
    """The second copy, through the pump's own statement: (outcome, seconds it took)."""
    started = time.monotonic()
    session: AsyncSession = session_factory(engine)()
    try:
        await inbox.mark(session, message_id, "c")
        await AsyncSession.commit(session)
        outcome = "committed"
    except IntegrityError as exc:
        outcome = classify(exc).value
        assert is_inbox_violation(exc)
    finally:
        await AsyncSession.close(session)
    return outcome, time.monotonic() - started


@pytest.mark.parametrize(("first", "expected"), [(True, "duplicate"), (False, "committed")])
async def test_a_copy_in_another_partition_waits_for_the_first_and_the_database_picks_one(
    engine: AsyncEngine, first: bool, expected: str
) -> None:
    release = asyncio.Event()
    holder = asyncio.create_task(hold_copy(engine, "m1", release, commit=first))
    await asyncio.sleep(0.2)  # the first copy's marker is in, uncommitted
    second = asyncio.create_task(second_copy(engine, "m1"))
    await asyncio.sleep(WAIT)
    assert not second.done()  # blocking is the feature: it waits for the first transaction
    release.set()
    await holder
    outcome, took = await second
    assert outcome == expected
    assert took >= WAIT
    [where] = await partition_of(engine, "m1")  # one marker, whichever copy won
    assert where.startswith("inbox_p") if first else where == "inbox_legacy"


async def test_a_committed_marker_in_any_partition_is_a_duplicate_of_the_inbox_constraint(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            text(
                "INSERT INTO inbox (message_id, consumer, stored_at) VALUES "
                f"('old', 'c', {PAST}), ('ahead', 'c', {AHEAD}), ('future', 'c', {FUTURE})"
            )
        )
    found = [(await partition_of(engine, m))[0] for m in ("old", "ahead", "future")]
    assert found[0] == "inbox_legacy" and found[1].startswith("inbox_p")
    assert found[2] == "inbox_default"
    for message_id in ("old", "ahead", "future"):
        outcome, _ = await second_copy(engine, message_id)
        assert outcome == Failure.DUPLICATE.value
    # another consumer of the same message records its own marker
    session: AsyncSession = session_factory(engine)()
    try:
        await inbox.mark(session, "old", "another-consumer")
        await AsyncSession.commit(session)
    finally:
        await AsyncSession.close(session)


async def test_an_insert_straight_into_a_partition_is_checked_too(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            text(f"INSERT INTO inbox (message_id, consumer, stored_at) VALUES ('m', 'c', {AHEAD})")
        )
    with pytest.raises(IntegrityError) as caught:
        async with engine.begin() as connection:
            await connection.execute(
                text("INSERT INTO inbox_legacy (message_id, consumer) VALUES ('m', 'c')")
            )
    assert is_inbox_violation(caught.value)


async def test_other_unique_violations_are_still_errors_not_duplicates(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as connection:
        await connection.execute(text("CREATE TABLE IF NOT EXISTS orders (no int UNIQUE)"))
        await connection.execute(text("DELETE FROM orders"))
        await connection.execute(text("INSERT INTO orders VALUES (1)"))
    session: AsyncSession = session_factory(engine)()
    try:
        await inbox.mark(session, "m-order", "c")
        with pytest.raises(IntegrityError) as caught:
            await session.execute(text("INSERT INTO orders VALUES (1)"))
    finally:
        await AsyncSession.close(session)
    assert classify(caught.value) is Failure.ERROR


async def test_a_batch_skips_keys_in_other_partitions_and_waits_for_one_in_flight(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            text(f"INSERT INTO inbox (message_id, consumer, stored_at) VALUES ('b1', 'c', {PAST})")
        )
    release = asyncio.Event()
    holder = asyncio.create_task(hold_copy(engine, "b2", release, commit=True))
    await asyncio.sleep(0.2)

    async def batch() -> set[str]:
        session: AsyncSession = session_factory(engine)()
        try:
            new = await inbox.mark_many(session, ["b3", "b2", "b1"], "c")
            await AsyncSession.commit(session)
            return new
        finally:
            await AsyncSession.close(session)

    marking = asyncio.create_task(batch())
    await asyncio.sleep(WAIT)
    assert not marking.done()
    release.set()
    await holder
    assert await marking == {"b3"}
    for message_id in ("b1", "b2", "b3"):
        assert len(await partition_of(engine, message_id)) == 1


async def test_a_claim_sees_markers_in_every_partition(engine: AsyncEngine) -> None:
    sessions = session_factory(engine)
    old = AHEAD
    async with engine.begin() as connection:
        await connection.execute(
            text(
                "INSERT INTO inbox (message_id, consumer, stored_at, state, processed_at, "
                "lease_until, claimed_by) VALUES "
                f"('done', 'mail', {old}, 'finished', now(), NULL, NULL), "
                f"('live', 'mail', {old}, 'claimed', NULL, now() + interval '1 hour', 'x'), "
                f"('given-up', 'mail', {old}, 'abandoned', now(), NULL, 'x')"
            )
        )
    assert await leases.acquire(sessions, "done", "mail", 30) is None
    held = await leases.acquire(sessions, "live", "mail", 30)
    assert isinstance(held, Held) and held.remaining > 3000
    taken = await leases.acquire(sessions, "given-up", "mail", 30)
    assert isinstance(taken, Claim) and taken.attempts == 2
    fresh = await leases.acquire(sessions, "new", "mail", 30)
    assert isinstance(fresh, Claim) and fresh.attempts == 1
    for message_id in ("done", "live", "given-up", "new"):
        assert len(await partition_of(engine, message_id)) == 1


async def test_repeatable_read_is_refused_its_snapshot_could_miss_a_commit(
    engine: AsyncEngine,
) -> None:
    async with engine.connect() as connection:
        await connection.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        with pytest.raises(DBAPIError, match="READ COMMITTED") as caught:
            await connection.execute(
                text("INSERT INTO inbox (message_id, consumer) VALUES ('rr', 'c')")
            )
    assert classify(caught.value) is Failure.ERROR


async def test_ids_keep_rising_and_the_fast_path_reads_every_partition(engine: AsyncEngine) -> None:
    session: AsyncSession = session_factory(engine)()
    try:
        await inbox.mark(session, "first", "c")
        await AsyncSession.commit(session)
        assert await inbox.seen(session, "first", "c")
        await AsyncSession.commit(session)
    finally:
        await AsyncSession.close(session)
    async with engine.begin() as connection:
        await connection.execute(
            text(
                "INSERT INTO inbox (message_id, consumer, stored_at) "
                f"VALUES ('elsewhere', 'c', {FUTURE})"
            )
        )
        ids: list[Any] = list(
            (await connection.execute(text("SELECT id FROM inbox ORDER BY id"))).scalars()
        )
    assert len(ids) == 2 and ids[0] < ids[1]
    session = session_factory(engine)()
    try:
        assert await inbox.seen(session, "elsewhere", "c")
    finally:
        await AsyncSession.close(session)


async def test_the_suites_database_has_the_layout_worker_test_inbox_names(
    postgres_only_url: str,
) -> None:
    """``WORKER_TEST_INBOX=partitioned`` runs every PostgreSQL test on the partitioned inbox."""
    engine = create_engine(postgres_only_url, pool_size=1)
    try:
        async with engine.connect() as connection:
            found = await partitions.layout(connection)
    finally:
        await engine.dispose()
    assert found == INBOX_LAYOUT
