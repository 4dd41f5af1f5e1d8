"""Every move of a message is at-least-once, and only a message's own failures count.

Against the real local RabbitMQ: copies waiting in the delay queues while the
broker stops (their TTLs run out during the outage), workers killed meanwhile,
graceful restarts with a full prefetch, a dead letter moved back by an operator
tool, and queues left by earlier versions.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path

import aio_pika
import pytest

from tests.rabbitmq.rabbit_helpers import (
    all_depths,
    credit_registry,
    dead_letter_reason,
    make_broker,
    publish,
    publish_raw,
    rabbit_env,
    running,
    settled,
    take_dead_letters,
)
from tests.support.credits import credit
from tests.support.database import balances, marker_count, scalar
from tests.support.processes import WorkerProcess
from tests.support.rabbitmq import MakeRabbitSettings, arabbitmqctl
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import (
    DELIVERIES_HEADER,
    REASON_HEADER,
    RabbitMQAdmin,
    RabbitMQSettings,
    make_identity,
)
from worker.registry import Context

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


def _copy_as_the_adapter_would(message_id: str, account: str, deliveries: int) -> aio_pika.Message:
    body = f'{{"account_id": "{account}", "amount": "1"}}'.encode()
    return aio_pika.Message(
        body,
        message_id=message_id,
        type="CreditRequested",
        headers={DELIVERIES_HEADER: deliveries},
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


# RabbitMQ (3.10) recovers a vhost's queues before its exchanges: a delay queue whose copies
# expired during the outage may forward them before the default exchange is back ("its
# configured dead-letter-exchange exchange '' ... does not exist", in the server's log) and
# tries again only when dead_letter_worker_publisher_confirm_timeout (180 s) runs out. Late,
# not lost: the wait below outlasts that timer.
REDELIVERED_AFTER_RECOVERY = 180 + 60


@pytest.mark.slow
@pytest.mark.serial  # stop_app: every connection to the server drops, other tests' too
@pytest.mark.timeout(REDELIVERED_AFTER_RECOVERY + 120)
@pytest.mark.parametrize("kill", [False, True], ids=["workers-wait", "workers-sigkilled"])
async def test_copies_waiting_in_every_delay_queue_survive_a_broker_restart(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str, pg: str, tmp_path: Path, kill: bool
) -> None:
    """The old classic TTL queues dead-lettered at most once: a copy whose TTL ran out
    while the broker was down was dropped. The quorum delay queues keep it until the
    work queue has confirmed it."""
    rabbit: RabbitMQSettings = rabbit_settings(retry_delays=[0.5, 1.0, 2.0], reconnect_interval=0.3)
    env = rabbit_env(rabbit, pg, WORKER_CONCURRENCY="8", WORKER_DB_PROBE_BACKOFF_MAX="0.5")
    workers = [WorkerProcess(env, tmp_path / f"w{n}.log") for n in range(2)]
    per_queue = 50
    try:
        await wait_for(lambda: all(w.logged("pump started") for w in workers), 60, "workers")
        names = [rabbit.retry_queue(d) for d in rabbit.retry_delays]
        copies = [
            _copy_as_the_adapter_would(f"{queue}-{n}", f"acct-{n % 5}", 1)
            for queue in names
            for n in range(per_queue)
        ]
        routes = [queue for queue in names for _ in range(per_queue)]
        await publish_raw(rabbit, *copies, routing_keys=routes)
        try:
            await arabbitmqctl("stop_app")  # before the shortest TTL (0.5 s) runs out
            if kill:
                for worker in workers:
                    worker.signal(signal.SIGKILL)
                    await asyncio.to_thread(worker.wait, 10)
            await asyncio.sleep(3.0)  # every TTL expires while the broker is down
        finally:
            await arabbitmqctl("start_app")
        if kill:
            workers += [WorkerProcess(env, tmp_path / f"again{n}.log") for n in range(2)]
        total = per_queue * len(names)
        await wait_for(
            _inbox_count(pg, total), REDELIVERED_AFTER_RECOVERY, "every parked copy applied"
        )
        # at-least-once may bring a copy back twice: wait until those are absorbed too
        await wait_for(settled(rabbitmq_vhost, rabbit), 60, "the queues to drain")
        for worker in workers:
            worker.signal(signal.SIGTERM)
        for worker in workers:
            await asyncio.to_thread(worker.wait, 30)
    finally:
        for worker in workers:
            worker.kill()
    assert await scalar(pg, "SELECT count(DISTINCT message_id) FROM inbox") == total
    assert await balances(pg) == {f"acct-{n}": Decimal(total // 5) for n in range(5)}
    assert set((await all_depths(rabbit)).values()) == {0}
    assert await take_dead_letters(rabbit) == []


async def test_graceful_restarts_with_a_full_prefetch_spend_no_delivery_counts(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    """A graceful shutdown gives back what it had prefetched, and what its grace period cut
    short, without raising the quorum queue's x-delivery-count: ten rolling restarts of a
    worker holding a full prefetch dead-letter nothing and leave every count at 1."""
    rabbit: RabbitMQSettings = rabbit_settings()
    total = 24
    await publish(rabbit, [credit(f"g{n}", "a", "1") for n in range(total)])
    slow = True

    async def hold(ctx: Context) -> None:
        if slow:
            await asyncio.sleep(10)  # cut short by the grace period

    registry, seen = credit_registry(hold)
    for _ in range(10):
        async with running(
            rabbit, pg, registry, concurrency=4, max_deliveries=1, grace_period=0.1
        ) as pump:
            broker = pump.broker
            await wait_for(lambda: pump.in_flight == 4, 10, "the prefetch in handlers")
            del broker
    slow = False
    seen.clear()
    async with running(rabbit, pg, registry, concurrency=4, max_deliveries=1) as pump:
        await wait_for(_inbox_count(pg, total), 30, "every message applied")
    assert {count for count, _ in seen} == {1}
    assert await take_dead_letters(rabbit) == []
    assert (await balances(pg))["a"] == total


async def test_a_dead_letter_moved_back_by_an_operator_tool_starts_afresh(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    """A shovel or the management UI's "Move messages" keeps every header: the worker's
    carried count must not dead-letter it again before the handler ever sees it."""
    rabbit: RabbitMQSettings = rabbit_settings()
    moved_back = aio_pika.Message(
        b'{"account_id": "a", "amount": "1"}',
        message_id="moved",
        type="CreditRequested",
        headers={DELIVERIES_HEADER: 5, REASON_HEADER: "failed 5 deliveries: credit: ..."},
    )
    registry, seen = credit_registry()
    async with running(rabbit, pg, registry, max_deliveries=5) as pump:
        await publish_raw(rabbit, moved_back)  # once the queue is declared
        await wait_for(lambda: pump.stats["committed"] == 1, 15, "the handler to run it")
    assert [count for count, _ in seen] == [1]
    assert await take_dead_letters(rabbit) == []


async def test_queues_of_earlier_versions_are_drained_into_the_new_ones(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings(retry_delays=[0.2, 0.5])
    legacy_retry, legacy_dead = f"{rabbit.queue}.retry.200ms", f"{rabbit.queue}.dead"
    connection = await aio_pika.connect(rabbit.url)
    try:
        channel = await connection.channel()
        # the old declarations: a classic retry queue with a long TTL (so nothing expires
        # by itself here), a quorum dead-letter queue bound to the dead-letter exchange
        await channel.declare_queue(legacy_retry, durable=True, arguments={
            "x-queue-type": "classic", "x-message-ttl": 600_000,
            "x-dead-letter-exchange": "", "x-dead-letter-routing-key": rabbit.queue})  # fmt: skip
        dlx = await channel.declare_exchange(
            rabbit.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
        dead = await channel.declare_queue(
            legacy_dead, durable=True, arguments={"x-queue-type": "quorum"}
        )
        await dead.bind(dlx, "")
    finally:
        await connection.close()
    await publish_raw(rabbit, _copy_as_the_adapter_would("waiting", "a", 1),
                      routing_keys=[legacy_retry])  # fmt: skip
    letter = _copy_as_the_adapter_would("dead", "a", 5)
    letter.headers[REASON_HEADER] = "failed 5 deliveries: credit: ValueError: no"
    await publish_raw(rabbit, letter, routing_keys=[legacy_dead])

    broker = make_broker(rabbit)
    await broker.start(prefetch=4)
    try:
        delivery = await asyncio.wait_for(broker.receive(), 10)
        assert (delivery.message_id, delivery.delivery_count) == ("waiting", 2)
        await delivery.ack()
    finally:
        await broker.close()
    (moved,) = await take_dead_letters(rabbit)
    assert moved.message_id == "dead" and dead_letter_reason(moved).startswith("failed 5")
    listed = await arabbitmqctl("list_queues", "-q", "-p", rabbitmq_vhost, "name", "messages")
    counts = {name: int(n) for name, n in (line.split() for line in listed.splitlines()[1:])}
    assert rabbit.dead_letter_queue in counts
    # drained: gone, or empty (a quorum queue may report its count late; the next start
    # deletes it then)
    assert counts.get(legacy_retry, 0) == 0 and counts.get(legacy_dead, 0) == 0, counts


def _inbox_count(database_url: str, expected: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        try:
            return await marker_count(database_url) == expected
        except OSError:  # the database restarting under a chaos test
            return False

    return check


async def test_listing_dead_letters_under_a_delivery_limit_policy_loses_none(
    rabbit_settings: MakeRabbitSettings, pg: str, rabbitmq_vhost: str
) -> None:
    """The old quorum dead-letter queue counted every peek as a return: with a
    ``delivery-limit`` policy (recommended as a backstop; RabbitMQ 4.x has a default) the
    third listing deleted the dead letters. The classic queue counts nothing."""
    rabbit: RabbitMQSettings = rabbit_settings()
    name = f"{rabbit.queue}-limit"
    definition = '{"delivery-limit": 2}'
    await arabbitmqctl("set_policy", "-p", rabbitmq_vhost, name, f"^{rabbit.queue}", definition)
    try:

        async def poison(ctx: Context) -> None:
            raise ValueError("no")

        registry, _ = credit_registry(poison)
        async with running(rabbit, pg, registry, max_deliveries=1) as pump:
            await publish(rabbit, [credit("d1", "a", "1"), credit("d2", "a", "1")])
            await wait_for(lambda: pump.stats["dead-letter"] == 2, 15, "two dead letters")
        admin = RabbitMQAdmin(rabbit, make_identity(rabbit))
        try:
            listings = [await admin.dead_letters(10) for _ in range(5)]
        finally:
            await admin.close()
        ids = [[letter.message_id for letter in listing] for listing in listings]
        assert sorted(ids[0], key=str) == ["d1", "d2"]  # both there (dead-lettered in either order)
        assert ids == [ids[0]] * 5  # every time, in the same order
    finally:
        await arabbitmqctl("clear_policy", "-p", rabbitmq_vhost, name)


async def test_a_dead_letter_reason_leaves_the_process_scrubbed(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings()

    async def leaks(ctx: Context) -> None:
        raise ValueError("cannot reach postgresql://ledger:S3cr3tPassw0rd@db.internal/ledger")

    registry, _ = credit_registry(leaks)
    async with running(rabbit, pg, registry, max_deliveries=1) as pump:
        await publish(rabbit, [credit("leak", "a", "1")])
        await wait_for(lambda: pump.stats["dead-letter"] == 1, 15, "the dead letter")
    (letter,) = await take_dead_letters(rabbit)
    reason = dead_letter_reason(letter)
    assert "S3cr3tPassw0rd" not in reason and "postgresql://ledger:***@db.internal" in reason
