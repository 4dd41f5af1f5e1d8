"""The Service Bus adapter against the fake: settings, fields, settlement, locks, recovery."""

from __future__ import annotations

import asyncio
import json
import sys
import types
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from azure.servicebus import ServiceBusMessage, ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import MessageLockLostError

from tests.servicebus.fake import Entity, FakeServiceBus
from tests.servicebus.sb_settings import CONNECTION_STRING, SECRET, sb_settings
from worker import cli
from worker.brokers import OutgoingMessage, open_admin, open_broker
from worker.brokers.servicebus import (
    Connector,
    ServiceBusAdmin,
    ServiceBusConsumer,
    load_settings,
)
from worker.delivery import Delivery
from worker.errors import AlreadySettled, BrokerUnavailable, ConfigurationError, SettlementLost
from worker.settings import Settings


@pytest.fixture
def queue(bus: FakeServiceBus) -> Entity:
    return bus.create_queue("work", lock_duration=5.0)


async def send(bus: FakeServiceBus, *messages: ServiceBusMessage, queue: str = "work") -> None:
    sender = bus.client().get_queue_sender(queue)
    await sender.send_messages(list(messages))


def msg(message_id: Any = "m-1", **kwargs: Any) -> ServiceBusMessage:
    kwargs.setdefault("application_properties", {"type": "CreditRequested"})
    message = ServiceBusMessage(b'{"amount": "1"}', message_id=message_id, **kwargs)
    message.message_id = message_id  # the SDK invents one for None
    return message


async def take(consumer: ServiceBusConsumer, seconds: float = 3.0) -> Delivery:
    async with asyncio.timeout(seconds):
        return await consumer.receive()


async def until(predicate: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"not true within {seconds}s")
        await asyncio.sleep(0.01)


# -- settings and connecting ----------------------------------------------------------


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_SERVICEBUS_CONNECTION_STRING", CONNECTION_STRING)
    monkeypatch.setenv("WORKER_SERVICEBUS_TOPIC", "events")
    monkeypatch.setenv("WORKER_SERVICEBUS_SUBSCRIPTION", "billing")
    monkeypatch.setenv("WORKER_SERVICEBUS_TYPE_MAPPING", '{"events/billing": "Invoice"}')
    monkeypatch.setenv("WORKER_SERVICEBUS_MAX_LOCK_RENEWAL", "120")
    settings = load_settings()
    assert settings.entity == "events/billing"
    assert settings.type_mapping == {"events/billing": "Invoice"}
    assert settings.max_lock_renewal == 120.0
    assert settings.connection_string is not None
    assert SECRET not in repr(settings)


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"NAMESPACE": "x.servicebus.windows.net", "QUEUE": "q"}, "exactly one of"),
        ({}, "exactly one of WORKER_SERVICEBUS_QUEUE"),
        ({"TOPIC": "events"}, "needs WORKER_SERVICEBUS_SUBSCRIPTION"),
        ({"QUEUE": "q", "RECEIVE_WAIT": "0"}, "WORKER_SERVICEBUS_RECEIVE_WAIT='0'"),
        ({"QUEUE": "q", "TRY_TIMEOUT": "-1"}, "WORKER_SERVICEBUS_TRY_TIMEOUT"),
    ],
)
def test_bad_settings_are_one_line_and_never_show_the_secret(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], complaint: str
) -> None:
    monkeypatch.setenv("WORKER_SERVICEBUS_CONNECTION_STRING", CONNECTION_STRING)
    for name, value in env.items():
        monkeypatch.setenv(f"WORKER_SERVICEBUS_{name}", value)
    with pytest.raises(ConfigurationError) as error:
        load_settings()
    assert complaint in str(error.value)
    assert "\n" not in str(error.value) and SECRET not in str(error.value)


async def test_connection_string_clients_always_bound_each_attempt() -> None:
    client = Connector(sb_settings(try_timeout=7.0, retry_total=2))()
    try:
        assert isinstance(client, ServiceBusClient)
        assert client.fully_qualified_namespace == "fake.servicebus.windows.net"
        assert client._config.try_timeout == 7.0 and client._config.retry_total == 2
    finally:
        await client.close()


async def test_a_namespace_authenticates_with_default_azure_credential(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[Any] = []

    class DefaultAzureCredential:
        closed = False

        def __init__(self) -> None:
            made.append(self)

        async def get_token(self, *scopes: str, **kwargs: Any) -> Any:
            raise AssertionError("no token is fetched before the first connection")

        async def close(self) -> None:
            self.closed = True

    module = types.ModuleType("azure.identity.aio")
    module.DefaultAzureCredential = DefaultAzureCredential  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "azure.identity.aio", module)
    settings = sb_settings(connection_string=None, namespace="prod.servicebus.windows.net")
    connector = Connector(settings)
    first, second = connector(), connector()
    assert first.fully_qualified_namespace == "prod.servicebus.windows.net"  # type: ignore[attr-defined]
    assert len(made) == 1  # one credential for every client, closed once at the end
    await first.close()
    await second.close()
    await connector.close()
    assert made[0].closed


def test_a_namespace_without_azure_identity_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "azure.identity.aio", None)
    settings = sb_settings(connection_string=None, namespace="prod.servicebus.windows.net")
    with pytest.raises(ConfigurationError, match=r"idempotent-worker\[azure\]"):
        Connector(settings)


