"""The Kafka adapter's destination and its own event tallies (``Broker.stats``), on Tansu.

The pump names its spans ``process <destination>``; the stats are exported as
``worker_broker_events_total{broker="kafka", event}``, so each counter must move on the
real event it names: an assignment, a seek back for a nack, a commit, a revocation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from tests.kafka.kafka_helpers import MakeTopic, consuming, produce, receive, transport_settings
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer, KafkaSettings

pytestmark = pytest.mark.kafka


def test_the_destination_is_the_topics_consumed(
    kafka_settings: Callable[..., KafkaSettings],
) -> None:
    assert KafkaConsumer(transport_settings(), kafka_settings("orders")).destination == "orders"
    several = KafkaConsumer(transport_settings(), kafka_settings(" orders, payments ,"))
    assert several.destination == "orders,payments"
    assert several.stats == Counter()  # nothing happened yet


async def test_an_assignment_a_nack_and_a_commit_move_their_counters(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(2)
    await produce(bootstrap, topic, [(None, b"{}", {"message-id": "m0"}, 0)])

    async with consuming(kafka_settings(topic)) as broker:
        assert broker.destination == topic
        await wait_for(lambda: broker.stats["partitions_assigned"] == 2, 15, "the assignment")
        assert broker.stats["rebalances"] == 1
        assert broker.stats["seeks_back"] == 0

        first = await receive(broker)
        assert first.delivery_count == 1
        await first.nack()  # the partition seeks back to it after the backoff
        again = await receive(broker)
        assert (again.message_id, again.delivery_count) == ("m0", 2)
        assert broker.stats["seeks_back"] == 1

        assert broker.stats["commits"] == 0  # nothing settled yet, nothing to commit
        await again.ack()
        await wait_for(lambda: broker.stats["commits"] >= 1, 10, "the commit past m0")
        assert broker.stats["commit_failures"] == 0
        assert broker.stats["fetch_errors"] == 0


async def test_a_rebalance_counts_the_revocation_and_the_record_it_dropped(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(2)
    await produce(bootstrap, topic, [(None, b"{}", {"message-id": "held"}, 0)])
    kafka = kafka_settings(topic, rebalance_grace=0.3)

    async with consuming(kafka) as first:
        await wait_for(lambda: len(first.assignment) == 2, 15, "the first member's assignment")
        held = await receive(first)  # in flight, not settled within the grace period
        assert held.message_id == "held"
        async with consuming(kafka) as second:
            await wait_for(lambda: first.assignment and second.assignment, 20, "the rebalance")
            # the join takes both partitions away at once, the held record's with them
            assert first.stats["partitions_revoked"] >= 2
            assert first.stats["in_flight_dropped"] == 1
            assert first.stats["rebalances"] >= 2
            assert second.stats["partitions_assigned"] >= 1
