"""Readiness of a Kafka group member (the deployment's rollouts and drains rely on it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tests.kafka.kafka_helpers import transport_settings
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer, KafkaSettings

pytestmark = pytest.mark.kafka


async def test_an_idle_group_member_is_ready(
    new_topic: Callable[[int], Awaitable[str]], kafka_settings: Callable[..., KafkaSettings]
) -> None:
    """Readiness that required partitions hung rollouts at maximum scale (a surge pod found
    none to own) and left a pod unready for good on a topic with fewer partitions than
    replicas. A healthy member that owns nothing is ready; it idles."""
    topic = await new_topic(1)
    members = [KafkaConsumer(transport_settings(), kafka_settings(topic)) for _ in range(2)]
    try:
        for member in members:
            await member.start(prefetch=1)
        await wait_for(lambda: sum(bool(m.assignment) for m in members) == 1, 30, "one owner")
        await wait_for(lambda: all(m.ready for m in members), 30, "both ready")
        (idle,) = [m for m in members if not m.assignment]
        assert idle.ready
    finally:
        for member in members:
            await member.close()
