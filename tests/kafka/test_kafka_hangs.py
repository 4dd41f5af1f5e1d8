"""A record whose handler hangs must not keep its partition: the watchdog (issue 15 item 4)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from tests.kafka.kafka_helpers import (
    MakeTopic,
    committed,
    committed_is,
    consuming,
    produce,
    receive,
)
from tests.support.pumps import MakeSettings
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer, KafkaSettings
from worker.db import create_engine
from worker.delivery import Delivery
from worker.errors import SettlementLost
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings

pytestmark = pytest.mark.kafka


class ShortTimeout(Settings):
    """WORKER_HANDLER_TIMEOUT=0.5, WORKER_RETRY_BUDGET=0.1: overdue after 1.1 s with the margin."""

    handler_timeout: float | None = 0.5
    retry_budget: float = 0.1
    delivery_counts: Literal["broker", "database"] = "broker"  # the transport alone here
    batch_size: int = 1  # one record of a partition out at a time


async def test_a_hung_record_moves_its_partition_to_another_member(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(2)
    kafka = kafka_settings(topic, watchdog_margin=0.5, rebalance_grace=1.0)
    members = {"a": KafkaConsumer(ShortTimeout(), kafka), "b": KafkaConsumer(ShortTimeout(), kafka)}
    seen: list[tuple[str, str | None, int]] = []
    held: list[tuple[str, Delivery]] = []

    async def consume(name: str, broker: KafkaConsumer) -> None:
        while True:
            delivery = await broker.receive()
            seen.append((name, delivery.message_id, delivery.delivery_count))
            if delivery.message_id == "m0" and not held:
                held.append((name, delivery))  # the handler hangs: never settled by it
                continue
            await delivery.ack()

    for broker in members.values():
        await broker.start(prefetch=4)
    tasks = [asyncio.create_task(consume(n, b)) for n, b in members.items()]
    try:
        await wait_for(
            lambda: all(len(b.assignment) == 1 for b in members.values()), 20, "one partition each"
        )
        await produce(
            bootstrap, topic, [(None, b"{}", {"message-id": f"m{n}"}, 0) for n in range(3)]
        )
        await wait_for(lambda: held, 10, "the first record")
        owner, hung = held[0]
        other = "b" if owner == "a" else "a"
        # the other member gets partition 0 and runs everything on it, m0 included
        rest = await wait_for(
            lambda: {m for who, m, _ in seen if who == other} >= {"m0", "m1", "m2"}, 20, "takeover"
        )
        assert rest
        assert not members[owner].ready  # out of the group while its record is overdue
        assert [m for who, m, _ in seen if who == owner] == ["m0"]
        await wait_for(
            lambda: _committed_0(bootstrap, kafka.group_id, topic), 10, "the commit of 3"
        )
        # the hung handler ends at last: its settlement is lost, and the member comes back
        with pytest.raises(SettlementLost):
            await hung.ack()
        await wait_for(lambda: members[owner].ready, 20, "the member back in the group")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for broker in members.values():
            await broker.stop_receiving()
            await broker.close()


async def test_a_record_whose_work_keeps_it_alive_keeps_its_partition(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    """Issue 21 defect 6: a record may take longer than its hand-out deadline (1.1 s here)
    when its unit of work says so at each phase; the member must not leave the group over
    it (it did, and the batch's committed records came back elsewhere)."""
    topic = await new_topic(1)
    kafka = kafka_settings(topic, watchdog_margin=0.5, rebalance_grace=1.0, commit_interval=0.05)
    await produce(bootstrap, topic, [(None, b"{}", {"message-id": "slow"}, 0)])
    async with consuming(kafka, ShortTimeout()) as broker:
        delivery = await receive(broker)
        started = time.monotonic()
        while time.monotonic() - started < 3.0:  # each phase: 0.5 s (+ the margin)
            delivery.keep_alive(0.5)
            await asyncio.sleep(0.3)
        assert broker.stats["watchdog_leaves"] == 0 and broker.ready
        await delivery.ack()  # still the partition's owner: not lost
        await wait_for(lambda: committed_is(bootstrap, kafka.group_id, topic, 1), 10, "commit")


async def _committed_0(bootstrap: str, group: str, topic: str) -> bool:
    return (await committed(bootstrap, group, topic, 2))[0] == 3


class Ping(BaseModel):
    name: str


async def test_a_handler_that_outlives_its_time_limit_loses_its_partition_to_another_pump(
    new_topic: MakeTopic,
    kafka_settings: Callable[..., KafkaSettings],
    bootstrap: str,
    sqlite_template: Path,
    tmp_path: Path,
    make_settings: MakeSettings,
) -> None:
    """End to end with the pump's WORKER_HANDLER_TIMEOUT: a handler that swallows the
    cancellation keeps running; the watchdog moves its partition to the other pump."""
    topic = await new_topic(2)
    calls: list[tuple[str, str]] = []  # (pump, message)
    release = asyncio.Event()

    def registry(name: str) -> Registry:
        reg = Registry()

        @reg.handler("Ping", Ping, consumer="ping", inbox=False)
        async def ping(ctx: Context, message: Ping) -> None:
            calls.append((name, message.name))
            if message.name == "hang" and len(calls) == 1:
                deadline = time.monotonic() + 30  # bounded: the test releases it sooner
                while not release.is_set() and time.monotonic() < deadline:
                    with contextlib.suppress(asyncio.CancelledError):  # the bug it survives
                        await asyncio.sleep(0.05)

        return reg

    database = tmp_path / "worker.db"
    shutil.copy(sqlite_template, database)
    url = f"sqlite+aiosqlite:///{database}"
    # one record of a partition out at a time: with groups "after" is handed out beside
    # "hang" and runs on the owner too once released (its settlement lost, as it should be)
    settings = make_settings(database_url=url, handler_timeout=0.5, retry_budget=0.1, batch_size=1)
    kafka = kafka_settings(topic, watchdog_margin=0.5, rebalance_grace=1.0)
    engines = [create_engine(url), create_engine(url)]
    brokers = {name: KafkaConsumer(settings, kafka) for name in ("a", "b")}
    pumps = {
        name: Pump(broker, engine, registry(name), settings)
        for (name, broker), engine in zip(brokers.items(), engines, strict=True)
    }
    runs = [asyncio.create_task(pump.run()) for pump in pumps.values()]
    try:
        await wait_for(
            lambda: all(len(b.assignment) == 1 for b in brokers.values()), 20, "a partition each"
        )
        ping = [(None, b'{"name": "%s"}' % n, {"message-id": n.decode(), "type": "Ping"}, 0)
                for n in (b"hang", b"after")]  # fmt: skip
        await produce(bootstrap, topic, ping)
        await wait_for(lambda: calls, 10, "the first call")
        owner = calls[0][0]
        other = "b" if owner == "a" else "a"
        await wait_for(
            lambda: {(other, "hang"), (other, "after")} <= set(calls), 20, "the other pump's calls"
        )
        assert not brokers[owner].ready and not pumps[owner].ready
        assert not release.is_set()  # the first call is still running meanwhile
        release.set()
        await wait_for(lambda: brokers[owner].ready, 20, "the owner back in the group")
    finally:
        release.set()
        for pump in pumps.values():
            pump.stop()
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 60)
        for engine in engines:
            await engine.dispose()
    assert pumps[owner].stats["settlement-lost"] == 1, pumps[owner].stats
    assert calls.count((owner, "after")) == 0
