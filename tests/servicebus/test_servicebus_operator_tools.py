"""``worker publish`` and ``worker dlq`` on Service Bus, against the fake: what a published
message carries, listing dead letters and re-submitting them, on a queue and a topic."""

from __future__ import annotations

import json

import pytest
from azure.servicebus import ServiceBusSubQueue

from tests.servicebus.fake import Entity, FakeServiceBus
from tests.servicebus.sb_helpers import StartConsumer, msg, send, take
from tests.servicebus.sb_settings import sb_settings
from worker import cli
from worker.brokers import OutgoingMessage
from worker.brokers.servicebus import (
    ServiceBusAdmin,
    ServiceBusConsumer,
)
from worker.settings import Settings


async def test_publish_sets_id_type_subject_and_headers(bus: FakeServiceBus, queue: Entity) -> None:
    admin = ServiceBusAdmin(sb_settings(), bus.client)
    headers = {"tenant": "t1", "nested": {"a": 1}}
    await admin.publish([OutgoingMessage("m-1", "CreditRequested", b"{}", headers)])
    receiver = await bus.client().get_queue_receiver("work").__aenter__()
    [peeked] = await receiver.peek_messages(5)
    assert peeked.message_id == "m-1" and peeked.subject == "CreditRequested"
    assert peeked.application_properties == {
        b"tenant": b"t1",
        b"nested": b'{"a": 1}',
        b"type": b"CreditRequested",
    }
    await admin.close()


async def test_dlq_lists_reason_and_description_then_resubmits(
    bus: FakeServiceBus,
    queue: Entity,
    consumers: StartConsumer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    await (await take(consumer)).dead_letter("credit: ValueError: boom")
    admin = ServiceBusAdmin(sb_settings(), bus.client)
    monkeypatch.setattr(cli, "open_admin", lambda _settings: admin)

    assert await cli._dlq(Settings(broker="servicebus"), 10, resubmit=False) == 0
    [line] = [out for out in capsys.readouterr().out.splitlines() if out.startswith("{")]
    listed = json.loads(line)
    assert listed["id"] == "m" and listed["type"] == "CreditRequested"
    assert listed["reason"] == (
        "credit: ValueError: boom: dead-lettered by the worker on delivery 1: "
        "credit: ValueError: boom"
    )

    admin = ServiceBusAdmin(sb_settings(), bus.client)
    assert await admin.resubmit(10) == 1
    await admin.close()
    assert queue.dead_letter is not None and queue.dead_letter.count == 0
    again = await take(consumer)
    assert again.message_id == "m" and again.delivery_count == 1
    assert "DeadLetterReason" not in again.headers


async def test_a_topic_subscription_consumes_and_resubmits_to_the_topic(
    bus: FakeServiceBus,
) -> None:
    mine = bus.create_subscription("events", "billing")
    other = bus.create_subscription("events", "audit")
    settings = sb_settings(queue=None, topic="events", subscription="billing")
    admin = ServiceBusAdmin(settings, bus.client)
    await admin.publish([OutgoingMessage("m", "CreditRequested", b"{}")])
    assert mine.count == 1 and other.count == 1

    consumer = ServiceBusConsumer(settings, bus.client)
    await consumer.start(2)
    try:
        await (await take(consumer)).dead_letter("poison")
        [letter] = await admin.dead_letters(10)
        assert letter.message_id == "m" and letter.reason.startswith("poison")
        assert await admin.resubmit(10) == 1
        assert other.count == 2  # a topic resubmit reaches every subscription (docs say so)
        assert (await take(consumer)).message_id == "m"
    finally:
        await consumer.close()
        await admin.close()
    receiver = bus.client().get_subscription_receiver(
        "events", "billing", sub_queue=ServiceBusSubQueue.DEAD_LETTER
    )
    assert await (await receiver.__aenter__()).peek_messages(5) == []
