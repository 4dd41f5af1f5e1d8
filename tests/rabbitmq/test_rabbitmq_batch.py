"""Batch mode on the real RabbitMQ: ``basic.ack(multiple=True)`` where it is safe, and only there.

A multiple-ack on tag T acks every unacked tag up to T on the channel, whoever holds
it; these tests show the adapter sends one only over a run of the lowest unsettled
tags that are all the batch's, and that nothing else is acked on the way.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

import aio_pika
import pytest

from tests.rabbitmq.rabbit_helpers import (
    credit_registry,
    make_broker,
    publish,
    running,
    take_dead_letters,
)
from tests.support.credits import credit
from tests.support.database import balances
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import RabbitMQConsumer
from worker.delivery import Delivery, ack_many
from worker.registry import Context

pytestmark = [pytest.mark.rabbitmq]


async def take_all(url: str, queue: str) -> list[str]:
    """Auto-ack every ready message of ``queue``; their ids, in order."""
    connection = await aio_pika.connect(url)
    ids: list[str] = []
    try:
        channel = await connection.channel()
        source = await channel.declare_queue(queue, passive=True)
        for _ in range(1000):
            message = await source.get(no_ack=True, fail=False)
            if message is None:
                break
            ids.append(str(message.message_id))
    finally:
        await connection.close()
    return ids


async def test_multiple_ack_covers_only_the_batch(rabbit_settings: MakeRabbitSettings) -> None:
    rabbit = rabbit_settings()
    await publish(rabbit, [credit(f"r-{n}", "a", "1") for n in range(9)])
    broker = make_broker(rabbit)
    await broker.start(prefetch=20)
    try:
        taken: list[Delivery] = []

        async def nine() -> bool:
            while len(taken) < 9:
                async with asyncio.timeout(5):
                    taken.append(await broker.receive())
            return True

        await wait_for(nine, 10, "nine deliveries")
        d = {delivery.message_id: delivery for delivery in taken}

        # r-0 is still running: a multiple-ack on r-2 would ack it too
        assert await ack_many([d["r-1"], d["r-2"]]) == []
        assert broker.multiple_acks == 0
        # r-0 dead-lettered; r-4 still running between r-3 and r-5: acked singly
        await d["r-0"].dead_letter("poison")
        assert await ack_many([d["r-3"], d["r-5"]]) == []
        assert broker.multiple_acks == 0
        # r-4 nacked (a copy to the retry queue); r-6, r-7 are now the lowest: one frame
        await d["r-4"].nack()
        assert await ack_many([d["r-6"], d["r-7"]]) == []
        assert broker.multiple_acks == 1
    finally:
        await broker.close()  # r-8 was never settled: it must come back
    await asyncio.sleep(1.0)  # the nack's copy waits out its retry delay (0.2 s)
    assert sorted(await take_all(rabbit.url, rabbit.queue)) == ["r-4", "r-8"]
    assert [m.message_id for m in await take_dead_letters(rabbit)] == ["r-0"]


@pytest.mark.postgres
async def test_a_batch_pump_acks_in_ranges_and_redelivers_the_failure(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings()

    def fail_once(ctx: Context) -> None:
        if ctx.message_id == "b-13" and ctx.delivery_count == 1:
            raise RuntimeError("boom")

    registry, seen = credit_registry(fail_once)
    await publish(rabbit, [credit(f"b-{n}", f"acct-{n % 4}", "1.00") for n in range(40)])
    async with running(rabbit, pg, registry, batch_size=8, concurrency=1) as pump:
        await wait_for(lambda: pump.stats["ack"] >= 40, 20, "40 acks")
        broker = pump.broker
        assert isinstance(broker, RabbitMQConsumer)
        assert broker.multiple_acks >= 4  # one batch at a time: its tags are the lowest
        assert pump.stats["nack"] == 1
    assert sorted(count for count, _ in seen).count(2) == 1  # only b-13 came back
    assert await balances(pg) == {f"acct-{n}": Decimal(10) for n in range(4)}
    assert await take_all(rabbit.url, rabbit.queue) == []
