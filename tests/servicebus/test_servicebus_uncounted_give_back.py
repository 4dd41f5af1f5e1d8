"""Service Bus give-backs the message is not to blame for keep its delivery count.

``abandon_message`` always raises the entity's DeliveryCount, so ``nack(counted=False)``
sends a copy carrying the count so far, waits for the broker to take it, and only then
completes the original. The count is honoured only on the worker's own copy: a dead
letter moved back later, properties and all, starts from 1.
"""

from __future__ import annotations

import asyncio
import time
from uuid import UUID

import pytest
import structlog
from azure.servicebus import ServiceBusMessage

from tests.servicebus.fake import Entity, FakeServiceBus
from tests.servicebus.sb_helpers import StartConsumer, send, take
from tests.servicebus.sb_settings import sb_settings
from tests.support.waiting import wait_for
from worker.brokers.servicebus import (
    COPIED_AT_PROPERTY,
    DELIVERIES_PROPERTY,
    GIVE_BACKS_PROPERTY,
    ServiceBusAdmin,
)
from worker.errors import SettlementLost


@pytest.fixture
def queue(bus: FakeServiceBus) -> Entity:
    return bus.create_queue("work", lock_duration=5.0)


def msg(message_id: str, **properties: str | int) -> ServiceBusMessage:
    # the SDK's application properties are keyed by str | bytes (a dict: invariant)
    application: dict[str | bytes, int | float | bytes | str | UUID]
    application = {"type": "CreditRequested", "tenant": "t1"}
    application.update(properties.items())
    return ServiceBusMessage(
        b'{"amount": "1"}',
        message_id=message_id,
        subject="CreditRequested",
        correlation_id="conversation-1",
        application_properties=application,
    )


# -- nack(counted=False) -------------------------------------------------------------


