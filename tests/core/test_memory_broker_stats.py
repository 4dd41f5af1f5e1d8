"""The memory consumer as the pump sees it: a ``destination`` and its own event tallies
(``stats``), its share of the broker's, so pumps sharing one broker count nothing twice."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from worker.brokers.memory import MemoryBroker, open_broker
from worker.delivery import ack_many
from worker.errors import SettlementLost
from worker.settings import Settings


def test_the_destination_is_the_queue_name() -> None:
    assert MemoryBroker().connect().destination == "memory"
    assert MemoryBroker(queue="credits").connect().destination == "credits"
    assert open_broker(Settings()).destination == "memory"


async def test_settlements_move_the_consumers_counters() -> None:
    broker = MemoryBroker()
    consumer = broker.connect()
    assert consumer.stats == Counter()
    await consumer.start(prefetch=10)
    for name in ("a", "b", "c", "d", "e"):
        broker.publish(name, "T", b"{}")
    taken = {d.message_id: d for d in [await consumer.receive() for _ in range(5)]}
    assert await ack_many([taken["a"], taken["b"]]) == []
    await taken["c"].nack(counted=False)
    await taken["d"].dead_letter("poison")
    await taken["e"].nack()
    again = [await asyncio.wait_for(consumer.receive(), 1) for _ in range(2)]
    for delivery in again:
        await delivery.ack()
    # c came back uncounted (still its first delivery by count): only e is a redelivery
    assert consumer.stats == Counter(
        delivered=7, redelivered=1, ack_many=1, acked=4, nacked=2, nacked_uncounted=1,
        dead_lettered=1,
    )  # fmt: skip
    assert broker.idle


async def test_a_lost_ack_and_an_expired_lock_are_the_consumers_events() -> None:
    broker = MemoryBroker(visibility_timeout=0.05)
    consumer = broker.connect()
    await consumer.start(prefetch=5)
    broker.publish("slow", "T", b"{}")
    slow = await consumer.receive()
    again = await asyncio.wait_for(consumer.receive(), 1)  # re-offered: the lock expired
    with pytest.raises(SettlementLost):
        await slow.ack()
    assert consumer.stats["lock_expired"] == 1
    await again.ack()
    broker.publish("m1", "T", b"{}", lose_acks=1)
    await (await consumer.receive()).ack()
    await (await asyncio.wait_for(consumer.receive(), 1)).ack()
    assert (consumer.stats["acks_lost"], consumer.stats["acked"]) == (1, 2)
    assert broker.idle


async def test_consumers_of_one_broker_keep_their_own_shares() -> None:
    broker = MemoryBroker()
    a, b = broker.connect(), broker.connect()
    await a.start(prefetch=1)
    await b.start(prefetch=1)
    broker.publish("one", "T", b"{}")
    broker.publish("two", "T", b"{}")
    await (await a.receive()).ack()
    await (await b.receive()).dead_letter("no")
    assert (a.stats["acked"], a.stats["dead_lettered"]) == (1, 0)
    assert (b.stats["acked"], b.stats["dead_lettered"]) == (0, 1)
    assert a.stats + b.stats == broker.stats - Counter(published=2)


async def test_what_stop_receiving_gives_back_is_not_counted_as_a_settlement() -> None:
    broker = MemoryBroker()
    consumer = broker.connect()
    await consumer.start(prefetch=3)
    for name in ("a", "b", "c"):
        broker.publish(name, "T", b"{}")
    taken = await consumer.receive()
    await consumer.stop_receiving()  # b and c go back, uncounted
    await taken.ack()
    assert consumer.stats == Counter(delivered=3, acked=1)
    assert len(broker.ready) == 2 and broker.ready[0].delivery_count == 0
