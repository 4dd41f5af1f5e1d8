"""What WORKER_KAFKA_ORDERING=key buys: records per second, partition vs key ordering.

    python -m tests.kafka.bench_ordering [--records 800] [--keys 64] [--handler-ms 10]

Starts its own Tansu on a loopback port (stopped by PID), produces ``--records``
keyed records to topics of 1 and of 8 partitions, and drains each with one
consumer-group member and 16 concurrent loops (the pump's shape, concurrency 16)
whose handler awaits ``--handler-ms`` (an I/O-bound handler) and acks.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from tests.kafka.kafka_helpers import create_topic, produce, settings_for, unique
from tests.support.tansu import running_tansu
from worker.brokers.kafka import KafkaConsumer
from worker.settings import Settings

CONCURRENCY = 16


async def drain(bootstrap: str, topic: str, ordering: str, total: int, handler_s: float) -> float:
    kafka = settings_for(bootstrap, topic, ordering=ordering, commit_interval=0.2)
    broker = KafkaConsumer(Settings(delivery_counts="broker"), kafka)
    await broker.start(prefetch=CONCURRENCY)
    done = 0
    finished = asyncio.Event()
    began = 0.0

    async def loop() -> None:
        nonlocal done, began
        while True:
            delivery = await broker.receive()
            began = began or time.monotonic()
            await asyncio.sleep(handler_s)
            await delivery.ack()
            done += 1
            if done == total:
                finished.set()

    tasks = [asyncio.create_task(loop()) for _ in range(CONCURRENCY)]
    try:
        await asyncio.wait_for(finished.wait(), 300)
        return total / (time.monotonic() - began)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await broker.stop_receiving()
        await broker.close()


async def main(records: int, keys: int, handler_ms: float) -> None:
    with running_tansu() as tansu:
        bootstrap = tansu.bootstrap
        print(f"{records} records, {keys} keys, handler {handler_ms} ms, concurrency {CONCURRENCY}")
        for partitions in (1, 8):
            for ordering in ("partition", "key"):
                topic = unique("bench")
                await create_topic(bootstrap, topic, partitions)
                batch = [
                    (f"k{n % keys}".encode(), b"{}", {"message-id": f"m{n}"}, n % partitions)
                    for n in range(records)
                ]
                await produce(bootstrap, topic, batch)
                rate = await drain(bootstrap, topic, ordering, records, handler_ms / 1000)
                print(f"partitions={partitions} ordering={ordering:9} {rate:8.0f} records/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=800)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--handler-ms", type=float, default=10.0)
    args = parser.parse_args()
    asyncio.run(main(args.records, args.keys, args.handler_ms))
