"""What a Service Bus delivery carries (id, type, body, headers, the count from one), and
how many messages the consumer locks at once (prefetch), against the fake."""

from __future__ import annotations

import asyncio
import uuid

from tests.servicebus.fake import Entity, FakeServiceBus
from tests.servicebus.sb_helpers import StartConsumer, msg, send, take
from tests.servicebus.sb_settings import sb_settings
from tests.support.waiting import wait_for
from worker.brokers import OutgoingMessage
from worker.brokers.servicebus import ServiceBusAdmin

# -- what a delivery carries ------------------------------------------------------------


async def test_delivery_fields_and_the_count_from_one(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    properties = {"type": "CreditRequested", "tenant": "t1", "attempt": 3}
    await send(bus, msg("m-1", application_properties=properties, subject="Ignored"))
    consumer = await consumers()
    delivery = await take(consumer)
    assert (delivery.message_id, delivery.type) == ("m-1", "CreditRequested")
    assert delivery.delivery_count == 1
    assert delivery.body == b'{"amount": "1"}'
    assert dict(delivery.headers) == {"type": "CreditRequested", "tenant": "t1", "attempt": 3}

    await delivery.nack()
    again = await take(consumer)
    assert again.message_id == "m-1" and again.delivery_count == 2


async def test_type_from_property_then_subject_then_entity_mapping(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(
        bus,
        msg("by-property", application_properties={"kind": "FromProperty"}, subject="Subject"),
        msg("by-subject", application_properties={}, subject="FromSubject"),
        msg("by-mapping", application_properties={}),
    )
    consumer = await consumers(type_property="kind", type_mapping={"work": "FromMapping"})
    types_by_id = {}
    for _ in range(3):
        delivery = await take(consumer)
        types_by_id[delivery.message_id] = delivery.type
    assert types_by_id == {
        "by-property": "FromProperty",
        "by-subject": "FromSubject",
        "by-mapping": "FromMapping",
    }


async def test_publish_without_an_id_sends_none(bus: FakeServiceBus, queue: Entity) -> None:
    admin = ServiceBusAdmin(sb_settings(), bus.client)
    await admin.publish([OutgoingMessage(None, "CreditRequested", b"{}")])
    [stored] = queue.messages()
    assert stored.message_id is None  # not the random id ServiceBusMessage made up
    await admin.close()


async def test_message_ids_are_strings_or_none(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    key = uuid.uuid4()
    await send(bus, msg(None), msg(key))  # AMQP allows a uuid as message-id
    consumer = await consumers()
    ids = {(await take(consumer)).message_id for _ in range(2)}
    assert ids == {None, str(key)}


# -- flow control -------------------------------------------------------------------------


async def test_prefetch_follows_concurrency_and_bounds_what_is_locked(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, *(msg(str(n)) for n in range(10)))
    consumer = await consumers(slots=3)
    assert bus.receivers[-1].prefetch_count == 3
    await wait_for(lambda: queue.locked == 3, 5.0, "three locked", step=0.01)
    await asyncio.sleep(0.3)
    assert queue.locked == 3  # nobody settles: nothing more is taken
    await (await take(consumer)).ack()
    await wait_for(
        lambda: queue.locked == 3 and queue.active == 6, 5.0, "three locked, six active", step=0.01
    )


async def test_the_sdk_prefetch_can_be_set_apart(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await consumers(slots=8, prefetch=0)
    assert bus.receivers[-1].prefetch_count == 0
