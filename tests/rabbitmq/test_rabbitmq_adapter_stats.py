"""The adapter's own tallies (``broker.stats``, exported as worker_broker_events_total) on the
real RabbitMQ: each counter moves when, and only when, its event really happens.

Every test has its own queue names (the ``rabbit_settings`` fixture) in the session's vhost.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aio_pika
import pytest

from tests.rabbitmq.rabbit_helpers import depths, make_broker, publish, take_dead_letters
from tests.support.credits import credit
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import RabbitMQConsumer, RabbitMQSettings, make_identity
from worker.delivery import Delivery, ack_many
from worker.errors import SettlementLost

pytestmark = [pytest.mark.rabbitmq]


async def take(broker: RabbitMQConsumer, count: int) -> dict[str | None, Delivery]:
    taken = [await asyncio.wait_for(broker.receive(), 10) for _ in range(count)]
    return {delivery.message_id: delivery for delivery in taken}


async def test_the_destination_is_the_queue_and_nothing_is_counted_before_anything_happens(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    rabbit = rabbit_settings()
    broker = make_broker(rabbit)
    assert broker.destination == rabbit.queue
    assert broker.stats == Counter()
    await publish(rabbit, [credit("m1", "a", "1")])
    await broker.start(prefetch=1)
    try:
        await (await asyncio.wait_for(broker.receive(), 10)).ack()
    finally:
        await broker.close()
    assert broker.stats == Counter()  # a plain ack is the pump's business, not an event
    assert broker.outages == 0 and broker.multiple_acks == 0


async def test_a_channel_closed_under_the_consumer_counts_a_loss_a_lost_ack_and_a_reconnect(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    rabbit = rabbit_settings()
    await publish(rabbit, [credit("m1", "a", "1")])
    broker = make_broker(rabbit)
    await broker.start(prefetch=1)
    try:
        held = await asyncio.wait_for(broker.receive(), 10)
        # an ack of a tag the channel never delivered: RabbitMQ closes the channel (406)
        assert broker._channel is not None
        underlay = await broker._channel.get_underlay_channel()
        await underlay.basic_ack(delivery_tag=10_000)
        await wait_for(lambda: broker.stats["connection_lost"] == 1, 10, "the channel's loss")
        with pytest.raises(SettlementLost):
            await held.ack()
        assert broker.stats["acks_lost"] == 1
        await wait_for(lambda: broker.stats["reconnected"] == 1, 20, "the reopened channel")
        assert broker.ready and broker.outages == 1
        again = await asyncio.wait_for(broker.receive(), 10)
        assert (again.message_id, again.delivery_count) == ("m1", 2)
        await again.ack()
    finally:
        await broker.close()
    assert broker.stats["connection_lost"] == 1  # a clean close is no loss


async def test_a_multiple_ack_is_counted_once_per_frame(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    rabbit = rabbit_settings()
    await publish(rabbit, [credit(f"r-{n}", "a", "1") for n in range(3)])
    broker = make_broker(rabbit)
    await broker.start(prefetch=3)
    try:
        d = await take(broker, 3)
        assert await ack_many([d["r-0"], d["r-1"], d["r-2"]]) == []
    finally:
        await broker.close()
    assert broker.stats["multiple_acks"] == broker.multiple_acks == 1
    assert broker.stats["acks_lost"] == 0
    assert (await depths(rabbit, rabbit.queue))[rabbit.queue] == 0


async def test_nacks_by_route_and_dead_letters_are_counted(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    rabbit = rabbit_settings()
    await publish(rabbit, [credit(name, "a", "1") for name in ("later", "now", "poison")])
    broker = make_broker(rabbit)
    await broker.start(prefetch=3)
    try:
        d = await take(broker, 3)
        await d["later"].nack()  # backs off: a copy to the first retry queue
        await d["now"].nack(0.0)  # no delay: a copy straight back to the work queue
        await d["poison"].dead_letter("poison")
        assert (broker.stats["nacks_delayed"], broker.stats["nacks_immediate"]) == (1, 1)
        assert broker.stats["dead_lettered"] == 1
        back = await take(broker, 2)  # both copies return, counted
        assert {k: v.delivery_count for k, v in back.items()} == {"later": 2, "now": 2}
        for delivery in back.values():
            await delivery.ack()
    finally:
        await broker.close()
    assert [m.message_id for m in await take_dead_letters(rabbit)] == ["poison"]


async def test_deliveries_given_back_at_a_stop_are_counted(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    rabbit = rabbit_settings()
    await publish(rabbit, [credit(f"m{n}", "a", "1") for n in range(3)])
    broker = make_broker(rabbit)
    await broker.start(prefetch=3)
    try:
        taken = await asyncio.wait_for(broker.receive(), 10)
        await wait_for(lambda: broker._buffer.qsize() == 2, 10, "the rest of the prefetch")
        await broker.stop_receiving()
        assert broker.stats["returned_unstarted"] == 2
        assert broker.stats["nacks_immediate"] == 2  # as uncounted copies to the work queue
        await taken.ack()
    finally:
        await broker.close()


async def test_a_failing_identity_function_and_drained_legacy_queues_are_counted(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings()
    legacy = f"{rabbit.queue}.retry.200ms"
    connection = await aio_pika.connect(rabbit.url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(legacy, durable=True, arguments={"x-queue-type": "classic"})
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}", message_id="old", type="CreditRequested"), legacy
        )
    finally:
        await connection.close()

    def broken(message: Any) -> str | None:
        raise ValueError("a deployment's bug")

    broker = RabbitMQConsumer(rabbit, make_identity(rabbit, None))
    broker.identity = broken
    await broker.start(prefetch=1)
    try:
        assert broker.stats["legacy_messages_moved"] == 1
        delivery = await asyncio.wait_for(broker.receive(), 10)
        assert delivery.message_id is None  # the pump dead-letters it
        assert broker.stats["message_id_func_failed"] == 1
        await delivery.ack()
    finally:
        await broker.close()