async def test_an_uncounted_nack_keeps_the_count_and_a_counted_one_still_raises_it(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    counts = []
    for counted in (True, False, False, True, False):
        delivery = await take(consumer)
        counts.append(delivery.delivery_count)
        await delivery.nack(counted=counted)
    last = await take(consumer)
    counts.append(last.delivery_count)
    assert counts == [1, 2, 2, 2, 3, 3]
    assert last.message_id == "m" and last.type == "CreditRequested"
    assert last.body == b'{"amount": "1"}'
    assert dict(last.headers) == {"type": "CreditRequested", "tenant": "t1"}  # no worker's own
    assert last._handle.message.correlation_id == "conversation-1"
    await last.ack()
    assert queue.stats["abandon"] == 2 and queue.stats["complete"] == 4  # 3 originals + ack
    assert consumer.stats["given_back_uncounted"] == 3 and queue.count == 0


async def test_the_pump_dead_letters_by_the_carried_count(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    await (await take(consumer)).nack()  # its own failure: 2
    await (await take(consumer)).nack(counted=False)  # a database outage: still 2
    delivery = await take(consumer)
    assert delivery.delivery_count == 2
    await delivery.dead_letter("credit: ValueError: boom")
    assert queue.dead_letter is not None
    [letter] = queue.dead_letter.messages()
    description = letter.broker_properties["DeadLetterErrorDescription"]
    assert description.startswith("dead-lettered by the worker on delivery 2:")


async def test_the_copy_is_confirmed_before_the_original_is_released(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers(try_timeout=0.3)  # a send is given up after ~1.3 s
    delivery = await take(consumer)
    bus.hang("send")
    nacking = asyncio.create_task(delivery.nack(counted=False))
    await asyncio.sleep(0.5)
    assert not nacking.done()
    assert queue.locked == 1 and queue.stats["complete"] == 0  # the original still held
    async with asyncio.timeout(5):
        await nacking  # the copy never confirmed: the original is abandoned (counted)
    assert queue.stats["abandon"] == 1 and queue.stats["complete"] == 0
    assert consumer.stats["give_back_copy_failed"] == 1
    again = await take(consumer)
    assert again.delivery_count == 2 and queue.count == 1  # one message, not lost, no copy
    await again.ack()


async def test_a_refused_copy_falls_back_to_a_counted_abandon(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    bus.fail("send")
    await (await take(consumer)).nack(counted=False)
    again = await take(consumer)
    assert again.delivery_count == 2 and queue.stats["abandon"] == 1
    await again.ack()


async def test_a_complete_that_fails_after_the_copy_leaves_a_duplicate_not_a_loss(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    bus.fail("complete")
    with pytest.raises(SettlementLost, match="complete failed"):
        await delivery.nack(counted=False)
    assert queue.count == 2 and queue.stats["complete"] == 0  # the copy, and the original
    copy = await take(consumer)  # the original comes back too, when its lock runs out
    assert copy.message_id == "m" and copy.delivery_count == 1


async def test_a_topic_subscription_abandons_instead_of_copying_to_every_subscription(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    mine = bus.create_subscription("events", "billing")
    other = bus.create_subscription("events", "audit")
    await bus.client().get_topic_sender("events").send_messages(msg("m"))
    consumer = await consumers(queue=None, topic="events", subscription="billing")
    await (await take(consumer)).nack(counted=False)
    again = await take(consumer)
    assert again.delivery_count == 2  # counted: Service Bus cannot send to one subscription
    assert mine.stats["abandon"] == 1 and other.count == 1  # the audit copy, and no other
    await again.ack()


async def test_a_delayed_uncounted_nack_holds_then_copies(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    await (await take(consumer)).nack(0.3, counted=False)
    assert queue.locked == 1 and queue.stats["complete"] == 0
    again = await take(consumer)
    assert again.delivery_count == 1 and queue.stats["abandon"] == 0
    await again.ack()


async def test_uncounted_give_backs_are_counted_on_the_copy_and_read_back(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    """The bound for give-backs that spend no delivery: the copy carries how many there
    were, a counted abandon keeps it, and handlers never see the property."""
    await send(bus, msg("m"))
    consumer = await consumers()
    seen = []
    for counted in (False, False, True, False):
        delivery = await take(consumer)
        seen.append((delivery.delivery_count, delivery.give_backs))
        await delivery.nack(counted=counted)
    last = await take(consumer)
    seen.append((last.delivery_count, last.give_backs))
    assert seen == [(1, 0), (1, 1), (1, 2), (2, 2), (2, 3)]
    assert GIVE_BACKS_PROPERTY not in last.headers and DELIVERIES_PROPERTY not in last.headers
    await last.ack()


async def test_messages_the_worker_returns_on_its_own_keep_their_give_backs(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    """Fetched and never taken (a stop): the worker's own return, not the pump's verdict."""
    await send(bus, msg("m"))
    first = await consumers(slots=1)
    await (await take(first)).nack(counted=False)  # the pump's give-back: 1
    await wait_for(lambda: queue.locked == 1, 10, "the copy fetched, not taken")
    await first.stop_receiving()  # given back uncounted by the consumer itself
    successor = await consumers(slots=1)
    again = await take(successor)
    assert (again.delivery_count, again.give_backs) == (1, 1)
    await again.ack()


# -- the carried count: only on the worker's own copy --------------------------------


async def test_a_dead_letter_moved_back_by_an_operator_tool_starts_fresh(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    # An operator tool's copy of a dead letter the worker's give-back produced an hour
    # ago: the worker's properties came along, but the broker enqueued it just now.
    an_hour_ago = str(int((time.time() - 3600) * 1000))
    copied: dict[str, str | int] = {
        DELIVERIES_PROPERTY: 4,
        GIVE_BACKS_PROPERTY: 7,
        COPIED_AT_PROPERTY: an_hour_ago,
    }
    moved = msg("m", **copied)
    forged = msg("f", **{DELIVERIES_PROPERTY: "four", COPIED_AT_PROPERTY: "now"})
    fresh = str(int(time.time() * 1000))  # a stamp the worker's own copy could carry
    unreadable: dict[str, str | int] = {
        DELIVERIES_PROPERTY: 1,
        GIVE_BACKS_PROPERTY: "x",
        COPIED_AT_PROPERTY: fresh,
    }
    odd = msg("g", **unreadable)
    await send(bus, moved, forged, odd)
    consumer = await consumers()
    with structlog.testing.capture_logs() as logs:
        taken = [await take(consumer) for _ in "mfg"]
    counts = {d.message_id: (d.delivery_count, d.give_backs) for d in taken}
    assert counts == {"m": (1, 0), "f": (1, 0), "g": (1, 0)}
    assert consumer.stats["carried_count_ignored"] == 3
    ignored = [e for e in logs if e["event"].startswith("servicebus carried delivery count")]
    assert {e["message_id"] for e in ignored} == {"m", "f", "g"}


async def test_worker_dlq_resubmit_of_a_given_back_message_starts_fresh(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    for _ in range(2):
        await (await take(consumer)).nack()
    await (await take(consumer)).nack(counted=False)
    delivery = await take(consumer)
    assert delivery.delivery_count == 3
    await delivery.dead_letter("exhausted")
    admin = ServiceBusAdmin(sb_settings(), bus.client)
    try:
        assert await admin.resubmit(10) == 1
    finally:
        await admin.close()
    again = await take(consumer)  # resubmitted within a second, yet from 1
    assert again.message_id == "m" and again.delivery_count == 1
    assert consumer.stats["carried_count_ignored"] == 0  # the copy carries nothing any more
    await again.ack()


# -- shutdown --------------------------------------------------------------------------


async def test_stop_gives_back_untaken_messages_uncounted_and_together(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, *(msg(f"m-{n}") for n in range(8)))
    consumer = await consumers(slots=8)
    await wait_for(lambda: queue.locked == 8, 10, "all eight fetched (none taken)")
    bus.latency = 0.3  # one by one this would take 8 round trips: 2.4 s
    started = time.monotonic()
    await consumer.stop_receiving()
    assert time.monotonic() - started < 2.0  # one send, then the completes side by side
    bus.latency = 0.0
    assert queue.locked == 0 and queue.active == 8 and queue.stats["abandon"] == 0
    assert consumer.stats["given_back_uncounted"] == 8

    successor = await consumers(slots=8)
    counts = sorted([(await take(successor)).delivery_count for _ in range(8)])
    assert counts == [1] * 8


async def test_stop_is_bounded_when_the_give_back_hangs(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, *(msg(f"m-{n}") for n in range(3)))
    consumer = await consumers(slots=3, give_back_timeout=0.5)
    await wait_for(lambda: queue.locked == 3, 10, "all three fetched (none taken)")
    bus.hang("complete", times=3)
    started = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        await consumer.stop_receiving()
    assert time.monotonic() - started < 3.0  # not 3 x the SDK's bound (2 s each here)
    assert consumer.stats["give_back_timed_out"] == 3
    assert any(e["event"].startswith("servicebus give-back at stop cut short") for e in logs)
    assert queue.locked == 3  # the originals run out on their own; the copies are there
    assert queue.active == 3


# -- a long database outage: messages the pump does not take --------------------------


async def test_an_untaken_message_goes_back_uncounted_before_renewal_ends(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    # A 3 s lock, renewed for 1.5 s: without the give-back it would expire at ~4.5 s
    # and come back counted (and, past MaxDeliveryCount, be dead-lettered unread).
    queue = bus.create_queue("work", lock_duration=3.0)
    await send(bus, msg("m"))
    consumer = await consumers(slots=1, max_lock_renewal=1.5)
    await asyncio.sleep(5.5)  # the pump is paused: nobody takes it
    assert consumer.stats["withdrawn"] >= 1
    assert queue.stats["lock_expired"] == 0
    delivery = await take(consumer)
    assert delivery.message_id == "m" and delivery.delivery_count == 1
    await delivery.ack()
    assert queue.count == 0


async def test_a_delivery_the_pump_holds_past_renewal_goes_back_uncounted(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    # Taken, then held by a paused pump: the lock would expire at ~4.5 s, counted.
    queue = bus.create_queue("work", lock_duration=3.0)
    await send(bus, msg("m"))
    consumer = await consumers(slots=1, max_lock_renewal=1.5)
    held = await take(consumer)
    with structlog.testing.capture_logs() as logs:
        await asyncio.sleep(5.5)  # the database is still down
    assert consumer.stats["reclaimed"] == 1 and queue.stats["lock_expired"] == 0
    [warning] = [e for e in logs if e.get("outcome") == "reclaimed"]
    assert warning["message_id"] == "m" and warning["log_level"] == "warning"
    with pytest.raises(SettlementLost, match="given back before its lock renewal ended"):
        await held.ack()  # the database is back; the handler committed: the copy is a duplicate
    again = await take(consumer)
    assert again.message_id == "m" and again.delivery_count == 1
    await again.ack()
    assert queue.count == 0 and queue.stats["abandon"] == 0
