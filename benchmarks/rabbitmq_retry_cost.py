"""What a nack costs on RabbitMQ, per retry design (the numbers behind docs/rabbitmq.md).

    python benchmarks/rabbitmq_retry_cost.py [--messages 500] [--url amqp://...]

For each design, N messages are delivered, nacked once each by the adapter, and
acked on their second delivery. Reported: the time a nack takes (the pump waits
for it), nacks per second, and how long after the nack was sent the message came back.

- ``retry queue``: the adapter's default: publish a copy to a TTL queue (publisher
  confirm), ack the original; the TTL queue dead-letters back to the work queue.
- ``quorum requeue``: ``basic.nack(requeue=True)`` on the quorum queue; the
  delivery count still rises (``x-delivery-count``), but nothing waits.

Needs a RabbitMQ; declares uniquely named queues and deletes them afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Any

import aio_pika

from worker import logs
from worker.brokers import OutgoingMessage
from worker.brokers.rabbitmq import (
    RabbitMQAdmin,
    RabbitMQConsumer,
    RabbitMQSettings,
    declare_topology,
    delete_topology,
    make_identity,
)
from worker.delivery import Delivery


async def _declare(settings: RabbitMQSettings) -> None:
    connection = await aio_pika.connect(settings.url)
    try:
        await declare_topology(await connection.channel(), settings)
    finally:
        await connection.close()


async def measure(settings: RabbitMQSettings, messages: int) -> dict[str, Any]:
    await _declare(settings)  # `worker publish` declares nothing: a worker's start does
    admin = RabbitMQAdmin(settings, make_identity(settings))
    body = b'{"account_id": "a", "amount": "1"}'
    await admin.publish([OutgoingMessage(f"m{n}", "T", body) for n in range(messages)])
    await admin.close()
    broker = RabbitMQConsumer(settings, make_identity(settings))
    await broker.start(prefetch=32)
    nack_seconds: list[float] = []
    nacked_at: dict[str | None, float] = {}
    back_after: list[float] = []
    started = time.perf_counter()
    nack_phase = 0.0

    async def settle(delivery: Delivery) -> None:
        nonlocal nack_phase
        if delivery.delivery_count == 1:
            # noted before the nack returns: a requeued message may be back before it does
            before = nacked_at[delivery.message_id] = time.perf_counter()
            await delivery.nack()
            nack_seconds.append(time.perf_counter() - before)
            if len(nack_seconds) == messages:
                nack_phase = time.perf_counter() - started
        else:
            back_after.append(time.perf_counter() - nacked_at[delivery.message_id])
            await delivery.ack()

    pending: set[asyncio.Task[None]] = set()
    try:
        async with asyncio.timeout(120):
            for _ in range(2 * messages):  # every message twice: nacked, then acked
                delivery = await broker.receive()
                task = asyncio.create_task(settle(delivery))
                pending.add(task)
                task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
    finally:
        await broker.stop_receiving()
        await broker.close()
    return {
        "nack ms (median)": statistics.median(nack_seconds) * 1000,
        "nack ms (p95)": statistics.quantiles(nack_seconds, n=20)[-1] * 1000,
        "nacks/s": messages / nack_phase,
        "back after ms (median)": statistics.median(back_after) * 1000,
        "back after ms (max)": max(back_after) * 1000,
    }


async def cleanup(settings: RabbitMQSettings) -> None:
    connection = await aio_pika.connect(settings.url)
    async with connection:
        await delete_topology(await connection.channel(), settings)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--ttl", type=float, default=0.2, help="the retry queue's delay, seconds")
    args = parser.parse_args()
    logs.configure("WARNING")
    designs = {
        f"retry queue (TTL {args.ttl * 1000:.0f} ms)": [args.ttl],
        "quorum requeue (no delay)": [],
    }
    print(f"{args.messages} messages, each nacked once then acked\n")
    headers = ("nack ms p50/p95", "nacks/s", "back after ms p50/max")
    print(f"{'design':28}" + "".join(f"{h:>24}" for h in headers))
    for label, delays in designs.items():
        queue = f"bench-retry-{uuid.uuid4().hex[:6]}"
        settings = RabbitMQSettings(
            url=args.url, queue=queue, exchange=f"{queue}.in", retry_delays=delays
        )
        try:
            r = await measure(settings, args.messages)
        finally:
            await cleanup(settings)
        print(
            f"{label:28}{r['nack ms (median)']:>15.2f} / {r['nack ms (p95)']:<6.2f}"
            f"{r['nacks/s']:>24.0f}"
            f"{r['back after ms (median)']:>15.1f} / {r['back after ms (max)']:<6.1f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
