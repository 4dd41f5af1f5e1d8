"""Settlement on the wire: the pump's verdicts, as the real RabbitMQ sees them.

What every broker must do (commit and duplicate acked, an error redelivered with
a higher count, max deliveries and poison dead-lettered with the reason, nothing
settled unfinished at shutdown) is proven on RabbitMQ by the broker contract,
tests/contract/test_contract_rabbitmq.py. The tests here check what only this
adapter does: the retry queues' delays, its headers, raw AMQP messages, the
identity function, connections and topology.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import aio_pika
import pytest

from tests.rabbitmq.rabbit_helpers import (
    all_depths,
    credit_registry,
    depths,
    make_broker,
    publish,
    publish_raw,
    running,
    take_dead_letters,
)
from tests.support.credits import credit
from tests.support.database import balances, fetch
from tests.support.pumps import engine_for, running_pump
from tests.support.rabbitmq import MakeRabbitSettings, arabbitmqctl
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import (
    DELIVERIES_HEADER,
    REASON_HEADER,
    RabbitMQConsumer,
    RabbitMQSettings,
)
from worker.errors import ConfigurationError, PublishStopped, Retry, SettlementLost
from worker.registry import Context
from worker.settings import Settings

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


async def markers(database_url: str) -> list[str]:
    return [r.message_id for r in await fetch(database_url, "SELECT message_id FROM inbox")]


async def test_handler_error_comes_back_after_the_backoff(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings(retry_delays=[0.4, 1.0])

    def fail_first(ctx: Context) -> None:
        if ctx.delivery_count == 1:
            raise RuntimeError("payment service down")

    registry, seen = credit_registry(fail_first)
    async with running(rabbit, pg, registry) as pump:
        await publish(rabbit, [credit("m1", "a", "5")])
        await wait_for(lambda: pump.stats["committed"] == 1, 10, "the redelivery to commit")
    (first, at1), (second, at2) = seen
    assert (first, second) == (1, 2)
    assert at2 - at1 >= 0.35, "redelivered before the retry queue's TTL"
    assert pump.stats["nack"] == 1 and pump.stats["ack"] == 1
    assert await balances(pg) == {"a": Decimal(5)}
    assert set((await all_depths(rabbit)).values()) == {0}


async def test_retry_requested_with_a_delay_uses_the_matching_retry_queue(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings(retry_delays=[0.1, 0.8])

    def retry_once(ctx: Context) -> None:
        if ctx.delivery_count == 1:
            raise Retry("not yet", delay=0.5)

    registry, seen = credit_registry(retry_once)
    async with running(rabbit, pg, registry) as pump:
        await publish(rabbit, [credit("m1", "a", "5")])
        await wait_for(lambda: pump.stats["committed"] == 1, 10, "the retry to commit")
    assert [count for count, _ in seen] == [1, 2]
    assert seen[1][1] - seen[0][1] >= 0.7, "a 0.5 s delay goes to the 0.8 s queue, not 0.1 s"


async def test_exhausted_message_is_dead_lettered_with_the_reason(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings(retry_delays=[0.05, 0.1])

    def always(ctx: Context) -> None:
        raise ValueError("ledger says no")

    registry, seen = credit_registry(always)
    async with running(rabbit, pg, registry, max_deliveries=3) as pump:
        await publish(rabbit, [credit("m1", "a", "5")])
        await wait_for(lambda: pump.stats["dead-letter"] == 1, 15, "the dead letter")
    assert [count for count, _ in seen] == [1, 2, 3]
    (letter,) = await take_dead_letters(rabbit)
    reason = str(letter.headers[REASON_HEADER])
    assert "ValueError" in reason and "ledger says no" in reason, reason
    assert letter.message_id == "m1" and letter.type == "CreditRequested"
    assert letter.headers[DELIVERIES_HEADER] == 3
    assert json.loads(letter.body) == {"account_id": "a", "amount": "5"}
    assert await markers(pg) == []
    assert set((await all_depths(rabbit)).values()) == {0}


# A body failing the schema is the contract's poison case (test_contract_rabbitmq.py);
# these are the raw AMQP shapes only this adapter sees.
@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (aio_pika.Message(b"{not json", message_id="p1", type="CreditRequested"), "invalid body"),
        (aio_pika.Message(b"{}", message_id="p3", type="DebitRequested"), "no handler"),
        (aio_pika.Message(b"{}", message_id="p4"), "no handler"),
    ],
    ids=["undecodable", "unknown-type", "no-type"],
)
async def test_poison_goes_to_the_dead_letter_queue_at_once(
    rabbit_settings: MakeRabbitSettings, pg: str, message: aio_pika.Message, reason: str
) -> None:
    rabbit = rabbit_settings()
    registry, seen = credit_registry()
    async with running(rabbit, pg, registry) as pump:
        await publish_raw(rabbit, message)
        await wait_for(lambda: pump.stats["dead-letter"] == 1, 10, "the dead letter")
    assert seen == [] and pump.stats["nack"] == 0
    (letter,) = await take_dead_letters(rabbit)
    assert reason in str(letter.headers[REASON_HEADER])
    assert letter.body == message.body
    assert set((await all_depths(rabbit)).values()) == {0}


def _broken_identity(message: Any) -> str | None:
    raise KeyError("x-order-id")


@pytest.mark.parametrize(
    "identity", [lambda message: None, _broken_identity], ids=["none", "raises"]
)
async def test_a_message_without_an_id_is_dead_lettered(
    rabbit_settings: MakeRabbitSettings, pg: str, identity: Callable[[Any], str | None]
) -> None:
    # aiormq stamps a random message_id on whatever it publishes, so the
    # message without one is simulated by an identity function that finds none,
    # or fails (the default's own None is proven in test_rabbitmq_settings_and_message_reading.py).
    rabbit = rabbit_settings()
    registry, seen = credit_registry()
    settings = Settings(database_url=pg, concurrency=2)
    async with (
        engine_for(pg, pool_size=4) as engine,
        running_pump(RabbitMQConsumer(rabbit, identity), engine, registry, settings) as pump,
    ):
        await publish(rabbit, [credit(None, "a", "1")])
        await wait_for(lambda: pump.stats["dead-letter"] == 1, 10, "the dead letter")
    (letter,) = await take_dead_letters(rabbit)
    assert letter.headers[REASON_HEADER] == "no message id"
    assert seen == []


async def test_cloudevents_headers_are_the_dedup_key_and_the_type(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings()
    registry, _ = credit_registry()
    body = b'{"account_id": "a", "amount": "1"}'
    event: dict[str, Any] = {"ce-id": "42", "ce-source": "/billing", "ce-type": "CreditRequested"}
    async with running(rabbit, pg, registry) as pump:
        await publish_raw(rabbit, aio_pika.Message(body, headers=event))
        await publish_raw(rabbit, aio_pika.Message(body, headers=event))
        other = {**event, "ce-source": "/shop"}  # same id, other source: another event
        await publish_raw(rabbit, aio_pika.Message(body, headers=other))
        await wait_for(lambda: pump.stats["ack"] == 3, 10, "three acks")
    assert pump.stats["duplicate"] == 1
    assert sorted(await markers(pg)) == ['["/billing","42"]', '["/shop","42"]']


async def test_a_consumer_that_vanishes_counts_as_a_delivery(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    rabbit = rabbit_settings()
    await publish(rabbit, [credit("m1", "a", "1")])
    first = make_broker(rabbit)
    await first.start(prefetch=1)
    delivery = await asyncio.wait_for(first.receive(), 10)
    assert delivery.delivery_count == 1
    await first.close()  # no settlement: RabbitMQ requeues it
    second = make_broker(rabbit)
    await second.start(prefetch=1)
    try:
        again = await asyncio.wait_for(second.receive(), 10)
        assert (again.message_id, again.delivery_count) == ("m1", 2)
        await again.ack()
    finally:
        await second.close()


async def test_stop_receiving_gives_untaken_deliveries_back(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    rabbit = rabbit_settings()
    await publish(rabbit, [credit(f"m{i}", "a", "1") for i in range(5)])
    broker = make_broker(rabbit)
    await broker.start(prefetch=5)
    try:
        taken = await asyncio.wait_for(broker.receive(), 10)
        await wait_for(lambda: broker._buffer.qsize() == 4, 10, "the rest of the prefetch")
        await broker.stop_receiving()
        assert not broker.ready
        await wait_for(
            lambda: _depth_is(rabbit, 4), 10, "four deliveries back in the queue while one is held"
        )
        await taken.ack()  # in-flight work may still settle after stop_receiving
    finally:
        await broker.close()
    assert (await depths(rabbit, rabbit.queue))[rabbit.queue] == 4


async def _depth_is(rabbit: RabbitMQSettings, expected: int) -> bool:
    return (await depths(rabbit, rabbit.queue))[rabbit.queue] == expected


async def test_lost_connection_means_settlement_lost_and_not_ready(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str
) -> None:
    rabbit = rabbit_settings()
    await publish(rabbit, [credit("m1", "a", "1")])
    broker = make_broker(rabbit)
    await broker.start(prefetch=1)
    try:
        delivery = await asyncio.wait_for(broker.receive(), 10)
        assert broker.ready
        # drops every connection in this test session's vhost only
        await arabbitmqctl("close_all_connections", "-p", rabbitmq_vhost, "test: connection lost")
        # the outage may last milliseconds; the restart test watches a long one
        await wait_for(lambda: broker.outages == 1, 10, "the adapter to notice")
        with pytest.raises(SettlementLost):
            await delivery.ack()
        await wait_for(lambda: broker.ready, 20, "ready again after the reconnect")
        again = await asyncio.wait_for(broker.receive(), 10)
        assert (again.message_id, again.delivery_count) == ("m1", 2)
        await again.ack()
    finally:
        await broker.close()
    assert (await depths(rabbit, rabbit.queue))[rabbit.queue] == 0


async def test_topology_declared_with_other_arguments_is_a_configuration_error(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    classic = make_broker(rabbit_settings(queue_type="classic"))
    await classic.start(prefetch=1)
    await classic.close()
    quorum = make_broker(rabbit_settings(queue_type="quorum"))
    with pytest.raises(ConfigurationError, match="WORKER_RABBITMQ_QUEUE"):
        await quorum.start(prefetch=1)
    assert not quorum.ready


async def test_publishing_a_type_no_binding_routes_fails_loudly(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    rabbit = rabbit_settings(binding_keys=["Credit*"])  # topic keys match whole words only
    with pytest.raises(PublishStopped, match="reaches no queue") as stopped:
        await publish(rabbit, [credit("m1", "a", "1")])
    assert stopped.value.configuration and stopped.value.confirmed == []
    await publish(rabbit_settings(binding_keys=["CreditRequested"]), [credit("m2", "a", "1")])
    assert (await depths(rabbit, rabbit.queue))[rabbit.queue] == 1
