"""The relay's Kafka (Tansu) and Service Bus (the fake namespace) publishers, and a RabbitMQ
outage seen through a proxy the test can cut: rows wait, no attempt is spent, all drain."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.kafka.kafka_helpers import create_topic, header, read_all, settings_for, unique
from tests.outbox.outbox_helpers import RunningRelays, fast_outbox, outbox_rows, publish_rows
from tests.servicebus.fake import FakeServiceBus
from tests.servicebus.sb_settings import sb_settings
from tests.support.pumps import MakeSettings, RunPumps
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.tansu import Tansu
from worker.brokers.kafka import KafkaPublisher, header_message_id
from worker.brokers.publishers import Outgoing
from worker.brokers.servicebus import ServiceBusPublisher
from worker.outbox.model import configure
from worker.outbox.relay import Relay


@pytest.mark.kafka
async def test_kafka_records_carry_the_id_and_keep_key_order(
    engine: AsyncEngine, tansu: Tansu
) -> None:
    topic = unique("events")
    await create_topic(tansu.bootstrap, topic, 3)
    kafka = settings_for(tansu.bootstrap, topic)
    events = [("Seen", {"n": n}, f"key-{n % 4}", None) for n in range(40)]
    configure(fast_outbox(destinations={"Seen": topic}))  # the default, per type
    ids = await publish_rows(engine, "in-1", events, headers={"traceparent": "00-ab-cd-01"})
    publisher = KafkaPublisher(kafka, timeout=10.0)
    relay = Relay(engine, publisher, fast_outbox(ordered=True))
    try:
        assert await relay.drain() == 40
    finally:
        await publisher.close()
    records, _ = await read_all(tansu.bootstrap, topic, 3)
    assert sorted((header(r, "message-id") for r in records), key=str) == sorted(ids)
    identity = header_message_id(kafka.message_id_header)  # what a consuming worker dedups by
    keys = {header(r, "message-id"): identity(r) for r in records}
    assert len(set(keys.values())) == 40 and all(i in str(keys[i]) for i in ids)
    first = next(r for r in records if header(r, "message-id") == ids[0])
    assert (header(first, "ce_id"), header(first, "ce_type")) == (ids[0], "Seen")
    assert header(first, "type") == "Seen" and header(first, "traceparent") == "00-ab-cd-01"
    partitions: dict[bytes, set[int]] = defaultdict(set)
    order: dict[bytes, list[str]] = defaultdict(list)
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        partitions[record.key].add(record.partition)
        order[record.key].append(header(record, "message-id") or "")
    assert all(len(p) == 1 for p in partitions.values())  # key -> one partition
    for key, sent in order.items():
        assert sent == [i for i, e in zip(ids, events, strict=True) if e[2] == key.decode()]


async def test_service_bus_sends_queue_and_topic_and_parks_a_missing_entity(
    engine: AsyncEngine,
) -> None:
    bus = FakeServiceBus()
    queue = bus.create_queue("events")
    subscription = bus.create_subscription("announcements", "audit")
    ids = await publish_rows(
        engine,
        "in-2",
        [
            ("Seen", {"n": 1}, None, "events"),
            ("Seen", {"n": 2}, None, "topic:announcements"),
            ("Seen", {"n": 3}, None, "queue:nowhere"),
        ],
    )
    publisher = ServiceBusPublisher(sb_settings(), bus.client, timeout=5.0)
    relay = Relay(engine, publisher, fast_outbox(max_attempts=2))
    try:
        # the namespace does not answer, three rounds of one send per destination: nothing counts
        bus.fail("send", times=9)
        for _ in range(3):
            assert (await relay.run_once()).unavailable
        assert {r.attempts for r in await outbox_rows(engine)} == {0}
        for _ in range(3):
            await relay.drain()
    finally:
        await publisher.close()
    assert [m.message_id for m in queue.messages()] == [ids[0]]
    assert [m.message_id for m in subscription.messages()] == [ids[1]]
    stored = queue.messages()[0].amqp
    properties = {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in (stored.application_properties or {}).items()
    }
    assert properties["ce-id"] == ids[0] and properties["type"] == "Seen"
    rows = {r.message_id: r for r in await outbox_rows(engine)}
    assert (rows[ids[2]].state, rows[ids[2]].attempts) == ("parked", 2)
    assert "MessagingEntityNotFoundError" in rows[ids[2]].last_error
    assert {rows[ids[0]].state, rows[ids[1]].state} == {"sent"}


class Proxy:
    """A TCP proxy to the local RabbitMQ that the test can cut and restore: an outage the
    relay sees, while every other user of the server carries on."""

    def __init__(self, port: int, target: int = 5672) -> None:
        self.port, self.target = port, target
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[Any, Any]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):  # ends with the connection
                    sink.write(data)
                    await sink.drain()
            except OSError:
                pass
            finally:
                sink.close()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._pairs.discard(pair)

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for down, up in list(self._pairs):
            down.transport.abort()
            up.transport.abort()
        if server is not None:
            await server.wait_closed()


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.slow
async def test_a_30_second_rabbitmq_outage_spends_no_attempt_and_the_backlog_drains(
    rabbit_settings: MakeRabbitSettings,
    postgres_only_url: str,
    amqp_url: str,
    running_relays: RunningRelays,
) -> None:
    from tests.rabbitmq.rabbit_helpers import credit_registry, running
    from tests.support.processes import free_port
    from tests.support.waiting import wait_for
    from worker.brokers.rabbitmq import RabbitMQPublisher
    from worker.db import create_engine

    b = rabbit_settings()
    port = free_port()
    proxy = Proxy(port)
    await proxy.start()
    via_proxy = b.model_copy(
        update={"url": amqp_url.replace(":5672/", f":{port}/"), "reconnect_interval": 0.5}
    )
    engine = create_engine(postgres_only_url, pool_size=4)
    publisher = RabbitMQPublisher(via_proxy, timeout=2.0)
    settings = fast_outbox(max_attempts=2, lease=5.0, publish_timeout=2.0, poll_interval=0.2)
    relay = Relay(engine, publisher, settings)
    registry, _ = credit_registry()
    body = {"account_id": "acct", "amount": "1"}
    backlog_seen = []
    try:
        async with running(b, postgres_only_url, registry) as pump, running_relays([relay]):
            await publish_rows(engine, "before", [("CreditRequested", body, None, None)] * 10)
            await wait_for(lambda: pump.stats["committed"] == 10, 20, "10 credits before")
            await proxy.cut()
            for n in range(30):  # 30 s without the broker, rows keep coming
                await publish_rows(engine, f"during-{n}", [("CreditRequested", body, None, None)])
                await asyncio.sleep(1.0)
                backlog_seen.append((await relay.update_gauges()).pending)
            assert pump.stats["committed"] == 10
            rows = await outbox_rows(engine)
            assert sum(r.state == "pending" for r in rows) == 30
            assert {r.attempts for r in rows} == {0}  # an outage is nobody's attempt
            await proxy.start()
            await wait_for(lambda: pump.stats["committed"] == 40, 60, "the backlog drained")
    finally:
        await publisher.close()
        await engine.dispose()
        await proxy.cut()
    assert backlog_seen[-1] == 30 and backlog_seen == sorted(backlog_seen)
    assert relay.stats["parked"] == 0


class ForgetsOnce(Relay):
    """Confirmed by the broker, then 'dies' before its first mark: the lease has to run out."""

    forgot = False

    async def mark_sent(self, ids: Any) -> None:
        if not self.forgot:
            self.forgot = True
            return
        await super().mark_sent(ids)


@pytest.mark.kafka
async def test_kafka_copies_of_a_republished_row_are_applied_once_downstream(
    engine: AsyncEngine, tansu: Tansu, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    from decimal import Decimal

    from sqlalchemy import select

    from handlers.credit import Account
    from tests.rabbitmq.rabbit_helpers import credit_registry
    from tests.support.waiting import wait_for
    from worker.brokers.kafka import KafkaConsumer

    topic = unique("credits")
    await create_topic(tansu.bootstrap, topic, 2)
    kafka = settings_for(tansu.bootstrap, topic)
    configure(fast_outbox(destination=topic))
    body = {"account_id": "k-acct", "amount": "1"}
    for n in range(10):
        await publish_rows(engine, f"order-{n}", [("CreditRequested", body, "k-acct", None)])
    publisher = KafkaPublisher(kafka, timeout=10.0)
    relay = ForgetsOnce(engine, publisher, fast_outbox(lease=1.0, publish_timeout=0.5))
    try:
        assert (await relay.run_once()).sent == 10  # confirmed, never marked
        await asyncio.sleep(1.1)
        assert await relay.drain() == 10  # the lease ran out: the same ids again
    finally:
        await publisher.close()
    registry, _ = credit_registry()
    settings = make_settings(concurrency=2)
    async with run_pumps([KafkaConsumer(settings, kafka)], [engine], registry, settings) as pumps:
        await wait_for(
            lambda: pumps[0].stats["committed"] + pumps[0].stats["duplicate"] >= 20,
            60,
            "both copies of every credit",
        )
    assert (pumps[0].stats["committed"], pumps[0].stats["duplicate"]) == (10, 10)
    async with engine.connect() as connection:
        balance = await connection.scalar(select(Account.balance).where(Account.id == "k-acct"))
    assert balance == Decimal(10)


# Tansu creates any topic a producer names and cannot be told not to; a name Kafka does
# not allow is the destination it will not serve instead. Its metadata answers
# INVALID_TOPIC and aiokafka keeps asking until its request timeout, exactly as it does
# for an unknown topic on a cluster with auto.create.topics.enable=false.
UNSERVED_TOPIC = "no such topic!"


@pytest.mark.kafka
async def test_the_kafka_publisher_refuses_an_unserved_topic_within_its_timeout(
    tansu: Tansu,
) -> None:
    """The producer's metadata wait ends before the publish timeout: the row is refused
    (and counted), not the whole call given up as an unreachable broker."""
    publisher = KafkaPublisher(settings_for(tansu.bootstrap, unique("t")), timeout=2.0)
    outgoing = Outgoing("m-1", "Seen", b"{}", destination=UNSERVED_TOPIC)
    try:
        async with asyncio.timeout(2.5):
            (refusal,) = await publisher.publish([outgoing])
    finally:
        await publisher.close()
    assert refusal is not None and "UnknownTopicOrPartitionError" in refusal
    assert repr(UNSERVED_TOPIC) in refusal


@pytest.mark.kafka
async def test_kafka_rows_for_a_topic_the_broker_will_not_serve_are_parked_alone(
    engine: AsyncEngine, tansu: Tansu
) -> None:
    """One row whose topic cannot be served no longer stalls the relay: the good rows of
    its batch go out once and are marked sent, and it is parked after its attempts."""
    topic = unique("events")
    await create_topic(tansu.bootstrap, topic, 1)
    good = [("Seen", {"n": n}, None, topic) for n in range(4)]
    bad = ("Seen", {"n": 9}, None, UNSERVED_TOPIC)
    ids = await publish_rows(engine, "in-1", [good[0], good[1], bad, good[2], good[3]])
    publisher = KafkaPublisher(settings_for(tansu.bootstrap, topic), timeout=2.0)
    relay = Relay(engine, publisher, fast_outbox(max_attempts=3, publish_timeout=2.0))
    try:
        for _ in range(6):  # bounded: three rounds are enough when each row is decided alone
            await relay.run_once()
    finally:
        await publisher.close()
    rows = {r.message_id: r for r in await outbox_rows(engine)}
    parked = rows[ids[2]]
    assert (parked.state, parked.attempts) == ("parked", 3)
    assert repr(UNSERVED_TOPIC) in parked.last_error
    assert {rows[i].state for i in ids if i != ids[2]} == {"sent"}
    records, _ = await read_all(tansu.bootstrap, topic, 1)
    assert sorted(header(r, "message-id") or "" for r in records) == sorted(
        i for i in ids if i != ids[2]
    )  # each good row once
