"""The outbox through real RabbitMQ: confirms, returns, a relay killed before its mark."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from pydantic import BaseModel

from tests.outbox.outbox_helpers import fast_outbox, outbox_rows
from tests.rabbitmq.rabbit_helpers import credit_registry, depths, publish, rabbit_env, running
from tests.support.database import balances, marker_count, scalar
from tests.support.processes import REPO, run_cli
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.waiting import wait_for
from worker.brokers import OutgoingMessage
from worker.brokers.rabbitmq import RabbitMQPublisher, RabbitMQSettings
from worker.db import create_engine
from worker.outbox.publish import outgoing_id
from worker.outbox.relay import Relay
from worker.registry import Context, Registry

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.slow]


class Order(BaseModel):
    account_id: str
    amount: str


def ordering_registry() -> Registry:
    """Queue A's handler: every order publishes one credit for queue B."""
    registry = Registry()

    @registry.handler("Order", Order, consumer="orders")
    async def order(ctx: Context, message: Order) -> None:
        body = {"account_id": message.account_id, "amount": message.amount}
        await ctx.publish("CreditRequested", body, key=message.account_id)

    return registry


def queue_b(rabbit_settings: MakeRabbitSettings) -> RabbitMQSettings:
    settings: RabbitMQSettings = rabbit_settings()
    name = f"{settings.queue}-b"
    return rabbit_settings(queue=name, exchange=f"{name}.in")


async def test_a_to_b_end_to_end_with_publisher_confirms(
    rabbit_settings: MakeRabbitSettings, postgres_only_url: str
) -> None:
    a, b = rabbit_settings(), queue_b(rabbit_settings)
    engine = create_engine(postgres_only_url, pool_size=4)
    publisher = RabbitMQPublisher(b, timeout=5.0)
    relay = Relay(engine, publisher, fast_outbox())
    registry_b, seen_b = credit_registry()
    orders = [
        OutgoingMessage(
            f"order-{n}", "Order", json.dumps({"account_id": "acct", "amount": "1"}).encode()
        )
        for n in range(50)
    ]
    relay_task = asyncio.create_task(relay.run())
    try:
        async with (
            running(b, postgres_only_url, registry_b) as pump_b,
            running(a, postgres_only_url, ordering_registry()) as pump_a,
        ):
            await publish(a, orders + orders[:10])  # ten producer retries
            await wait_for(lambda: pump_b.stats["committed"] >= 50, 60, "B to apply 50 credits")
            await asyncio.sleep(0.5)
        assert pump_a.stats["committed"] == 50
        assert pump_b.stats["committed"] == 50 and pump_b.stats["duplicate"] == 0
    finally:
        relay.stop()
        await relay_task
        await publisher.close()
        await engine.dispose()
    assert (await balances(postgres_only_url))["acct"] == Decimal(50)
    assert relay.stats["published"] == 50
    rows = await outbox_rows_by_url(postgres_only_url)
    assert rows == {"sent": 50}
    assert len(seen_b) >= 50  # handler calls: conflict re-runs on the one account count too


async def outbox_rows_by_url(url: str) -> dict[str, int]:
    engine = create_engine(url, pool_size=1)
    try:
        return dict(Counter(r.state for r in await outbox_rows(engine)))
    finally:
        await engine.dispose()


