"""What the Service Bus consumer tells the rest of the worker about itself, on the fake:
the entity it consumes (``destination``, in span names ``process <destination>``) and
its own event tallies (``stats``, exported as ``worker_broker_events_total``)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from azure.servicebus import ServiceBusMessage

from tests.servicebus.fake import FakeServiceBus
from tests.servicebus.sb_helpers import StartConsumer
from tests.servicebus.sb_settings import sb_settings
from tests.support.waiting import wait_for
from worker.brokers import Broker
from worker.brokers.servicebus import ServiceBusConsumer
from worker.errors import SettlementLost


def test_the_destination_is_the_queue_or_the_topic_subscription() -> None:
    queue: Broker = ServiceBusConsumer(sb_settings(queue="work"), FakeServiceBus().client)
    subscription: Broker = ServiceBusConsumer(
        sb_settings(queue=None, topic="events", subscription="billing"), FakeServiceBus().client
    )
    assert queue.destination == "work"
    assert subscription.destination == "events/billing"
    assert isinstance(queue.stats, Counter) and not queue.stats


async def test_a_receive_failure_and_a_refused_settlement_move_the_tallies(
    bus: FakeServiceBus, consumers: StartConsumer
) -> None:
    bus.create_queue("work")
    consumer = await consumers()
    bus.fail("receive")
    await wait_for(lambda: consumer.stats["reconnected"] >= 1, 5, "a reconnect")
    assert consumer.stats["receive_failed"] == 1

    sender = bus.client().get_queue_sender("work")
    await sender.send_messages(ServiceBusMessage(b"{}", message_id="m"))
    async with asyncio.timeout(5):
        delivery = await consumer.receive()
    bus.fail("complete")
    with pytest.raises(SettlementLost):
        await delivery.ack()
    assert consumer.stats["settlement_lost"] == 1
