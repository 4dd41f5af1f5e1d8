"""Service Bus: a deployment's id function that raises, and retry delays held on the lock.

An id function's exception costs only its own message (the rest of the batch is
handed on, the link stays up). A delayed nack holds the renewed lock, never past the
renewal window, and frees its slot as soon as the lock is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage
from azure.servicebus.exceptions import MessageLockLostError

from tests.servicebus.fake import FakeServiceBus
from tests.servicebus.sb_settings import sb_settings
from worker.brokers.servicebus import (
    ServiceBusConsumer,
    default_message_id,
    open_broker,
)
from worker.delivery import Delivery
from worker.settings import Settings


def tenant_id(message: ServiceBusReceivedMessage) -> str | None:
    """A deployment's WORKER_MESSAGE_ID_FUNC meeting a message it was not written for."""
    if message.message_id == "bad":
        raise KeyError("tenant")
    return default_message_id(message)


async def send(bus: FakeServiceBus, *message_ids: str) -> None:
    messages = [
        ServiceBusMessage(b"{}", message_id=m, application_properties={"type": "T"})
        for m in message_ids
    ]
    await bus.client().get_queue_sender("work").send_messages(messages)


async def take(consumer: ServiceBusConsumer, seconds: float) -> Delivery:
    async with asyncio.timeout(seconds):
        return await consumer.receive()


# -- the deployment's message-id function ---------------------------------------------


async def test_an_id_function_that_raises_costs_only_its_own_message(bus: FakeServiceBus) -> None:
    queue = bus.create_queue("work", lock_duration=5.0, max_delivery_count=3)
    await send(bus, "m-1", "bad", "m-3")  # one batch
    path = f"{__name__}:tenant_id"
    with structlog.testing.capture_logs() as logs:
        consumer = open_broker(
            Settings(broker="servicebus", message_id_func=path, max_deliveries=2),
            servicebus=sb_settings(),
            client_factory=bus.client,
        )
        await consumer.start(10)
        try:
            deliveries = [await take(consumer, seconds=3) for _ in range(3)]
            by_id = {d.message_id: d for d in deliveries}
            assert set(by_id) == {"m-1", None, "m-3"}
            await by_id[None].dead_letter("no message id")  # what the pump does with it
            await by_id["m-1"].ack()
            await by_id["m-3"].ack()
            assert consumer.stats["identity_failed"] == 1
            assert consumer.stats["receive_failed"] == 0  # the link was not retired for it
        finally:
            await consumer.close()

    assert queue.stats["complete"] == 2 and queue.locked == 0 and queue.active == 0
    assert queue.dead_letter is not None
    [letter] = queue.dead_letter.messages()
    assert letter.message_id == "bad"
    assert letter.broker_properties["DeadLetterReason"] == "no message id"  # the pump's reason
    [failed] = [e for e in logs if e["event"] == "message id function failed"]
    assert failed["log_level"] == "warning" and failed["broker_message_id"] == "bad"
    assert "KeyError" in failed["error"] and failed["delivery_count"] == 1
    assert failed["sequence_number"] == letter.sequence_number


# -- a retry delay longer than the lock can be held -------------------------------------


async def test_a_retry_delay_past_lock_renewal_is_cut_to_it(
    bus: FakeServiceBus, consumers: Callable[..., Any]
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
    bus: FakeServiceBus, consumers: Callable[..., Any]
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
    bus: FakeServiceBus, consumers: Callable[..., Any]
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
    bus: FakeServiceBus, consumers: Callable[..., Any]
) -> None:
    queue = bus.create_queue("work", lock_duration=5.0)
    await send(bus, "m1")
    consumer = await consumers(1)
    await (await take(consumer, seconds=3)).nack(30.0)
    assert queue.stats["abandon"] == 0
    async with asyncio.timeout(5):
        await consumer.close()
    assert queue.stats["abandon"] == 1 and queue.locked == 0 and queue.active == 1
