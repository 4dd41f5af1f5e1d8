"""Losing the broker is survived: readiness drops, aiokafka reconnects, the group is rejoined."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import pytest

from tests.kafka.kafka_helpers import create_topic, produce, settings_for, transport_settings
from tests.support.tansu import Tansu, running_tansu
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def own_tansu() -> Iterator[Tansu]:
    """A broker of this test's own: it gets killed and restarted on the same port."""
    with running_tansu() as broker:
        yield broker


async def test_broker_loss_drops_readiness_and_consumption_resumes(own_tansu: Tansu) -> None:
    bootstrap = own_tansu.bootstrap
    await create_topic(bootstrap, "outage", 1)
    broker = KafkaConsumer(transport_settings(), settings_for(bootstrap, "outage"))
    await broker.start(prefetch=4)
    try:
        await wait_for(lambda: broker.ready, 15, "ready")

        own_tansu.stop(signal.SIGKILL)
        await wait_for(lambda: not broker.ready, 10, "readiness to drop")

        # Test-broker quirk: Tansu keeps nothing over a restart (topics, groups,
        # offsets), so the topic is created again and the member rejoins a new group.
        own_tansu.start()
        await create_topic(bootstrap, "outage", 1)
        records = [(None, b"{}", {"message-id": f"b{n}"}, 0) for n in range(3)]
        await produce(bootstrap, "outage", records)
        await wait_for(lambda: broker.ready, 30, "readiness to come back")
        received: list[str | None] = []
        async with asyncio.timeout(20):
            while len(received) < 3:
                delivery = await broker.receive()
                received.append(delivery.message_id)
                await delivery.ack()
        assert received == ["b0", "b1", "b2"]
    finally:
        await broker.stop_receiving()
        await broker.close()


async def test_close_with_the_broker_gone_is_bounded(own_tansu: Tansu) -> None:
    bootstrap = own_tansu.bootstrap
    await create_topic(bootstrap, "gone", 1)
    await produce(bootstrap, "gone", [(None, b"{}", {"message-id": "a"}, 0)])
    kafka = settings_for(bootstrap, "gone", commit_interval=60, commit_timeout=1.0)
    broker = KafkaConsumer(transport_settings(), kafka)
    await broker.start(prefetch=1)
    delivery = await asyncio.wait_for(broker.receive(), 10)
    await delivery.ack()  # settled, not yet committed: close() will try
    own_tansu.stop(signal.SIGKILL)
    started = time.monotonic()
    await broker.stop_receiving()
    await broker.close()
    assert time.monotonic() - started < 5  # the final commit gave up after commit_timeout
