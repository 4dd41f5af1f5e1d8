"""Settlements that cannot go the usual way, against the real RabbitMQ.

- A copy that fails (returned as unroutable, refused by the confirm, never
  confirmed) must not leave the original unacked on a live channel, where
  nothing would ever redeliver it and it would hold a prefetch slot for good.
- An immediate retry on a classic queue (no ``x-delivery-count`` there) must
  still count up to ``WORKER_MAX_DELIVERIES`` and reach the dead-letter queue.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import aio_pika
import pytest

from tests.rabbitmq.rabbit_helpers import (
    all_depths,
    credit_registry,
    make_broker,
    publish,
    publish_raw,
    running,
    take_dead_letters,
)
from tests.support.credits import credit
from tests.support.rabbitmq import MakeRabbitSettings, arabbitmqctl, rabbitmqctl
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import DELIVERIES_HEADER, RabbitMQSettings
from worker.delivery import Delivery
from worker.errors import Retry, SettlementLost
from worker.registry import Context

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


async def _delete_queues(rabbit: RabbitMQSettings, *names: str) -> None:
    connection = await aio_pika.connect(rabbit.url)
    try:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)
    finally:
        await connection.close()


def _retry_queues(rabbit: RabbitMQSettings) -> list[str]:
    return [rabbit.retry_queue(delay) for delay in rabbit.retry_delays]


async def _refuse_publishes(rabbit: RabbitMQSettings, vhost: str) -> None:
    """A policy that makes the retry queues nack every publish (a real confirm nack).

    The delay queues are quorum queues, whose length limit is soft (a publish into an
    empty queue is accepted even at ``max-length: 0``): one filler each makes it bite.
    """
    await publish_raw(
        rabbit,
        *(aio_pika.Message(b"filler", message_id="filler") for _ in rabbit.retry_delays),
        routing_keys=_retry_queues(rabbit),
    )
    pattern = f"^{rabbit.queue}\\.delay\\."
    definition = json.dumps({"max-length": 0, "overflow": "reject-publish"})
    name = f"{rabbit.queue}-refuse"
    await arabbitmqctl("set_policy", "-p", vhost, "--apply-to", "queues", name, pattern, definition)

    async def applied() -> bool:
        out = await arabbitmqctl("list_queues", "-q", "-p", vhost, "name", "policy")
        rows = [line.split() for line in out.splitlines()]
        ours = [row for row in rows if row and row[0] in _retry_queues(rabbit)]
        return len(ours) == len(rabbit.retry_delays) and all(row[-1] == name for row in ours)

    await wait_for(applied, 15, "the reject-publish policy to apply")


@pytest.fixture
def policies(rabbitmq_vhost: str) -> Iterator[list[str]]:
    """Policy names to clear after the test (the session's vhost goes at the end anyway)."""
    names: list[str] = []
    yield names
    for name in names:
        rabbitmqctl("clear_policy", "-p", rabbitmq_vhost, name)


async def _never_confirmed(*_: Any) -> None:
    await asyncio.Event().wait()  # a publisher confirm that never arrives


CASES = ["retry-queue-gone", "dead-letter-queue-gone", "confirm-refused", "confirm-timeout"]


@pytest.mark.parametrize("case", CASES)
async def test_a_failed_copy_gives_the_original_back(
    case: str,
    rabbit_settings: MakeRabbitSettings,
    rabbitmq_vhost: str,
    policies: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rabbit = rabbit_settings(
        settle_timeout=0.5 if case == "confirm-timeout" else 5.0,
        retry_delays=[60.0],  # the filler of the confirm-refused case must not expire
    )
    broker = make_broker(rabbit)
    await broker.start(prefetch=1)  # one slot: a stuck original would block everything
    try:
        await publish(rabbit, [credit("m1", "a", "1")])
        delivery = await asyncio.wait_for(broker.receive(), 10)
        settle: Callable[[Delivery], Awaitable[None]] = lambda d: d.nack()  # noqa: E731
        if case == "retry-queue-gone":  # an operator's cleanup: the copy comes back unroutable
            await _delete_queues(rabbit, *_retry_queues(rabbit))
        elif case == "dead-letter-queue-gone":
            await _delete_queues(rabbit, rabbit.dead_letter_queue)
            settle = lambda d: d.dead_letter("failed 5 deliveries")  # noqa: E731
        elif case == "confirm-refused":
            policies.append(f"{rabbit.queue}-refuse")
            await _refuse_publishes(rabbit, rabbitmq_vhost)
        else:
            monkeypatch.setattr(broker, "_publish", _never_confirmed)
        with pytest.raises(SettlementLost):
            await asyncio.wait_for(settle(delivery), 10)
        # the channel is healthy: only a basic.nack brings the original back
        again = await asyncio.wait_for(broker.receive(), 5)
        # quorum queue: the requeue counts as a delivery, so the pump can still give up
        assert (again.message_id, again.delivery_count) == ("m1", 2)
        await again.ack()
    finally:
        await broker.close()


async def test_a_pump_with_one_slot_keeps_consuming_when_a_copy_fails(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings()

    def fail_m1(ctx: Context) -> None:
        if ctx.message_id == "m1":
            raise ValueError("payment service down")

    registry, _ = credit_registry(fail_m1)
    async with running(rabbit, pg, registry, concurrency=1, max_deliveries=3) as pump:
        await _delete_queues(rabbit, *_retry_queues(rabbit))
        # raw: `worker publish` would declare the retry queues again
        body = b'{"account_id": "a", "amount": "1"}'
        await publish_raw(
            rabbit,
            *(aio_pika.Message(body, message_id=m, type="CreditRequested") for m in ("m1", "m2")),
        )
        # every nack of m1 fails and requeues it; the quorum count still ends it
        await wait_for(lambda: pump.stats["committed"] == 1, 15, "m2, behind the failing m1")
        await wait_for(lambda: pump.stats["dead-letter"] == 1, 15, "m1 dead-lettered")
    assert pump.stats["settlement-lost"] == 2
    (letter,) = await take_dead_letters(rabbit)
    assert (letter.message_id, letter.headers[DELIVERIES_HEADER]) == ("m1", 3)


@pytest.mark.parametrize(
    ("queue_type", "retry_delays", "error"),
    [
        ("classic", [], ValueError("ledger says no")),
        ("classic", [0.2, 0.5], Retry("Retry-After: 0", delay=0)),
        ("quorum", [], ValueError("ledger says no")),
        ("quorum", [0.2, 0.5], Retry("Retry-After: 0", delay=0)),
    ],
    ids=["classic-no-retry-queues", "classic-delay-0", "quorum-no-retry-queues", "quorum-delay-0"],
)
async def test_an_immediate_retry_counts_up_to_the_dead_letter_queue(
    rabbit_settings: MakeRabbitSettings,
    pg: str,
    queue_type: str,
    retry_delays: list[float],
    error: Exception,
) -> None:
    rabbit = rabbit_settings(queue_type=queue_type, retry_delays=retry_delays)
    headers: list[Mapping[str, Any]] = []

    async def always(ctx: Context) -> None:
        headers.append(ctx.headers)
        if len(headers) > 10:  # a hot loop (the bug): slow it down, the wait below fails
            await asyncio.sleep(0.2)
        raise error

    registry, seen = credit_registry(always)
    async with running(rabbit, pg, registry, concurrency=1, max_deliveries=3) as pump:
        await publish(rabbit, [credit("m1", "a", "5")])
        await wait_for(lambda: pump.stats["dead-letter"] == 1, 15, "the dead letter")
    assert [count for count, _ in seen] == [1, 2, 3]
    (letter,) = await take_dead_letters(rabbit)
    # a Retry is not a failure: the pump dead-letters the 4th delivery before handling it
    assert letter.headers[DELIVERIES_HEADER] == (4 if isinstance(error, Retry) else 3)
    # both queue types: a confirmed copy carries the count (a nack is never relied on to count)
    carried = [h.get(DELIVERIES_HEADER) for h in headers[1:]]
    assert carried == [1, 2]
    assert set((await all_depths(rabbit)).values()) == {0}
