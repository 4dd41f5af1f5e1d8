"""The memory broker is an honest at-least-once simulator, not a stub."""

from __future__ import annotations

import asyncio

import pytest

from worker.brokers.memory import MemoryBroker
from worker.errors import AlreadySettled, SettlementLost


async def test_ack_removes_and_nack_redelivers_with_higher_count() -> None:
    broker = MemoryBroker()
    consumer = broker.connect()
    await consumer.start(prefetch=1)
    broker.publish("m1", "T", b"{}")
    first = await consumer.receive()
    assert (first.message_id, first.delivery_count, first.redelivered) == ("m1", 1, False)
    await first.nack()
    second = await consumer.receive()
    assert (second.message_id, second.delivery_count, second.redelivered) == ("m1", 2, True)
    await second.ack()
    assert broker.idle and broker.stats["acked"] == 1 and broker.stats["nacked"] == 1


async def test_a_delivery_settles_once() -> None:
    broker = MemoryBroker()
    consumer = broker.connect()
    await consumer.start(prefetch=1)
    broker.publish("m1", "T", b"{}")
    delivery = await consumer.receive()
    await delivery.ack()
    with pytest.raises(AlreadySettled):
        await delivery.nack()
    with pytest.raises(AlreadySettled):
        await delivery.dead_letter("late")


async def test_dead_letter_keeps_message_and_reason() -> None:
    broker = MemoryBroker()
    consumer = broker.connect()
    await consumer.start(prefetch=1)
    broker.publish("m1", "T", b"body")
    await (await consumer.receive()).dead_letter("bad body")
    assert [(d.message.message_id, d.message.body, d.reason) for d in broker.dead_letters] == [
        ("m1", b"body", "bad body")
    ]
    assert broker.idle


async def test_prefetch_bounds_unsettled_deliveries() -> None:
    broker = MemoryBroker()
    consumer = broker.connect()
    await consumer.start(prefetch=2)
    for n in range(5):
        broker.publish(f"m{n}", "T", b"{}")
    assert len(consumer.unsettled) == 2 and len(broker.ready) == 3
    await (await consumer.receive()).ack()
    assert len(consumer.unsettled) == 2 and len(broker.ready) == 2


async def test_vanished_consumer_gives_its_messages_back() -> None:
    broker = MemoryBroker()
    doomed, survivor = broker.connect(), broker.connect()
    await doomed.start(prefetch=10)
    broker.publish("m1", "T", b"{}")
    taken = await doomed.receive()
    await survivor.start(prefetch=10)
    doomed.crash()
    again = await asyncio.wait_for(survivor.receive(), 1)
    assert (again.message_id, again.delivery_count) == ("m1", 2)
    with pytest.raises(SettlementLost):
        await taken.ack()  # the dead consumer's ack reaches nobody


async def test_visibility_timeout_reoffers_and_kills_the_old_lock() -> None:
    broker = MemoryBroker(visibility_timeout=0.05)
    consumer = broker.connect()
    await consumer.start(prefetch=5)
    broker.publish("m1", "T", b"{}")
    slow = await consumer.receive()
    again = await asyncio.wait_for(consumer.receive(), 1)
    assert (again.message_id, again.delivery_count) == ("m1", 2)
    with pytest.raises(SettlementLost):
        await slow.ack()
    await again.ack()
    assert broker.stats["lock_expired"] == 1 and broker.idle


async def test_copies_are_producer_duplicates_and_to_all_reaches_every_consumer() -> None:
    broker = MemoryBroker()
    a, b = broker.connect(), broker.connect()
    await a.start(prefetch=10)
    await b.start(prefetch=10)
    broker.publish("dup", "T", b"{}", copies=2)
    broker.publish("both", "T", b"{}", to_all=True)
    got_a = [(await a.receive()).message_id for _ in range(len(a.unsettled))]
    got_b = [(await b.receive()).message_id for _ in range(len(b.unsettled))]
    assert sorted(got_a + got_b, key=str) == ["both", "both", "dup", "dup"]
    assert "both" in got_a and "both" in got_b


async def test_lost_ack_is_redelivered() -> None:
    broker = MemoryBroker()
    consumer = broker.connect()
    await consumer.start(prefetch=1)
    broker.publish("m1", "T", b"{}", lose_acks=1)
    await (await consumer.receive()).ack()
    again = await asyncio.wait_for(consumer.receive(), 1)
    assert again.delivery_count == 2
    await again.ack()
    assert broker.stats["acks_lost"] == 1 and broker.stats["acked"] == 1 and broker.idle


async def test_nack_delay_holds_the_message_back() -> None:
    broker = MemoryBroker()
    consumer = broker.connect()
    await consumer.start(prefetch=1)
    broker.publish("m1", "T", b"{}")
    await (await consumer.receive()).nack(delay=0.2)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(consumer.receive(), 0.05)
    assert not broker.idle
    assert (await asyncio.wait_for(consumer.receive(), 1)).delivery_count == 2
