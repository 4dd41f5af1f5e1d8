"""A record whose handler hangs must not keep its partition: the watchdog (issue 15 item 4)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from tests.kafka.kafka_helpers import committed, produce
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaBroker, KafkaSettings
from worker.delivery import Delivery
from worker.errors import SettlementLost
from worker.settings import Settings

pytestmark = pytest.mark.kafka

NewTopic = Callable[[int], Awaitable[str]]


class ShortTimeout(Settings):
    """WORKER_HANDLER_TIMEOUT=0.5, WORKER_RETRY_BUDGET=0.1: overdue after 1.1 s with the margin."""

    handler_timeout: float | None = 0.5
    retry_budget: float = 0.1


async def test_a_hung_record_moves_its_partition_to_another_member(
    new_topic: NewTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(2)
    kafka = kafka_settings(topic, watchdog_margin=0.5, rebalance_grace=1.0)
    members = {"a": KafkaBroker(ShortTimeout(), kafka), "b": KafkaBroker(ShortTimeout(), kafka)}
    seen: list[tuple[str, str | None, int]] = []
    held: list[tuple[str, Delivery]] = []

    async def consume(name: str, broker: KafkaBroker) -> None:
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


async def _committed_0(bootstrap: str, group: str, topic: str) -> bool:
    return (await committed(bootstrap, group, topic, 2))[0] == 3
