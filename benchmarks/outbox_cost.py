"""What one published event per message costs, and how fast the relay gets it out.

    python benchmarks/outbox_cost.py [--messages 2000] [--database-url URL] [--rabbitmq-url URL]

The same stream of credits (1,000 accounts, memory broker in, pump concurrency 16)
runs twice: ``apply_credit`` alone, and ``apply_credit`` plus one ``ctx.publish``
(an outbox row in the same transaction) with a relay running beside the pump.
Reported: messages per second until every credit committed (and, with the
outbox, every event was confirmed), their ratio, and the relay latency from the
handler's commit to the broker's confirmation (p50, p95). With ``--rate`` the
credits arrive at that pace (a worker below capacity: the latency a live system
sees); without it they are all queued at once (a saturated worker, whose relay
shares one event loop with 16 busy pump workers: the latency's worst case).

The events go to the memory broker, or with ``--rabbitmq-url`` to a throwaway
RabbitMQ queue with publisher confirms (deleted afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import event

from handlers.credit import CreditRequested, apply_credit
from tests.support.migrations import migrate_with_the_example
from worker import logs
from worker.brokers.memory import MemoryBroker, MemoryPublisher
from worker.brokers.publishers import Outgoing, Publisher
from worker.brokers.rabbitmq import RabbitMQPublisher, RabbitMQSettings
from worker.db import create_engine
from worker.outbox import model as outbox
from worker.outbox.relay import Relay
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings

ACCOUNTS = 1000  # few collisions: the cost of the row itself, not of hot-row retries


class Timed:
    """Wraps a publisher: the time each message's confirmation came back."""

    def __init__(self, inner: Publisher, expected: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.confirmed: dict[str, float] = {}
        self.expected = expected
        self.all_confirmed = asyncio.Event()

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        results = await self.inner.publish(messages)
        now = time.perf_counter()
        for message, result in zip(messages, results, strict=True):
            if result is None:
                self.confirmed.setdefault(message.message_id, now)
        if len(self.confirmed) >= self.expected:
            self.all_confirmed.set()
        return results

    async def close(self) -> None:
        await self.inner.close()


def registry(committed_at: dict[str, float] | None) -> Registry:
    handlers = Registry()

    @handlers.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit(ctx: Context, message: CreditRequested) -> None:
        await apply_credit(ctx, message)
        if committed_at is None:
            return
        event_id = await ctx.publish("CreditApplied", {"account_id": message.account_id})

        def stamp(_session: Any) -> None:
            committed_at[event_id] = time.perf_counter()

        event.listen(ctx.session.sync_session, "after_commit", stamp, once=True)

    return handlers


async def run(
    url: str, messages: int, publisher: Publisher | None, rate: float = 0.0
) -> dict[str, Any]:
    committed_at: dict[str, float] = {} if publisher is not None else None  # type: ignore[assignment]
    settings = Settings(database_url=url, concurrency=16, max_attempts=20, purge_interval=0)
    engine = create_engine(url, pool_size=20)
    broker = MemoryBroker()
    pump = Pump(broker.connect(), engine, registry(committed_at), settings, name="bench")
    timed = Timed(publisher, messages) if publisher is not None else None
    relay_settings = outbox.OutboxSettings(poll_interval=0.5, batch=200, purge_interval=0)
    relay = Relay(engine, timed, relay_settings) if timed is not None else None
    tasks = [asyncio.create_task(pump.run())]
    if relay is not None:
        tasks.append(asyncio.create_task(relay.run()))
    await pump.started.wait()
    started = time.perf_counter()
    for n in range(messages):
        body = {"account_id": f"acct-{n % ACCOUNTS}", "amount": "1.00"}
        broker.publish(f"m-{uuid.uuid4().hex}", "CreditRequested", body)
        if rate > 0:  # paced: the arrival rate of a worker below its capacity
            await asyncio.sleep(max(0.0, started + (n + 1) / rate - time.perf_counter()))
    await broker.wait_idle(timeout=600)
    if timed is not None:
        async with asyncio.timeout(120):
            await timed.all_confirmed.wait()
    seconds = time.perf_counter() - started
    pump.stop()
    if relay is not None:
        relay.stop()
    await asyncio.gather(*tasks)
    await engine.dispose()
    result: dict[str, Any] = {"seconds": seconds, "per_s": messages / seconds}
    if timed is not None:
        lags = sorted(timed.confirmed[i] - committed_at[i] for i in committed_at)
        result["p50_ms"] = statistics.median(lags) * 1000
        result["p95_ms"] = statistics.quantiles(lags, n=20)[-1] * 1000
    return result


async def rabbit_publisher(url: str) -> tuple[Publisher, Any]:
    import aio_pika

    queue = f"bench-outbox-{uuid.uuid4().hex[:8]}"
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
    outbox.configure(outbox.OutboxSettings(destination=f"/{queue}"))

    async def cleanup() -> None:  # a fresh connection: a long run may outlive a heartbeat
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel()
            await channel.queue_delete(queue)

    settings = RabbitMQSettings(url=url, queue=queue, exchange="")
    return RabbitMQPublisher(settings, timeout=10.0), cleanup


async def main(
    messages: int, database_url: str | None, rabbitmq_url: str | None, rate: float
) -> None:
    logs.configure("ERROR", "console")
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for label in ("without events", "one event each"):
            url = database_url or f"sqlite+aiosqlite:///{Path(tmp) / (label[:3] + '.db')}"
            await asyncio.to_thread(migrate_with_the_example, url)
            await _empty(url)
            publisher: Publisher | None = None
            cleanup = None
            if label != "without events":
                if rabbitmq_url:
                    publisher, cleanup = await rabbit_publisher(rabbitmq_url)
                else:
                    publisher = MemoryPublisher(MemoryBroker())
            try:
                rows.append((label, await run(url, messages, publisher, rate)))
            finally:
                if publisher is not None:
                    await publisher.close()
                if cleanup is not None:
                    await cleanup()
                outbox.configure(None)
    database = "PostgreSQL" if database_url else "SQLite"
    target = "RabbitMQ (confirms)" if rabbitmq_url else "memory broker"
    pace = f"arriving at {rate:g}/s" if rate > 0 else "all queued at once (saturated)"
    print(f"{messages} credits {pace}, {database}, events to the {target}")
    print(f"{'':18} {'msg/s':>8} {'seconds':>8} {'p50 ms':>8} {'p95 ms':>8}")
    for label, r in rows:
        p50, p95 = r.get("p50_ms"), r.get("p95_ms")
        latency = f"{p50:8.1f} {p95:8.1f}" if p50 is not None else f"{'-':>8} {'-':>8}"
        print(f"{label:18} {r['per_s']:8.0f} {r['seconds']:8.2f} {latency}")
    ratio = rows[1][1]["per_s"] / rows[0][1]["per_s"]
    print(f"throughput ratio (with / without): {ratio:.2f}")


async def _empty(url: str) -> None:
    from sqlalchemy import text

    engine = create_engine(url, pool_size=1)
    try:
        async with engine.begin() as connection:
            for table in ("outbox", "inbox", "accounts"):
                await connection.execute(text(f"DELETE FROM {table}"))
    finally:
        await engine.dispose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--rabbitmq-url", default=None)
    parser.add_argument("--rate", type=float, default=0.0, help="messages/s; 0: all at once")
    args = parser.parse_args()
    asyncio.run(main(args.messages, args.database_url, args.rabbitmq_url, args.rate))
