"""WORKER_KAFKA_OFFSETS=database in process, on Tansu and PostgreSQL: the stored offset is
where a member starts, it moves in the handler's commit, and a member that lost its
partition cannot commit (its transaction is fenced)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncSession

from tests.kafka.kafka_helpers import MakeTopic, committed, consuming, produce, receive
from tests.support.database import execute, fetch, marker_count, scalar
from tests.support.waiting import wait_for
from worker import inbox
from worker.brokers.kafka import KafkaConsumer, KafkaSettings, load_kafka_settings
from worker.context import session_factory
from worker.db import create_engine
from worker.delivery import in_commit
from worker.errors import ConfigurationError, SettlementLost
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]


def test_offsets_setting_is_checked_with_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKER_KAFKA_OFFSETS", "postgres")
    with pytest.raises(ConfigurationError) as caught:
        load_kafka_settings()
    message = str(caught.value)
    assert message.startswith("WORKER_KAFKA_OFFSETS='postgres': ") and "\n" not in message
    assert "'broker' or 'database'" in message
    monkeypatch.setenv("WORKER_KAFKA_OFFSETS", "database")
    assert load_kafka_settings().offsets == "database"
    monkeypatch.delenv("WORKER_KAFKA_OFFSETS")
    assert load_kafka_settings().offsets == "broker"  # the default stays the broker's


def member(
    kafka: KafkaSettings, url: str, **core: Any
) -> contextlib.AbstractAsyncContextManager[KafkaConsumer]:
    return consuming(kafka, Settings(database_url=url, **core))


async def stored(url: str, group: str, topic: str) -> dict[int, int | None]:
    rows = await fetch(
        url,
        "SELECT partition, next_offset FROM consumer_offsets "
        f"WHERE group_id = '{group}' AND topic = '{topic}'",
    )
    return {int(row[0]): row[1] for row in rows}


def records(count: int, partition: int = 0) -> list[Any]:
    return [(None, b"{}", {"type": "Note"}, partition) for _ in range(count)]


async def test_a_member_starts_at_the_stored_offset_not_the_brokers(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], postgres_only_url: str
) -> None:
    url, topic = postgres_only_url, await new_topic(1)
    kafka = kafka_settings(topic, offsets="database")
    await produce(kafka.bootstrap_servers, topic, records(10))
    # The group has no broker offset (it would start at 0); the database says 6.
    await execute(
        url,
        "INSERT INTO consumer_offsets (group_id, topic, partition, next_offset, epoch) "
        f"VALUES ('{kafka.group_id}', '{topic}', 0, 6, 3)",
    )
    async with member(kafka, url) as broker:
        first = await receive(broker)
        assert first.headers is not None
        assert first.group == (topic, 0)
        assert first._handle.record.offset == 6
        assert await scalar(url, "SELECT epoch FROM consumer_offsets") == 4  # claimed
        engine = create_engine(url)
        try:
            session = session_factory(engine)()
            await in_commit(session, [first])  # what the worker does just before its commit
            await AsyncSession.commit(session)
            await AsyncSession.close(session)
        finally:
            await engine.dispose()
        assert await stored(url, kafka.group_id, topic) == {0: 7}
        await first.ack()
        await wait_for(  # the broker's commit follows, for lag monitoring only
            lambda: _is(committed(kafka.bootstrap_servers, kafka.group_id, topic, 1), {0: 7}),
            10,
            "the advisory broker commit",
        )


async def _is(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


class Note(BaseModel):
    pass


async def applied_table(url: str) -> None:
    await execute(url, "CREATE TABLE applied (topic text, part int, off bigint, member text)")


def note_registry(member_name: str, gate: asyncio.Event | None, started: list[int]) -> Registry:
    """A handler without the inbox (idempotent by its author's word): only the offset's
    fencing can stop a second application of one record."""
    registry = Registry()

    @registry.handler("Note", Note, consumer="note", inbox=False)
    async def note(ctx: Context, message: Note) -> None:
        topic, part, off = ctx.message_id.split("/")
        started.append(int(part))
        if gate is not None:
            await gate.wait()
        await ctx.session.execute(
            text("INSERT INTO applied VALUES (:t, :p, :o, :m)"),
            {"t": topic, "p": int(part), "o": int(off), "m": member_name},
        )

    return registry


async def test_a_member_whose_partition_was_reassigned_cannot_commit(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], postgres_only_url: str
) -> None:
    """`a` holds one record of each of two partitions in its handler when `b` joins. The
    rebalance gives one partition to `b`, which processes it at once; `a`'s handlers then
    finish. Both of `a`'s old transactions must be fenced (their assignment is over, and
    the records were read again from the stored offset): every record applied once."""
    url, topic = postgres_only_url, await new_topic(2)
    await applied_table(url)
    kafka = kafka_settings(topic, offsets="database", rebalance_grace=0.2)
    await produce(kafka.bootstrap_servers, topic, records(1, 0) + records(1, 1))
    settings = Settings(database_url=url, concurrency=4, retry_backoff=0.001, grace_period=5.0)
    gate, started_a, started_b = asyncio.Event(), list[int](), list[int]()
    engine = create_engine(url, pool_size=10)
    a = Pump(KafkaConsumer(settings, kafka), engine, note_registry("a", gate, started_a), settings)
    b = Pump(KafkaConsumer(settings, kafka), engine, note_registry("b", None, started_b), settings)
    tasks = [asyncio.create_task(a.run())]
    try:
        await wait_for(lambda: sorted(started_a) == [0, 1], 30, "a's two records in its handler")
        tasks.append(asyncio.create_task(b.run()))
        await wait_for(lambda: started_b, 30, "b's first record")
        await wait_for(
            lambda: scalar(url, "SELECT count(*) FROM applied WHERE member = 'b'"), 10, "b commits"
        )
        gate.set()  # a's old handlers finish now, after the partition moved
        await wait_for(
            lambda: _is(stored(url, kafka.group_id, topic), {0: 1, 1: 1}), 30, "both stored"
        )
        await asyncio.sleep(0.5)  # room for a late, unfenced commit to show up
    finally:
        gate.set()
        a.stop()
        b.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.dispose()
    rows = await fetch(url, "SELECT part, off, member FROM applied ORDER BY part")
    assert [(r[0], r[1]) for r in rows] == [(0, 0), (1, 0)], rows  # once each
    moved = [r[0] for r in rows if r[2] == "b"]
    assert moved, rows  # b applied the partition it got, a did not apply it again
    assert a.stats["committed"] + b.stats["committed"] == 2
    assert await stored(url, kafka.group_id, topic) == {0: 1, 1: 1}


async def test_a_batch_stores_the_contiguous_prefix_once_past_a_failure_in_the_middle(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], postgres_only_url: str
) -> None:
    """WORKER_BATCH_SIZE=4: four contiguous records of a partition out at once. The batch
    commits 0, 1 and 3 (2 failed): the stored offset and the broker commit stop at 2, and
    the rewind delivers 2 and 3 again."""
    url, topic = postgres_only_url, await new_topic(1)
    kafka = kafka_settings(topic, offsets="database", redelivery_delay=0.05)
    await produce(kafka.bootstrap_servers, topic, records(6))
    # WORKER_BATCH_SIZE=4 (worker/batch.py's setting; the adapter only reads the number)
    settings: Any = SimpleNamespace(**{**Settings(database_url=url).model_dump(), "batch_size": 4})
    broker = KafkaConsumer(settings, kafka)
    await broker.start(prefetch=4)
    engine = create_engine(url)
    statements: list[str] = []
    try:
        batch = [await receive(broker) for _ in range(4)]  # no settlement in between
        assert [d._handle.record.offset for d in batch] == [0, 1, 2, 3]
        assert {d.group for d in batch} == {(topic, 0)}

        def spy(*args: Any) -> None:
            statement = args[2]
            if "consumer_offsets" in statement:
                statements.append(statement)

        event.listen(engine.sync_engine, "before_cursor_execute", spy)
        session = session_factory(engine)()
        # what a batch runner does: its committed members, once, just before the commit
        await in_commit(session, [batch[0], batch[1], batch[3]])
        await AsyncSession.commit(session)
        await AsyncSession.close(session)
        assert len(statements) == 1  # once per partition per transaction, whatever the batch
        assert await stored(url, kafka.group_id, topic) == {0: 2}
        for delivery in (batch[0], batch[1], batch[3]):
            await delivery.ack()
        await batch[2].nack()
        await broker.offsets.commit(list(broker._partitions.values()))
        assert await committed(kafka.bootstrap_servers, kafka.group_id, topic, 1) == {0: 2}
        again = [await receive(broker) for _ in range(2)]
        assert [d._handle.record.offset for d in again] == [2, 3]
        assert again[0].delivery_count == 2
        assert await stored(url, kafka.group_id, topic) == {0: 2}
    finally:
        await broker.stop_receiving()
        await broker.close()
        await engine.dispose()


async def test_one_transaction_writes_each_partition_once_with_its_own_prefix(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], postgres_only_url: str
) -> None:
    """`in_commit` gets exactly the deliveries whose work commits in the transaction: one
    statement per partition, each row moved to its own contiguous prefix; a partition
    whose records do not extend its prefix (offset 1 done, 0 not) keeps its offset but
    is still written, so the epoch guard checks it (a fenced member fails here)."""
    url, topic = postgres_only_url, await new_topic(2)
    kafka = kafka_settings(topic, offsets="database")
    await produce(kafka.bootstrap_servers, topic, records(2, 0) + records(2, 1))
    settings = Settings(database_url=url, batch_size=2)  # two records per partition out
    engine = create_engine(url)
    statements: list[str] = []
    try:
        async with consuming(kafka, settings) as broker:
            taken = [await receive(broker) for _ in range(4)]
            out = {(d.group, d._handle.record.offset): d for d in taken}
            assert set(out) == {((topic, p), o) for p in (0, 1) for o in (0, 1)}

            def spy(*args: Any) -> None:
                if "consumer_offsets" in args[2]:
                    statements.append(args[2])

            event.listen(engine.sync_engine, "before_cursor_execute", spy)
            session = session_factory(engine)()
            mine = [out[(topic, 0), 0], out[(topic, 0), 1], out[(topic, 1), 1]]
            await in_commit(session, mine)
            await AsyncSession.commit(session)
            await AsyncSession.close(session)
            assert len(statements) == 2
            assert await stored(url, kafka.group_id, topic) == {0: 2, 1: None}
    finally:
        await engine.dispose()


async def test_a_fenced_transaction_rolls_back_and_the_row_keeps_the_new_owners_offset(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], postgres_only_url: str
) -> None:
    """A member that has not noticed the rebalance yet: another owner claimed the row and
    stored 5; this member's transaction (marker and all) must fail, not write 1."""
    url, topic = postgres_only_url, await new_topic(1)
    kafka = kafka_settings(topic, offsets="database")
    await produce(kafka.bootstrap_servers, topic, records(3))
    async with member(kafka, url) as broker:
        delivery = await receive(broker)
        await execute(  # the new owner's claim and commit, as the database sees them
            url, "UPDATE consumer_offsets SET epoch = epoch + 1, next_offset = 5"
        )
        engine = create_engine(url)
        try:
            session = session_factory(engine)()
            await inbox.mark(session, "zombie", "note")
            with pytest.raises(SettlementLost, match="claimed by another member"):
                await in_commit(session, [delivery])
            await AsyncSession.close(session)
        finally:
            await engine.dispose()
        assert await marker_count(url) == 0
        assert await stored(url, kafka.group_id, topic) == {0: 5}
        with pytest.raises(SettlementLost):  # not ours any more: never acked
            await delivery.ack()
        assert not delivery._handle.partition.owned
