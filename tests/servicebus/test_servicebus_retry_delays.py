"""Service Bus retry delays, held on the lock: a delayed nack keeps the renewed lock, never
past the renewal window, abandons at once without renewal or at close, and frees its slot
as soon as the lock is lost."""

from __future__ import annotations

import asyncio

from azure.servicebus import ServiceBusMessage
from azure.servicebus.exceptions import MessageLockLostError

from tests.servicebus.fake import FakeServiceBus
from tests.servicebus.sb_helpers import StartConsumer, take


async def send(bus: FakeServiceBus, *message_ids: str) -> None:
    messages = [
        ServiceBusMessage(b"{}", message_id=m, application_properties={"type": "T"})
        for m in message_ids
    ]
    await bus.client().get_queue_sender("work").send_messages(messages)


async def test_a_retry_delay_past_lock_renewal_is_cut_to_it(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    queue = bus.create_queue("work", lock_duration=4.0)
    await send(bus, "m1", "m2")
    consumer = await consumers(1, max_lock_renewal=2.0)  # margin 0.5 s: held 1.5 s at most
    loop = asyncio.get_running_loop()
    first = await take(consumer, seconds=3)
    started = loop.time()
    await first.nack(30.0)
    assert queue.stats["abandon"] == 0 and consumer.unsettled == 1  # held, for now

    seen = []
    for _ in range(2):
        delivery = await take(consumer, seconds=4)  # not 30 s: the hold was cut
        seen.append((delivery.message_id, delivery.delivery_count))
        await delivery.ack()
    assert 1.0 <= loop.time() - started < 4.0
    assert sorted(seen) == [("m1", 2), ("m2", 1)]
    assert queue.stats["abandon"] == 1 and queue.stats["lock_expired"] == 0
    assert consumer.stats["retry_delay_capped"] == 1
    assert consumer.stats["settlement_lost"] == 0 and consumer.stats["lock_lost"] == 0


async def test_without_lock_renewal_a_retry_delay_abandons_at_once(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    queue = bus.create_queue("work", lock_duration=5.0)
    await send(bus, "m1")
    consumer = await consumers(1, max_lock_renewal=0)
    await (await take(consumer, seconds=3)).nack(30.0)
    assert queue.stats["abandon"] == 1 and consumer.unsettled == 0
    again = await take(consumer, seconds=3)
    assert again.message_id == "m1" and again.delivery_count == 2
    await again.ack()


async def test_a_lock_lost_during_a_retry_delay_frees_the_slot(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    # A 3 s lock is first renewed at about 2 s; that renewal fails.
    queue = bus.create_queue("work", lock_duration=3.0)
    bus.fail("renew", lambda: MessageLockLostError(message="lock lost (injected)"))
    await send(bus, "m1", "m2")
    consumer = await consumers(1)  # one slot; renewal on for 300 s
    await (await take(consumer, seconds=3)).nack(30.0)

    second = await take(consumer, seconds=6)  # the slot came back with the lost lock
    assert second.message_id == "m2" and second.delivery_count == 1
    assert consumer.stats["lock_lost"] == 1
    assert queue.stats["abandon"] == 0  # nothing is settled on a lock known lost
    await second.ack()
    again = await take(consumer, seconds=5)  # the entity re-offers it when the lock runs out
    assert again.message_id == "m1" and again.delivery_count == 2
    await again.ack()
    assert consumer.unsettled == 0 and consumer.stats["settlement_lost"] == 0


async def test_close_during_a_retry_delay_abandons_at_once(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    queue = bus.create_queue("work", lock_duration=5.0)
    await send(bus, "m1")
    consumer = await consumers(1)
    await (await take(consumer, seconds=3)).nack(30.0)
    assert queue.stats["abandon"] == 0
    async with asyncio.timeout(5):
        await consumer.close()
    assert queue.stats["abandon"] == 1 and queue.locked == 0 and queue.active == 1
