"""Settlements that cannot go the usual way, against the real RabbitMQ.

- A copy that fails (returned as unroutable, refused by the confirm, never confirmed)
  on a live channel: the original stays held while the copy is tried again with
  backoff, and is parked in the longest delay queue once that has gone on for
  ``WORKER_RABBITMQ_COPY_HOLD``. It was requeued at once, a hot loop (1,789 requeues
  in 4 s), and under a ``delivery-limit`` policy RabbitMQ then dead-lettered the
  message itself, at most once, into the queue that refused it: lost.
- An immediate retry on a classic queue (no ``x-delivery-count`` there) must
  still count up to ``WORKER_MAX_DELIVERIES`` and reach the dead-letter queue.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Any

import aio_pika
import pytest

from tests.rabbitmq.rabbit_helpers import (
    all_depths,
    credit_registry,
    dead_letter_reason,
    depths,
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
from worker.errors import Retry
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


async def _refuse_publishes(
    rabbit: RabbitMQSettings, vhost: str, queues: list[str], name: str
) -> None:
    """A policy that makes ``queues`` nack every publish (a real confirm nack).

    A quorum queue's length limit is soft (a publish into an empty queue is accepted
    even at ``max-length: 0``): one filler each makes it bite. A classic one refuses at once.
    """
    await publish_raw(
        rabbit,
        *(aio_pika.Message(b"filler", message_id="filler") for _ in queues),
        routing_keys=queues,
    )
    pattern = "^(" + "|".join(q.replace(".", "\\.") for q in queues) + ")$"
    definition = json.dumps({"max-length": 0, "overflow": "reject-publish"})
    await arabbitmqctl("set_policy", "-p", vhost, "--apply-to", "queues", name, pattern, definition)

    async def applied() -> bool:
        out = await arabbitmqctl("list_queues", "-q", "-p", vhost, "name", "policy")
        rows = [line.split() for line in out.splitlines()]
        ours = [row for row in rows if row and row[0] in queues]
        return len(ours) == len(queues) and all(row[-1] == name for row in ours)

    await wait_for(applied, 15, "the reject-publish policy to apply")


@pytest.fixture
def policies(rabbitmq_vhost: str) -> Iterator[list[str]]:
    """Policy names to clear after the test (the session's vhost goes at the end anyway)."""
    names: list[str] = []
    yield names
    for name in names:
        rabbitmqctl("clear_policy", "-p", rabbitmq_vhost, name)


async def _make_room(vhost: str, name: str, queues: list[str]) -> None:
    """Raise the limit of the refusing policy. (Clearing it is not enough on RabbitMQ
    3.10.8: a quorum queue stays in its reject-publish state.)"""
    pattern = "^(" + "|".join(q.replace(".", "\\.") for q in queues) + ")$"
    definition = json.dumps({"max-length": 1000, "overflow": "reject-publish"})
    await arabbitmqctl("set_policy", "-p", vhost, "--apply-to", "queues", name, pattern, definition)


async def _never_confirmed(*_: Any) -> None:
    await asyncio.Event().wait()  # a publisher confirm that never arrives


CASES = ["retry-queue-gone", "dead-letter-queue-gone", "confirm-refused", "confirm-timeout"]


@pytest.mark.parametrize("case", CASES)
async def test_a_failed_copy_holds_the_original_and_tries_again_with_backoff(
    case: str,
    rabbit_settings: MakeRabbitSettings,
    rabbitmq_vhost: str,
    policies: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rabbit = rabbit_settings(
        settle_timeout=0.5 if case == "confirm-timeout" else 5.0,
        retry_delays=[60.0],  # nothing expires back during the test
    )
    broker = make_broker(rabbit)
    await broker.start(prefetch=1)  # one slot: a stuck original would block everything
    try:
        await publish(rabbit, [credit("m1", "a", "1")])
        delivery = await asyncio.wait_for(broker.receive(), 10)
        settle: Callable[[Delivery], Coroutine[Any, Any, None]] = lambda d: d.nack()  # noqa: E731
        target = rabbit.retry_queue(60.0)
        if case == "retry-queue-gone":  # an operator's cleanup: the copy comes back unroutable
            await _delete_queues(rabbit, target)
        elif case == "dead-letter-queue-gone":
            await _delete_queues(rabbit, rabbit.dead_letter_queue)
            settle = lambda d: d.dead_letter("failed 5 deliveries")  # noqa: E731
            target = rabbit.dead_letter_queue
        elif case == "confirm-refused":
            policies.append(f"{rabbit.queue}-refuse")
            await _refuse_publishes(rabbit, rabbitmq_vhost, [target], policies[-1])
        else:
            real = broker._give_backs.publish
            calls = {"n": 0}

            async def late_then_real(*args: Any) -> None:
                calls["n"] += 1
                await (_never_confirmed(*args) if calls["n"] <= 2 else real(*args))

            monkeypatch.setattr(broker._give_backs, "publish", late_then_real)
        settling = asyncio.create_task(settle(delivery))
        if case == "confirm-refused":
            await asyncio.sleep(2.5)
            assert not settling.done()  # held, not requeued
            assert 1 <= broker.stats["copies_refused"] <= 5  # backoff, not a hot loop
            await _make_room(rabbitmq_vhost, policies[-1], [target])
        await asyncio.wait_for(settling, 40)  # the copy made it: no SettlementLost
        assert broker.stats["copies_refused"] >= 1
        assert broker.stats["requeued_after_failed_copy"] == 0
        with pytest.raises(TimeoutError):  # the original was acked, never given back
            await asyncio.wait_for(broker.receive(), 1)
    finally:
        await broker.close()
    filler = 1 if case == "confirm-refused" else 0
    assert (await depths(rabbit, target))[target] == 1 + filler
    assert (await depths(rabbit, rabbit.queue))[rabbit.queue] == 0


@pytest.mark.parametrize("retry_delays", [[0.5], []], ids=["delay-queue", "no-delay-queues"])
async def test_a_dead_letter_the_broker_keeps_refusing_is_parked_and_never_lost(
    rabbit_settings: MakeRabbitSettings,
    rabbitmq_vhost: str,
    policies: list[str],
    pg: str,
    retry_delays: list[float],
) -> None:
    """The dead-letter queue is full (reject-publish) and the work queue has a
    delivery-limit policy of 1, as the docs recommend a backstop (RabbitMQ 4.x sets one
    by default): a requeue would let the broker dead-letter the message itself into the
    full queue. Held, then parked in the longest delay queue, it is never requeued, and
    reaches the dead-letter queue once that has room again.

    Without delay queues (``WORKER_RABBITMQ_RETRY_DELAYS=[]``) it is parked in the work
    queue itself. It was not: an AssertionError left the delivery unacked on its live
    channel, where nothing would ever return it, logged "broker will redeliver"."""
    rabbit = rabbit_settings(retry_delays=retry_delays, copy_hold=1.0)
    limit = f"{rabbit.queue}-limit"
    await arabbitmqctl(
        "set_policy", "-p", rabbitmq_vhost, "--apply-to", "queues", limit,
        f"^{rabbit.queue}$", json.dumps({"delivery-limit": 1}),
    )  # fmt: skip
    policies.append(limit)
    full = f"{rabbit.queue}-full"
    await publish(rabbit, [])  # the topology, before the policy on its dead-letter queue
    await _refuse_publishes(rabbit, rabbitmq_vhost, [rabbit.dead_letter_queue], full)
    policies.append(full)
    await take_dead_letters(rabbit)  # the filler: a classic queue refuses at once anyway

    registry, _ = credit_registry()
    async with running(rabbit, pg, registry, concurrency=2) as pump:
        await publish(rabbit, [credit("u1", "a", "1", type="RefundRequested")])
        await wait_for(lambda: pump.broker.stats["copies_parked"] >= 2, 20, "parked twice")
        assert pump.broker.stats["requeued_after_failed_copy"] == 0
        refused = pump.broker.stats["copies_refused"]
        assert refused <= 4 * pump.broker.stats["copies_parked"] + 4  # backoff, no hot loop
        await _make_room(rabbitmq_vhost, full, [rabbit.dead_letter_queue])

        async def dead_lettered() -> bool:
            return (await depths(rabbit, rabbit.dead_letter_queue))[rabbit.dead_letter_queue] > 0

        await wait_for(dead_lettered, 20, "the dead letter, once there is room")
        assert pump.stats["settlement-failed"] == 0
    (letter,) = await take_dead_letters(rabbit)
    assert letter.message_id == "u1"
    assert "RefundRequested" in dead_letter_reason(letter)
    assert set((await all_depths(rabbit)).values()) == {0}


async def test_a_fault_of_the_workers_own_in_a_copy_gives_the_original_back(
    rabbit_settings: MakeRabbitSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the broker refusing but the worker failing (a bug) while it copies: the
    settlement fails, and the pump logs "broker will redeliver". So the original must not
    stay unacked on its live channel, where RabbitMQ would never redeliver it."""
    rabbit = rabbit_settings()
    broker = make_broker(rabbit)
    await broker.start(prefetch=1)  # one slot: a held original would block everything
    try:
        await publish(rabbit, [credit("m1", "a", "1")])
        delivery = await asyncio.wait_for(broker.receive(), 10)

        async def bug(*_: Any) -> None:
            raise ValueError("a bug in the copy")

        monkeypatch.setattr(broker._give_backs, "publish", bug)
        with pytest.raises(ValueError, match="a bug in the copy"):
            await delivery.dead_letter("failed 5 deliveries")
        again = await asyncio.wait_for(broker.receive(), 10)  # redelivered, channel alive
        assert again.message_id == "m1"
        assert broker.stats["requeued_after_failed_copy"] == 1
        assert broker.stats["connection_lost"] == 0
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
        # raw: the test helper's publish would declare the retry queues again
        body = b'{"account_id": "a", "amount": "1"}'
        await publish_raw(
            rabbit,
            *(aio_pika.Message(body, message_id=m, type="CreditRequested") for m in ("m1", "m2")),
        )
        # m1's first nack is returned; the topology is declared again and the copy made
        await wait_for(lambda: pump.stats["committed"] == 1, 15, "m2, behind the failing m1")
        await wait_for(lambda: pump.stats["dead-letter"] == 1, 15, "m1 dead-lettered")
    assert pump.stats["settlement-lost"] == 0
    assert pump.broker.stats["copies_refused"] >= 1
    assert pump.broker.stats["requeued_after_failed_copy"] == 0
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
