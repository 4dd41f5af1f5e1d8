"""Service Bus and the local clock: receiving compares each message's enqueued and
locked-until times (the broker's clock) with the local one, which the SDK's lock checks
use, and warns (once a minute, counting every message) when they disagree."""

from __future__ import annotations

import time

import pytest
import structlog

from tests.servicebus.fake import Entity, FakeServiceBus
from tests.servicebus.sb_helpers import StartConsumer, msg, send, take
from worker.brokers.servicebus import messages


@pytest.mark.parametrize(("offset", "side"), [(600.0, "ahead"), (-900.0, "behind")])
async def test_clock_skew_is_detected_and_logged_at_receive(
    bus: FakeServiceBus,
    queue: Entity,
    consumers: StartConsumer,
    monkeypatch: pytest.MonkeyPatch,
    offset: float,
    side: str,
) -> None:
    await send(bus, msg("a"), msg("b"))
    monkeypatch.setattr(messages, "wall", lambda: time.time() + offset)
    with structlog.testing.capture_logs() as logs:
        consumer = await consumers()
        seen = [await take(consumer) for _ in range(2)]
    assert consumer.stats["clock_skew"] == 2
    [warning] = [e for e in logs if e["event"].startswith("servicebus clock skew")]
    assert warning["log_level"] == "warning" and warning["local_clock"] == side
    assert warning["message_id"] == "a"
    assert (warning["skew_s"] > 0) == (side == "ahead")
    assert abs(warning["skew_s"]) >= 300  # a lower bound, never more than the real skew
    assert abs(warning["skew_s"]) <= abs(offset) + 1
    assert consumer.clock_skew == warning["skew_s"] or abs(consumer.clock_skew) >= 300
    assert {d.message_id for d in seen} == {"a", "b"}


async def test_a_true_clock_logs_no_skew(
    bus: FakeServiceBus, queue: Entity, consumers: StartConsumer
) -> None:
    await send(bus, msg("a"))
    with structlog.testing.capture_logs() as logs:
        consumer = await consumers()
        await (await take(consumer)).ack()
    assert consumer.stats["clock_skew"] == 0
    assert not [e for e in logs if e["event"].startswith("servicebus clock skew")]
