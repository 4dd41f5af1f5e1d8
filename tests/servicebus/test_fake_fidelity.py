"""The fake Service Bus against the SDK: its private pieces, its wire format, its peek-lock rules.

If an SDK upgrade moves anything the fake builds on, the first tests here fail
with the name of the piece; the rest pin each peek-lock rule the adapter relies on,
several of them side by side with the SDK's real (never connected) receiver.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
import tomllib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import azure.servicebus
import pytest
from azure.servicebus import (
    ServiceBusMessage,
    ServiceBusMessageBatch,
    ServiceBusReceivedMessage,
    ServiceBusSubQueue,
)
from azure.servicebus.aio import AutoLockRenewer, ServiceBusClient, ServiceBusReceiver
from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    MessagingEntityNotFoundError,
    ServiceBusConnectionError,
    ServiceBusError,
)

from tests.servicebus.fake import (
    MAX_DELIVERY_COUNT_EXCEEDED,
    SDK_VERSION,
    Entity,
    FakeClient,
    FakeReceiver,
    FakeServiceBus,
)

REPO = Path(__file__).resolve().parents[2]
CONNECTION_STRING = (
    "Endpoint=sb://fake.servicebus.windows.net/;SharedAccessKeyName=test;SharedAccessKey=secret"
)


@pytest.fixture
def bus() -> FakeServiceBus:
    return FakeServiceBus()


@pytest.fixture
async def client(bus: FakeServiceBus) -> AsyncIterator[FakeClient]:
    client = bus.client()
    yield client
    await client.close()


async def send(client: FakeClient, queue: str, *messages: ServiceBusMessage) -> None:
    await client.get_queue_sender(queue).send_messages(list(messages))


async def receive_one(receiver: FakeReceiver, wait: float = 1.0) -> ServiceBusReceivedMessage:
    [message] = await receiver.receive_messages(1, max_wait_time=wait)
    return message


async def opened(client: FakeClient, queue: str, **kwargs: object) -> FakeReceiver:
    receiver = client.get_queue_receiver(queue, **kwargs)
    return await receiver.__aenter__()


async def one_message(
    bus: FakeServiceBus, client: FakeClient, **options: Any
) -> tuple[Entity, FakeReceiver]:
    """Queue "work" (created with ``options``) holding one message "m", a receiver open on it."""
    entity = bus.create_queue("work", **options)
    await send(client, "work", ServiceBusMessage(b"x", message_id="m"))
    return entity, await opened(client, "work")


# -- the SDK pieces the fake stands on ---------------------------------------------


def test_the_sdk_is_the_pinned_version() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert f"azure-servicebus=={SDK_VERSION}" in project["dependencies"]
    assert azure.servicebus.__version__ == SDK_VERSION, (
        "azure-servicebus changed: re-check every piece in tests/servicebus/fake.py "
        "(SDK_PRIVATE_PIECES) and the behaviours listed in docs/servicebus.md, then bump the pin"
    )


@pytest.mark.parametrize(
    "dotted",
    [
        "azure.servicebus._pyamqp._encode:encode_payload",
        "azure.servicebus._pyamqp._decode:decode_payload",
        "azure.servicebus._pyamqp.message:Header",
        "azure.servicebus._pyamqp.message:Message",
        "azure.servicebus._pyamqp.performatives:TransferFrame",
        "azure.servicebus._pyamqp.types:AMQPTypes",
        "azure.servicebus._transport._pyamqp_transport:PyamqpTransport",
    ],
)
def test_private_sdk_module_pieces_still_exist(dotted: str) -> None:
    module, _, name = dotted.partition(":")
    assert hasattr(importlib.import_module(module), name), f"{dotted} moved: the fake needs it"


def test_private_sdk_shapes_the_fake_relies_on() -> None:
    from azure.servicebus._pyamqp.message import Header, Message
    from azure.servicebus._pyamqp.performatives import TransferFrame
    from azure.servicebus._transport._pyamqp_transport import PyamqpTransport

    assert "delivery_count" in Header._fields
    assert {"header", "message_annotations", "application_properties"} <= set(Message._fields)
    # The SDK reads the delivery id and the delivery tag (the lock token) by position.
    assert TransferFrame._fields[1:3] == ("delivery_id", "delivery_tag")
    assert callable(PyamqpTransport.to_outgoing_amqp_message)
    parameters = inspect.signature(ServiceBusReceivedMessage.__init__).parameters
    assert {"message", "receive_mode", "frame"} <= set(parameters)
    assert isinstance(inspect.getattr_static(ServiceBusReceivedMessage, "_lock_expired"), property)
    # What the receiver and the renewer do to a message, which the fake mirrors:
    assert "message._settled = True" in inspect.getsource(
        ServiceBusReceiver._settle_message_with_retry
    )
    assert "message._expiry" in inspect.getsource(ServiceBusReceiver.renew_message_lock)
    assert "_receiver._running" in inspect.getsource(AutoLockRenewer._renewable)
    assert "renew_message_lock" in inspect.getsource(AutoLockRenewer._auto_lock_renew)
    assert "is_peeked_message" in inspect.getsource(ServiceBusReceivedMessage.__init__)


# -- the wire format -----------------------------------------------------------------


async def test_received_messages_are_real_and_look_like_the_wire(
    bus: FakeServiceBus, client: FakeClient
) -> None:
    entity = bus.create_queue("work", lock_duration=30.0)
    await send(
        client,
        "work",
        ServiceBusMessage(
            b'{"a": 1}',
            message_id="m-1",
            subject="Greeting",
            correlation_id="conversation",
            application_properties={"type": "CreditRequested", "n": 3},
        ),
    )
    receiver = await opened(client, "work")
    before = datetime.now(UTC)
    message = await receive_one(receiver)

    assert type(message) is ServiceBusReceivedMessage
    assert message.application_properties == {b"type": b"CreditRequested", b"n": 3}
    assert message.message_id == "m-1" and message.subject == "Greeting"
    assert message.correlation_id == "conversation"
    assert message.delivery_count == 0  # not 1: this SDK counts earlier deliveries
    assert message.sequence_number == 1
    assert b"".join(message.body) == b'{"a": 1}'
    [lock] = entity.locks.values()
    assert message.lock_token == lock.token
    assert message.locked_until_utc is not None and message.enqueued_time_utc is not None
    expected = before + timedelta(seconds=30)
    assert abs((message.locked_until_utc - expected).total_seconds()) < 1
    assert abs((message.enqueued_time_utc - before).total_seconds()) < 1
    assert not message._lock_expired


def test_the_sdk_invents_a_message_id_when_none_is_given() -> None:
    # The constructor runs the scheduled_enqueue_time_utc setter, which fills in a
    # uuid4: two constructions of "the same" message get different dedup keys.
    first, second = ServiceBusMessage(b"x"), ServiceBusMessage(b"x", message_id=None)
    assert first.message_id and second.message_id and first.message_id != second.message_id
    first.message_id = None
    assert first.message_id is None


async def test_a_property_the_sdk_cannot_encode_fails_the_send_like_the_sdk(
    bus: FakeServiceBus, client: FakeClient
) -> None:
    # AMQP int is 32 bits: an epoch in milliseconds does not fit. The SDK finds out
    # while it builds the batch, before any I/O; so must the fake, at send.
    too_big = ServiceBusMessage(b"x", application_properties={"at": 2**40})
    with pytest.raises(ValueError, match="int invalid") as sdk:
        ServiceBusMessageBatch(max_size_in_bytes=262144).add_message(too_big)
    bus.create_queue("work")
    with pytest.raises(ValueError, match="int invalid") as fake:
        await client.get_queue_sender("work").send_messages([too_big])
    assert str(fake.value) == str(sdk.value)
    assert bus.entity("work").count == 0


# -- side by side with the SDK's own receiver ------------------------------------------


@pytest.fixture
async def real_receiver() -> AsyncIterator[ServiceBusReceiver]:
    """A real receiver that never connects: its client-side checks raise before any I/O."""
    client = ServiceBusClient.from_connection_string(CONNECTION_STRING, retry_total=0)
    receiver = client.get_queue_receiver("work")
    yield receiver
    await receiver.close()
    await client.close()


async def test_settled_twice_raises_like_the_sdk(
    bus: FakeServiceBus, client: FakeClient, real_receiver: ServiceBusReceiver
) -> None:
    _, receiver = await one_message(bus, client)
    message = await receive_one(receiver)
    await receiver.complete_message(message)

    with pytest.raises(MessageAlreadySettled) as fake_error:
        await receiver.complete_message(message)
    with pytest.raises(MessageAlreadySettled):
        await real_receiver.complete_message(message)
    assert isinstance(fake_error.value, ValueError)
    assert not isinstance(fake_error.value, ServiceBusError)


async def test_an_expired_lock_raises_like_the_sdk(
    bus: FakeServiceBus, client: FakeClient, real_receiver: ServiceBusReceiver
) -> None:
    _, receiver = await one_message(bus, client, lock_duration=0.2)
    message = await receive_one(receiver)
    await asyncio.sleep(0.3)

    with pytest.raises(MessageLockLostError):
        await receiver.complete_message(message)
    real_receiver._running = True  # as if open: the lock check comes before any I/O
    try:
        with pytest.raises(MessageLockLostError):
            await real_receiver.complete_message(message)
    finally:
        real_receiver._running = False


async def test_a_closed_receiver_raises_value_error_like_the_sdk(
    bus: FakeServiceBus, client: FakeClient, real_receiver: ServiceBusReceiver
) -> None:
    _, receiver = await one_message(bus, client)
    message = await receive_one(receiver)
    await receiver.close()
    await real_receiver.close()

    for closed in (receiver, real_receiver):
        with pytest.raises(ValueError, match="shutdown") as error:
            await closed.complete_message(message)
        assert not isinstance(error.value, MessageAlreadySettled)


# -- peek-lock ------------------------------------------------------------------------


async def test_lock_expiry_offers_the_message_again_and_kills_the_old_token(
    bus: FakeServiceBus, client: FakeClient
) -> None:
    entity, receiver = await one_message(bus, client, lock_duration=0.2)
    first = await receive_one(receiver)
    second = await receive_one(receiver, wait=2.0)  # comes back once the lock runs out

    assert second.message_id == "m" and second.delivery_count == 1
    assert second.lock_token != first.lock_token
    assert entity.stats["lock_expired"] == 1
    first._expiry = datetime.now(UTC) + timedelta(minutes=1)  # get past the client-side check
    with pytest.raises(MessageLockLostError, match="lock supplied is invalid"):
        await receiver.complete_message(first)  # the entity no longer knows the token
    await receiver.complete_message(second)
    assert entity.count == 0


async def test_abandon_offers_it_again_at_once(bus: FakeServiceBus, client: FakeClient) -> None:
    _, receiver = await one_message(bus, client)
    await receiver.abandon_message(await receive_one(receiver))

    started = time.monotonic()
    again = await receive_one(receiver, wait=5.0)
    assert time.monotonic() - started < 1.0
    assert again.delivery_count == 1


async def test_max_delivery_count_moves_it_to_the_dead_letter_sub_queue(
    bus: FakeServiceBus, client: FakeClient
) -> None:
    entity, receiver = await one_message(bus, client, max_delivery_count=2)
    await receiver.abandon_message(await receive_one(receiver))
    await receiver.abandon_message(await receive_one(receiver))

    assert entity.count == 0 and await receiver.receive_messages(1, max_wait_time=0.1) == []
    dead = await opened(client, "work", sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    letter = await receive_one(dead)
    assert letter.message_id == "m"
    assert letter.dead_letter_reason == MAX_DELIVERY_COUNT_EXCEEDED
    assert letter.dead_letter_error_description == (
        "Message could not be consumed after 2 delivery attempts."
    )
    await dead.complete_message(letter)
    assert entity.dead_letter is not None and entity.dead_letter.count == 0


async def test_dead_letter_message_keeps_reason_and_description(
    bus: FakeServiceBus, client: FakeClient
) -> None:
    _, receiver = await one_message(bus, client)
    message = await receive_one(receiver)
    await receiver.dead_letter_message(message, reason="poison", error_description="bad body")

    dead = await opened(client, "work", sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    [peeked] = await dead.peek_messages(10)
    assert (peeked.dead_letter_reason, peeked.dead_letter_error_description) == (
        "poison",
        "bad body",
    )
    assert peeked.sequence_number == message.sequence_number  # kept, as in Service Bus
    with pytest.raises(ValueError, match="peeked"):
        await dead.complete_message(peeked)


async def test_renew_returns_the_new_expiry_and_moves_locked_until(
    bus: FakeServiceBus, client: FakeClient
) -> None:
    entity, receiver = await one_message(bus, client, lock_duration=0.5)
    message = await receive_one(receiver)
    first = message.locked_until_utc
    assert first is not None

    await asyncio.sleep(0.3)
    expiry = await receiver.renew_message_lock(message)
    assert expiry > first and message.locked_until_utc == expiry
    await asyncio.sleep(0.3)  # past the first expiry, inside the renewed one
    await receiver.complete_message(message)
    assert entity.stats["lock_expired"] == 0 and entity.count == 0


async def test_the_sdk_auto_lock_renewer_runs_against_the_fake(
    bus: FakeServiceBus, client: FakeClient
) -> None:
    # The renewer checks once a second and renews when 0.75 x the lock's whole seconds
    # remain: 4 s is about the shortest lock it keeps reliably.
    entity, receiver = await one_message(bus, client, lock_duration=4.0)
    message = await receive_one(receiver)
    failures: list[object] = []

    async def failed(renewable: object, error: Exception | None) -> None:
        failures.append(error)

    async with AutoLockRenewer(
        max_lock_renewal_duration=60, on_lock_renew_failure=failed
    ) as renewer:
        renewer.register(receiver, message)  # type: ignore[arg-type]
        await asyncio.sleep(5.0)
        await receiver.complete_message(message)
    assert entity.stats["renewed"] >= 1 and entity.stats["lock_expired"] == 0
    assert failures == []


async def test_receive_honours_the_wait_and_the_count(
    bus: FakeServiceBus, client: FakeClient
) -> None:
    bus.create_queue("work")
    receiver = await opened(client, "work")
    started = time.monotonic()
    assert await receiver.receive_messages(5, max_wait_time=0.2) == []
    assert 0.15 <= time.monotonic() - started < 1.5

    await send(client, "work", *(ServiceBusMessage(b"x", message_id=str(n)) for n in range(5)))
    batch = await receiver.receive_messages(2, max_wait_time=1.0)
    assert [m.message_id for m in batch] == ["0", "1"]
    with pytest.raises(ValueError):
        await receiver.receive_messages(0)


async def test_faults_and_a_severed_client(bus: FakeServiceBus, client: FakeClient) -> None:
    entity, receiver = await one_message(bus, client, lock_duration=0.3)
    bus.fail("receive")
    with pytest.raises(ServiceBusConnectionError):
        await receiver.receive_messages(1, max_wait_time=0.1)
    message = await receive_one(receiver)
    bus.fail("complete")
    with pytest.raises(ServiceBusConnectionError):
        await receiver.complete_message(message)

    bus.sever(client)
    with pytest.raises(ServiceBusConnectionError):
        await receiver.abandon_message(message)
    other = await opened(bus.client(), "work")
    again = await receive_one(other, wait=2.0)  # the severed client's lock ran out
    assert again.delivery_count == 1 and entity.stats["lock_expired"] == 1
    await other.complete_message(again)


async def test_topics_fan_out_and_unknown_entities_fail_at_open(
    bus: FakeServiceBus, client: FakeClient
) -> None:
    one: Entity = bus.create_subscription("events", "one")
    two = bus.create_subscription("events", "two")
    await client.get_topic_sender("events").send_messages(ServiceBusMessage(b"x", message_id="m"))
    assert one.count == 1 and two.count == 1
    receiver = client.get_subscription_receiver("events", "two")
    message = await receive_one(await receiver.__aenter__())
    assert message.message_id == "m"

    with pytest.raises(MessagingEntityNotFoundError):
        await client.get_queue_receiver("nowhere").__aenter__()
