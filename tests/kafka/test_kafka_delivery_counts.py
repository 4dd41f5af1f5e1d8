"""WORKER_DELIVERY_COUNTS=database on Kafka, in process: which deliveries are counted in the
database (redeliveries, records a previous owner may have started), and which are not."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from tests.kafka.kafka_helpers import MakeTopic, consuming, produce, receive
from tests.support.database import fetch
from tests.support.pumps import engine_for, running_pump
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer, KafkaSettings
from worker.db import create_engine
from worker.delivery import Delivery
from worker.errors import ConfigurationError
from worker.registry import Context, Registry
from worker.settings import Settings, load

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]


def test_delivery_count_settings_are_checked_with_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKER_DELIVERY_COUNTS", "disk")
    with pytest.raises(ConfigurationError) as caught:
        load(Settings)
    message = str(caught.value)
    assert message.startswith("WORKER_DELIVERY_COUNTS='disk': ") and "\n" not in message
    monkeypatch.setenv("WORKER_DELIVERY_COUNTS", "broker")
    monkeypatch.setenv("WORKER_COUNT_FIRST_DELIVERIES", "maybe")
    with pytest.raises(ConfigurationError) as caught:
        load(Settings)
    assert str(caught.value).startswith("WORKER_COUNT_FIRST_DELIVERIES='maybe': ")
    monkeypatch.delenv("WORKER_COUNT_FIRST_DELIVERIES")
    assert load(Settings).delivery_counts == "broker"
    monkeypatch.delenv("WORKER_DELIVERY_COUNTS")
    assert load(Settings).delivery_counts == "database"  # started attempts, unless told


class Step(BaseModel):
    tag: str


def step(tag: str) -> tuple[bytes | None, bytes, dict[str, str], int | None]:
    return (None, f'{{"tag": "{tag}"}}'.encode(), {"type": "Step", "message-id": tag}, 0)


async def counts(url: str) -> dict[str, int]:
    rows = await fetch(url, "SELECT message_id, deliveries FROM delivery_counts")
    return {row[0]: int(row[1]) for row in rows}


@pytest.mark.parametrize("first", [False, True])
async def test_redeliveries_are_counted_and_first_deliveries_only_when_asked(
    new_topic: MakeTopic,
    kafka_settings: Callable[..., KafkaSettings],
    postgres_only_url: str,
    first: bool,
) -> None:
    url, topic = postgres_only_url, await new_topic(1)
    kafka = kafka_settings(topic, redelivery_delay=0.05)
    await produce(kafka.bootstrap_servers, topic, [step("ok"), step("flaky"), step("ok-2")])
    settings = Settings(
        database_url=url,
        delivery_counts="database",
        count_first_deliveries=first,
        concurrency=2,
        retry_backoff=0.001,
    )
    seen: list[tuple[str, int]] = []
    registry = Registry()

    @registry.handler("Step", Step, consumer="step")
    async def run(ctx: Context, message: Step) -> None:
        seen.append((message.tag, ctx.delivery_count))
        if message.tag == "flaky" and ctx.delivery_count == 1:
            raise RuntimeError("the first try fails")

    async with (
        engine_for(url) as engine,
        running_pump(KafkaConsumer(settings, kafka), engine, registry, settings),
    ):
        await wait_for(lambda: len(seen) == 4, 30, "four handler runs")
    assert seen == [("ok", 1), ("flaky", 1), ("flaky", 2), ("ok-2", 1)]
    if first:  # every delivery: one round trip each
        assert await counts(url) == {"ok": 1, "flaky": 2, "ok-2": 1}
    else:  # only the redelivery: the first deliveries cost nothing
        assert await counts(url) == {"flaky": 1}


def member(kafka: KafkaSettings, url: str) -> contextlib.AbstractAsyncContextManager[KafkaConsumer]:
    settings = Settings(database_url=url, delivery_counts="database")
    return consuming(kafka, settings, prefetch=1)


def offset(delivery: Delivery) -> Any:
    return delivery._handle.record.offset


@pytest.mark.parametrize("offsets", ["broker", "database"])
async def test_records_a_crashed_owner_may_have_started_come_as_redeliveries(
    new_topic: MakeTopic,
    kafka_settings: Callable[..., KafkaSettings],
    postgres_only_url: str,
    offsets: str,
) -> None:
    """`a` hands out record 0 and dies without a word (no commit, no hand-over): the next
    owner gets record 0 as a possible redelivery (count at least 2, so the pump counts it
    in the database), not as a first delivery that nothing would count."""
    url, topic = postgres_only_url, await new_topic(1)
    kafka = kafka_settings(topic, offsets=offsets, commit_interval=3600)
    await produce(kafka.bootstrap_servers, topic, [step("m0"), step("m1")])
    a = KafkaConsumer(Settings(database_url=url, delivery_counts="database"), kafka)
    await a.start(prefetch=1)
    try:
        first = await receive(a)
        assert (offset(first), first.delivery_count, first.suspect) == (0, 1, False)
        rows = await fetch(url, "SELECT started_through FROM consumer_offsets")
        assert rows and rows[0][0] >= 0  # recorded before the record was handed out
    finally:
        a._stopping = True  # the crash: no commit, no hand-over, only the connection ends
        await a._cancel_tasks()
        await a._stop_clients()
    async with member(kafka, url) as b:
        again = await receive(b)
        assert offset(again) == 0 and again.delivery_count >= 2
        assert again.suspect  # it may have been running when `a` died
        await again.ack()
        later = await receive(b)
        assert offset(later) == 1 and later.delivery_count >= 2  # reserved ahead: suspect too
        assert later.suspect


async def test_without_durable_counts_nothing_is_known_to_be_suspect(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], postgres_only_url: str
) -> None:
    """Suspects need the reservation (WORKER_DELIVERY_COUNTS=database): with database
    offsets alone, the row says where to start, not what a dead owner had started."""
    url, topic = postgres_only_url, await new_topic(1)
    kafka = kafka_settings(topic, offsets="database", commit_interval=3600)
    await produce(kafka.bootstrap_servers, topic, [step("m0")])
    a = KafkaConsumer(Settings(database_url=url, delivery_counts="broker"), kafka)
    await a.start(prefetch=1)
    try:
        assert offset(await receive(a)) == 0
    finally:
        a._stopping = True  # the crash
        await a._cancel_tasks()
        await a._stop_clients()
    unsure = Settings(database_url=url, delivery_counts="broker")
    async with consuming(kafka, unsure, prefetch=1) as b:
        again = await receive(b)
        assert (offset(again), again.delivery_count, again.suspect) == (0, 1, False)


async def test_after_a_clean_hand_over_nothing_is_suspect(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], postgres_only_url: str
) -> None:
    url, topic = postgres_only_url, await new_topic(1)
    kafka = kafka_settings(topic, offsets="database")
    await produce(kafka.bootstrap_servers, topic, [step("m0"), step("m1")])
    async with member(kafka, url) as a:
        first = await receive(a)
        await first.ack()
    # `a` stored offset 1 and recorded that nothing after 0 was started
    assert (await fetch(url, "SELECT next_offset, started_through FROM consumer_offsets")) == [
        (1, 0)
    ]
    async with member(kafka, url) as b:
        nxt = await receive(b)
        assert (offset(nxt), nxt.delivery_count, nxt.suspect) == (1, 1, False)


@pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
async def test_delivery_counts_age_out_with_the_inbox_markers(database_url: str) -> None:
    from datetime import UTC, datetime, timedelta

    from tests.support.database import execute
    from worker import retention

    settings = Settings(database_url=database_url, purge_batch=2)
    now = datetime.now(UTC)
    old = (now - settings.retention - timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S")
    await execute(
        database_url,
        *[
            f"INSERT INTO delivery_counts (message_id, consumer, deliveries, updated_at) "
            f"VALUES ('old-{n}', 'c', 2, '{old}')"
            for n in range(5)
        ],
        "INSERT INTO delivery_counts (message_id, consumer, deliveries) VALUES ('new', 'c', 3)",
    )
    engine = create_engine(database_url)
    try:
        result = await retention.purge(engine, settings, now=now, pause=0)
    finally:
        await engine.dispose()
    assert result.ran
    assert await counts(database_url) == {"new": 3}