async def test_unroutable_and_missing_exchange_park_then_retry_after_the_fix(
    rabbit_settings: MakeRabbitSettings, postgres_only_url: str
) -> None:
    b = queue_b(rabbit_settings).model_copy(update={"binding_keys": ["CreditRequested"]})
    engine = create_engine(postgres_only_url, pool_size=4)
    publisher = RabbitMQPublisher(b, timeout=5.0)
    relay = Relay(engine, publisher, fast_outbox(max_attempts=2))
    registry = Registry()

    @registry.handler("Order", Order, consumer="orders")
    async def order(ctx: Context, message: Order) -> None:
        await ctx.publish("Unbound", {"n": 1})  # no binding for this routing key
        await ctx.publish(
            "CreditRequested",
            {"account_id": "x", "amount": "1"},
            destination="no-such-exchange/CreditRequested",
        )
        await ctx.publish("CreditRequested", {"account_id": "ok", "amount": "1"})

    registry_b, _ = credit_registry()
    a = rabbit_settings()
    try:
        async with running(b, postgres_only_url, registry_b) as pump_b:
            async with running(a, postgres_only_url, registry):
                await publish(
                    a, [OutgoingMessage("o-1", "Order", b'{"account_id":"a","amount":"1"}')]
                )
                await wait_for(
                    lambda: scalar(postgres_only_url, "SELECT count(*) FROM outbox"), 20, "rows"
                )
            for _ in range(4):
                await relay.drain()
            states = await fetch_states(postgres_only_url)
            assert states[outgoing_id("o-1", "orders", 0)][:2] == ("parked", 2)
            assert "unroutable" in states[outgoing_id("o-1", "orders", 0)][2]
            assert states[outgoing_id("o-1", "orders", 1)][:2] == ("parked", 2)
            assert "no-such-exchange" in states[outgoing_id("o-1", "orders", 1)][2]
            assert states[outgoing_id("o-1", "orders", 2)][0] == "sent"
            await wait_for(lambda: pump_b.stats["committed"] == 1, 20, "the routable one")

            # the fix: bind the missing routing key, declare the missing exchange
            connection = await aio_pika.connect(b.url)
            try:
                channel = await connection.channel()
                queue = await channel.declare_queue(b.queue, passive=True)
                await queue.bind(b.exchange, routing_key="Unbound")
                extra = await channel.declare_exchange(
                    "no-such-exchange", aio_pika.ExchangeType.TOPIC, durable=True
                )
                await queue.bind(extra, routing_key="#")
            finally:
                await connection.close()
            env = rabbit_env(b, postgres_only_url, WORKER_LOG_LEVEL="ERROR")
            retried = await asyncio.to_thread(run_cli, env, "outbox", "--retry")
            assert retried.returncode == 0, retried.stderr
            assert "re-queued 2 parked" in retried.stderr
            assert await relay.drain() == 2
            await wait_for(lambda: pump_b.stats["committed"] == 2, 20, "the fixed credit")
    finally:
        await publisher.close()
        await engine.dispose()
        connection = await aio_pika.connect(b.url)
        async with connection:
            channel = await connection.channel()
            await channel.exchange_delete("no-such-exchange")


async def fetch_states(url: str) -> dict[str, tuple[str, int, str]]:
    engine = create_engine(url, pool_size=1)
    try:
        return {
            r.message_id: (r.state, r.attempts, r.last_error or "")
            for r in await outbox_rows(engine)
        }
    finally:
        await engine.dispose()


