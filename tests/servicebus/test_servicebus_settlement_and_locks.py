"""Service Bus settlement against the fake: ack, nack and dead-letter mapped onto the SDK,
what a refused settlement becomes, and locks renewed or lost while a handler runs."""

from __future__ import annotations

import asyncio

import pytest
from azure.servicebus.exceptions import MessageLockLostError

from tests.servicebus.fake import Entity, FakeServiceBus
from tests.servicebus.sb_helpers import StartConsumer, msg, send, take
from tests.support.waiting import wait_for
from worker.delivery import ack_many
from worker.errors import AlreadySettled, SettlementLost

# -- settlement ---------------------------------------------------------------------------


async def test_ack_completes_nack_abandons_dead_letter_records_why(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("a"), msg("n"), msg("d"))
    consumer = await consumers()
    deliveries = {d.message_id: d for d in [await take(consumer) for _ in range(3)]}
    long_reason = "credit: ValueError: " + "x" * 400
    await deliveries["a"].ack()
    await deliveries["n"].nack()
    await deliveries["d"].dead_letter(long_reason)
    verbs = ("complete", "abandon", "dead-letter")
    assert [queue.stats[verb] for verb in verbs] == [1, 1, 1]

    assert queue.dead_letter is not None
    [letter] = queue.dead_letter.messages()
    reason = letter.broker_properties["DeadLetterReason"]
    description = letter.broker_properties["DeadLetterErrorDescription"]
    assert reason == long_reason[:256]
    assert description == f"dead-lettered by the worker on delivery 1: {long_reason}"


async def test_ack_many_completes_each_and_returns_only_the_lost_ones(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    """Batch mode's ack: one complete per message; a refused one is lost, not the batch."""
    await send(bus, msg("a"), msg("b"), msg("c"))
    consumer = await consumers()
    batch = [await take(consumer) for _ in range(3)]
    by_id = {d.message_id: d for d in batch}
    bus.fail("complete")  # the first complete of the three is refused
    lost = await ack_many([by_id["a"], by_id["b"], by_id["c"]])
    assert lost == [by_id["a"]]
    assert queue.stats["complete"] == 2 and queue.locked == 1  # "a" comes back later
    assert {d.settled for d in batch} == {"acked"}  # each settled once, lost or not
    assert consumer.stats["settlement_lost"] == 1


async def test_settling_on_an_expired_lock_is_settlement_lost(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    queue = bus.create_queue("work", lock_duration=0.3)
    await send(bus, msg("m"))
    consumer = await consumers(max_lock_renewal=0)
    delivery = await take(consumer)
    await asyncio.sleep(0.4)
    with pytest.raises(SettlementLost, match="lock lost"):
        await delivery.ack()
    assert consumer.stats["settlement_lost"] == 1 and queue.stats["complete"] == 0
    again = await take(consumer)
    assert again.message_id == "m" and again.delivery_count == 2
    await again.ack()


async def test_settled_elsewhere_is_already_settled_not_success(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    handle = delivery._handle
    await handle.link.receiver.complete_message(handle.message)
    with pytest.raises(AlreadySettled):
        await delivery.ack()


@pytest.mark.parametrize("how", ["receiver closed", "connection error"])
async def test_a_settlement_the_broker_cannot_take_is_settlement_lost(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer, how: str
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    if how == "receiver closed":
        await delivery._handle.link.receiver.close()
    else:
        bus.fail("complete")
    with pytest.raises(SettlementLost, match="complete failed"):
        await delivery.ack()
    assert queue.stats["complete"] == 0 and queue.locked == 1  # back when the lock runs out


async def test_a_failed_settlement_stops_renewing_the_lock(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    queue = bus.create_queue("work", lock_duration=5.0)  # renewed at ~2 s if still renewing
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    bus.fail("complete")
    with pytest.raises(SettlementLost):
        await delivery.ack()
    await asyncio.sleep(3.0)  # a renewer still at work would have renewed by now
    assert queue.stats["renewed"] == 0 and queue.locked == 1  # left to run out and come back


async def test_nack_with_a_delay_holds_the_lock_then_abandons(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    await delivery.nack(delay=0.3)
    assert queue.locked == 1 and queue.stats["abandon"] == 0
    again = await take(consumer)
    assert again.delivery_count == 2 and queue.stats["abandon"] == 1


# -- locks ----------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_long_handler_keeps_its_lock(bus: FakeServiceBus, consumers: StartConsumer) -> None:
    queue = bus.create_queue("work", lock_duration=4.0)
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    await asyncio.sleep(5.5)  # longer than the lock
    await delivery.ack()
    assert queue.stats["renewed"] >= 1 and queue.stats["lock_expired"] == 0
    assert queue.stats["complete"] == 1


async def test_a_lost_renewal_refuses_the_ack(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    queue = bus.create_queue("work", lock_duration=4.0)
    bus.fail("renew", lambda: MessageLockLostError(message="lock lost (injected)"))
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    await wait_for(lambda: consumer.stats["lock_lost"] == 1, 6, "the lock lost", step=0.01)
    with pytest.raises(SettlementLost, match="not completed"):
        await delivery.ack()
    assert queue.stats["complete"] == 0 and queue.locked == 1
