"""Service Bus and a deployment's message-id function that raises: the exception costs only
its own message (dead-lettered as having no id); the rest of the batch is handed on and
the link stays up."""

from __future__ import annotations

import structlog
from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage

from tests.servicebus.fake import FakeServiceBus
from tests.servicebus.sb_helpers import take
from tests.servicebus.sb_settings import sb_settings
from worker.brokers.servicebus import (
    default_message_id,
    open_broker,
)
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