async def test_worker_broker_servicebus_opens_this_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_SERVICEBUS_CONNECTION_STRING", CONNECTION_STRING)
    monkeypatch.setenv("WORKER_SERVICEBUS_QUEUE", "work")
    settings = Settings(broker="servicebus", max_deliveries=10)
    with structlog.testing.capture_logs() as logs:
        broker = open_broker(settings)
    assert isinstance(broker, ServiceBusConsumer) and broker.name == "servicebus"
    assert any("MaxDeliveryCount" in entry["event"] for entry in logs)
    await broker.close()
    admin = open_admin(settings)
    assert isinstance(admin, ServiceBusAdmin)
    await admin.close()


async def test_start_fails_in_one_line_when_the_entity_is_missing(
    bus: FakeServiceBus, consumers: Callable[..., Any]
) -> None:
    with pytest.raises(BrokerUnavailable, match="MessagingEntityNotFoundError"):
        await consumers(queue="nowhere")


async def test_a_hanging_open_is_bounded(
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
) -> None:
    bus.hang("open")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(BrokerUnavailable, match="TimeoutError"):
        await consumers(try_timeout=0.2)
    assert loop.time() - started < 5


# -- what a delivery carries ------------------------------------------------------------


async def test_delivery_fields_and_the_count_from_one(
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
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
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
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
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
) -> None:
    key = uuid.uuid4()
    await send(bus, msg(None), msg(key))  # AMQP allows a uuid as message-id
    consumer = await consumers()
    ids = {(await take(consumer)).message_id for _ in range(2)}
    assert ids == {None, str(key)}


# -- flow control -------------------------------------------------------------------------


async def test_prefetch_follows_concurrency_and_bounds_what_is_locked(
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
) -> None:
    await send(bus, *(msg(str(n)) for n in range(10)))
    consumer = await consumers(slots=3)
    assert bus.receivers[-1].prefetch_count == 3
    await until(lambda: queue.locked == 3)
    await asyncio.sleep(0.3)
    assert queue.locked == 3  # nobody settles: nothing more is taken
    await (await take(consumer)).ack()
    await until(lambda: queue.locked == 3 and queue.active == 6)


async def test_the_sdk_prefetch_can_be_set_apart(
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
) -> None:
    await consumers(slots=8, prefetch=0)
    assert bus.receivers[-1].prefetch_count == 0


# -- settlement ---------------------------------------------------------------------------


async def test_ack_completes_nack_abandons_dead_letter_records_why(
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
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


async def test_settling_on_an_expired_lock_is_settlement_lost(
    bus: FakeServiceBus, consumers: Callable[..., Any]
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
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
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
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any], how: str
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
    bus: FakeServiceBus, consumers: Callable[..., Any]
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
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
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
async def test_a_long_handler_keeps_its_lock(
    bus: FakeServiceBus, consumers: Callable[..., Any]
) -> None:
    queue = bus.create_queue("work", lock_duration=4.0)
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    await asyncio.sleep(5.5)  # longer than the lock
    await delivery.ack()
    assert queue.stats["renewed"] >= 1 and queue.stats["lock_expired"] == 0
    assert queue.stats["complete"] == 1


async def test_a_lost_renewal_refuses_the_ack(
    bus: FakeServiceBus, consumers: Callable[..., Any]
) -> None:
    queue = bus.create_queue("work", lock_duration=4.0)
    bus.fail("renew", lambda: MessageLockLostError(message="lock lost (injected)"))
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    await until(lambda: consumer.stats["lock_lost"] == 1, seconds=6)
    with pytest.raises(SettlementLost, match="not completed"):
        await delivery.ack()
    assert queue.stats["complete"] == 0 and queue.locked == 1


# -- recovery -------------------------------------------------------------------------------


async def test_receive_failures_recreate_client_and_receiver_and_report_not_ready(
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
) -> None:
    consumer = await consumers()
    assert consumer.ready
    seen_ready: list[bool] = []
    bus.fail("receive", times=3)
    watcher = asyncio.create_task(_watch(consumer, seen_ready))
    await send(bus, msg("m"))
    delivery = await take(consumer, seconds=5)
    watcher.cancel()
    await delivery.ack()
    assert False in seen_ready and consumer.ready
    assert consumer.stats["receive_failed"] == 3 and consumer.stats["reconnected"] >= 1
    assert len(bus.clients) >= 3  # a new client per reconnect (after the admin's sender client)


async def _watch(consumer: ServiceBusConsumer, seen: list[bool]) -> None:
    while True:
        seen.append(consumer.ready)
        await asyncio.sleep(0.005)


async def test_messages_of_a_retired_receiver_can_still_be_settled(
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
) -> None:
    await send(bus, msg("m"))
    consumer = await consumers()
    delivery = await take(consumer)
    old = delivery._handle.link
    bus.fail("receive")
    await until(lambda: consumer.stats["reconnected"] >= 1)
    assert old.retired and not old.receiver._shutdown  # kept open for its unsettled message
    await delivery.ack()
    assert queue.stats["complete"] == 1 and old.receiver._shutdown


async def test_shutdown_gives_back_everything_unsettled_at_once(
    bus: FakeServiceBus, queue: Entity, consumers: Callable[..., Any]
) -> None:
    await send(bus, msg("a"), msg("b"), msg("c"))
    consumer = await consumers()
    await until(lambda: queue.locked == 3)
    held = await take(consumer)  # the pump's: in flight, never settled
    await consumer.stop_receiving()
    assert not consumer.ready
    assert queue.locked == 1 and queue.active == 2  # fetched, not taken: given back
    assert queue.stats["abandon"] == 0 and queue.stats["complete"] == 2  # copied, uncounted
    await consumer.close()
    assert queue.locked == 0 and queue.active == 3 and queue.stats["abandon"] == 1
    assert held.settled is None  # what the pump left unsettled: abandoned, as its lock would


# -- operator tools -----------------------------------------------------------------------------


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
    consumers: Callable[..., Any],
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
