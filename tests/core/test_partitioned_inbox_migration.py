"""From the plain inbox to the partitioned one (``worker migrate`` with
``WORKER_INBOX_LAYOUT=partitioned``): no marker lost, and no moment in which dedup is off,
even while copies race through the conversion."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from tests.support.database import fetch, own_database, scalar
from worker import inbox, leases
from worker.context import session_factory
from worker.db import Failure, classify, create_engine
from worker.leases import Claim, Held
from worker.migrate import upgrade

pytestmark = pytest.mark.postgres

OLD = 300  # finished markers in the plain table before the conversion
PERIOD = timedelta(hours=1)


@pytest.fixture
def plain_url() -> Iterator[str]:
    with own_database("worker_convert") as url:
        upgrade(url)
        yield url


async def seed(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        await connection.execute(text("CREATE TABLE effects (message_id text NOT NULL)"))
        await connection.execute(
            text(
                "INSERT INTO inbox (message_id, consumer) "
                f"SELECT 'old-' || n, 'c' FROM generate_series(1, {OLD}) AS n"
            )
        )
        await connection.execute(
            text(
                "INSERT INTO inbox (message_id, consumer, state, processed_at, lease_until, "
                "claimed_by) VALUES "
                "('claim-live', 'mail', 'claimed', NULL, now() + interval '1 hour', 'x'), "
                "('claim-given-up', 'mail', 'abandoned', now(), NULL, 'x')"
            )
        )


async def attempt(engine: AsyncEngine, message_id: str) -> str:
    """One copy, as the pump runs it: marker, the handler's write, one commit."""
    session: AsyncSession = session_factory(engine)()
    try:
        await inbox.mark(session, message_id, "c")
        await session.execute(text("INSERT INTO effects VALUES (:m)"), {"m": message_id})
        await asyncio.sleep(random.uniform(0, 0.02))
        await AsyncSession.commit(session)
        return "committed"
    except IntegrityError as exc:
        return classify(exc).value
    finally:
        await AsyncSession.close(session)


async def test_markers_of_the_plain_table_still_catch_their_duplicates_after_the_conversion(
    plain_url: str,
) -> None:
    engine = create_engine(plain_url, pool_size=4)
    try:
        await seed(engine)
        before = await fetch(plain_url, "SELECT id, message_id FROM inbox ORDER BY id")
        await asyncio.to_thread(
            upgrade, plain_url, inbox_layout="partitioned", partition_period=PERIOD
        )
        assert (
            await scalar(plain_url, "SELECT relkind::text FROM pg_class WHERE relname = 'inbox'")
            == "p"
        )
        after = await fetch(plain_url, "SELECT id, message_id FROM inbox ORDER BY id")
        assert after == before  # every marker kept, ids and all
        where = await fetch(plain_url, "SELECT DISTINCT tableoid::regclass::text FROM inbox")
        assert where == [("inbox_legacy",)]  # the old table is a partition, not a copy
        for n in (1, 150, OLD):
            assert await attempt(engine, f"old-{n}") == Failure.DUPLICATE.value
        session: AsyncSession = session_factory(engine)()
        try:
            assert await inbox.mark_many(session, ["old-7", "new-1", "old-8"], "c") == {"new-1"}
            await AsyncSession.commit(session)
        finally:
            await AsyncSession.close(session)
        sessions = session_factory(engine)
        held = await leases.acquire(sessions, "claim-live", "mail", 30)
        assert isinstance(held, Held) and held.remaining > 3000
        taken = await leases.acquire(sessions, "claim-given-up", "mail", 30)
        assert isinstance(taken, Claim) and taken.attempts == 2
        assert await attempt(engine, "new-2") == "committed"
        newest = await scalar(plain_url, "SELECT max(id) FROM inbox")
        assert newest > max(row[0] for row in before)  # the id sequence carried on
        # running it again changes nothing
        await asyncio.to_thread(
            upgrade, plain_url, inbox_layout="partitioned", partition_period=PERIOD
        )
        assert await scalar(plain_url, "SELECT count(*) FROM inbox") == len(before) + 2
    finally:
        await engine.dispose()


async def test_copies_racing_through_the_conversion_commit_once(plain_url: str) -> None:
    engine = create_engine(plain_url, pool_size=12)
    try:
        await seed(engine)
        outcomes: Counter[str] = Counter()
        old_commits: list[str] = []
        numbers = itertools.count(1)
        stop = asyncio.Event()

        async def writer() -> None:
            while not stop.is_set():
                message_id = f"new-{next(numbers)}"  # two copies of it, at the same moment
                both = await asyncio.gather(
                    attempt(engine, message_id), attempt(engine, message_id)
                )
                outcomes.update(both)
                old = f"old-{random.randint(1, OLD)}"  # a late copy of an old message
                if await attempt(engine, old) != Failure.DUPLICATE.value:
                    old_commits.append(old)

        writers = [asyncio.create_task(writer()) for _ in range(4)]
        await asyncio.sleep(0.5)
        started = sum(outcomes.values())
        began = time.monotonic()
        await asyncio.to_thread(
            upgrade, plain_url, inbox_layout="partitioned", partition_period=PERIOD
        )
        during = sum(outcomes.values()) - started
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*writers)
        assert started > 0 and during > 0, (started, during, time.monotonic() - began)
        assert set(outcomes) == {"committed", Failure.DUPLICATE.value}, outcomes
        assert outcomes["committed"] == outcomes[Failure.DUPLICATE.value]
        assert old_commits == []
        markers = await fetch(
            plain_url,
            "SELECT message_id, count(*) FROM inbox WHERE message_id LIKE 'new-%' GROUP BY 1",
        )
        effects = await fetch(plain_url, "SELECT message_id, count(*) FROM effects GROUP BY 1")
        assert len(markers) == outcomes["committed"]
        assert {m for m, n in markers if n != 1} == set()
        assert sorted(effects) == sorted(markers)  # one effect per marker, none without
        assert (
            await scalar(plain_url, "SELECT relkind::text FROM pg_class WHERE relname = 'inbox'")
            == "p"
        )
    finally:
        await engine.dispose()
