"""Service Bus recovery against the fake: a failing receive recreates client and receiver,
a retired receiver's messages still settle, and shutdown gives back what is unsettled."""

from __future__ import annotations

import asyncio

from tests.servicebus.fake import Entity, FakeServiceBus
from tests.servicebus.sb_helpers import StartConsumer, msg, send, take
from tests.support.waiting import wait_for
from worker.brokers.servicebus import ServiceBusConsumer


async def test_receive_failures_recreate_client_and_receiver_and_report_not_ready(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    consumer = await consumers()
    assert consumer.ready
    seen_ready: list[bool] = []
    bus.fail("receive", times=3)
    watcher = asyncio.create_task(_watch(consumer, seen_ready))
    await send(bus, msg("m"))
    delivery = await take(consumer, seconds=5)
    watcher.cancel()
    await delivery.ack()
    assert False in seen_ready and consumer.ready
    assert consumer.stats["receive_failed"] == 3 and consumer.stats["reconnected"] >= 1
    assert len(bus.clients) >= 3  # a new client per reconnect (after the admin's sender client)


async def _watch(consumer: ServiceBusConsumer, seen: list[bool]) -> None:
    while True:
        seen.append(consumer.ready)
        await asyncio.sleep(0.005)


async def test_messages_of_a_retired_receiver_can_still_be_settled(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    old = delivery._handle.link
    bus.fail("receive")
    await wait_for(lambda: consumer.stats["reconnected"] >= 1, 5.0, "the reconnect", step=0.01)
    assert old.retired and not old.receiver._shutdown  # kept open for its unsettled message
    await delivery.ack()
    assert queue.stats["complete"] == 1 and old.receiver._shutdown


async def test_shutdown_gives_back_everything_unsettled_at_once(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("a"), msg("b"), msg("c"))
    consumer = await consumers()
    await wait_for(lambda: queue.locked == 3, 5.0, "three locked", step=0.01)
    held = await take(consumer)  # the pump's: in flight, never settled
    await consumer.stop_receiving()
    assert not consumer.ready
    assert queue.locked == 1 and queue.active == 2  # fetched, not taken: given back
    assert queue.stats["abandon"] == 0 and queue.stats["complete"] == 2  # copied, uncounted
    await consumer.close()
    assert queue.locked == 0 and queue.active == 3 and queue.stats["abandon"] == 1
    assert held.settled is None  # what the pump left unsettled: abandoned, as its lock would