async def test_a_relay_killed_between_confirm_and_mark_republishes_the_same_ids(
    rabbit_settings: MakeRabbitSettings, postgres_only_url: str, tmp_path: Path
) -> None:
    """SIGKILL after the confirms: the rows go out again, and B's inbox applies each once."""
    a, b = rabbit_settings(), queue_b(rabbit_settings)
    registry_b, _ = credit_registry()
    orders = [
        OutgoingMessage(
            f"k-{n}", "Order", json.dumps({"account_id": "acct", "amount": "1"}).encode()
        )
        for n in range(20)
    ]
    async with running(a, postgres_only_url, ordering_registry()) as pump_a:
        await publish(a, orders)
        await wait_for(lambda: pump_a.stats["committed"] == 20, 30, "A to commit 20 orders")
    async with running(b, postgres_only_url, registry_b) as pump_b:
        env = rabbit_env(
            b, postgres_only_url, WORKER_OUTBOX_LEASE="3", WORKER_OUTBOX_PUBLISH_TIMEOUT="2"
        )
        doomed = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.outbox.relay_process",
            env=env,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            assert doomed.stdout is not None
            line = (await asyncio.wait_for(doomed.stdout.readline(), 30)).decode()
            assert line.strip() == "confirmed 20", line
            doomed.kill()  # SIGKILL, this process only: between the confirm and the mark
            assert await asyncio.wait_for(doomed.wait(), 10) == -9
        finally:
            if doomed.returncode is None:
                doomed.kill()
                await asyncio.wait_for(doomed.wait(), 10)
        await wait_for(lambda: pump_b.stats["committed"] == 20, 30, "B to apply the first copies")
        states = await fetch_states(postgres_only_url)
        assert {s[0] for s in states.values()} == {"pending"}  # never marked

        engine = create_engine(postgres_only_url, pool_size=2)
        publisher = RabbitMQPublisher(b, timeout=5.0)
        relay = Relay(engine, publisher, fast_outbox(lease=3.0, publish_timeout=2.0))
        try:
            assert await relay.drain() == 0  # still leased by the dead relay
            await asyncio.sleep(3.2)
            assert await relay.drain() == 20  # the lease ran out: sent again, same ids
        finally:
            await publisher.close()
            await engine.dispose()
        await wait_for(lambda: pump_b.stats["duplicate"] == 20, 30, "B to absorb 20 copies")
    assert (await balances(postgres_only_url))["acct"] == Decimal(20)
    assert await marker_count(postgres_only_url, "consumer = 'credit'") == 20
    assert {s[0] for s in (await fetch_states(postgres_only_url)).values()} == {"sent"}


async def test_worker_relay_once_and_as_a_service(
    rabbit_settings: MakeRabbitSettings, postgres_only_url: str, tmp_path: Path
) -> None:
    """``worker relay --once`` drains and exits; ``worker relay`` runs until SIGTERM."""
    from tests.outbox.outbox_helpers import publish_rows
    from tests.rabbitmq.rabbit_helpers import make_broker
    from tests.support.processes import worker_cli

    b = queue_b(rabbit_settings)
    broker = make_broker(b)  # declares B's queue and binding, consumes nothing
    await broker.start(prefetch=1)
    await broker.stop_receiving()
    await broker.close()
    engine = create_engine(postgres_only_url, pool_size=2)
    body = {"account_id": "a", "amount": "1"}
    try:
        await publish_rows(engine, "first", [("CreditRequested", body, None, None)] * 5)
        env = rabbit_env(b, postgres_only_url, WORKER_LOG_LEVEL="ERROR")
        once = await asyncio.to_thread(run_cli, env, "relay", "--once")
        assert once.returncode == 0, once.stderr
        assert "published 5 outbox rows" in once.stderr
        assert (await depths(b, b.queue))[b.queue] == 5

        log = (tmp_path / "relay.log").open("wb")
        service = await asyncio.create_subprocess_exec(
            *worker_cli("relay"), env={**env, "WORKER_LOG_LEVEL": "INFO"}, cwd=REPO,
            stdout=log, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:

            def log_text() -> str:
                return (tmp_path / "relay.log").read_text()

            await wait_for(lambda: "outbox relay started" in log_text(), 30, "the relay")
            await publish_rows(engine, "second", [("CreditRequested", body, None, None)] * 3)
            await wait_for(_depth_is(b, 8), 30, "the service to publish 3 more")
            service.send_signal(2)  # SIGINT, this process only
            assert await asyncio.wait_for(service.wait(), 30) == 0
        finally:
            if service.returncode is None:
                service.kill()
                await asyncio.wait_for(service.wait(), 10)
            log.close()
    finally:
        await engine.dispose()


def _depth_is(settings: RabbitMQSettings, expected: int) -> Any:
    async def check() -> bool:
        return (await depths(settings, settings.queue))[settings.queue] == expected

    return check
