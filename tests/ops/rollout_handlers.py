"""Test-only handlers for a real ``worker run`` (WORKER_HANDLERS=tests.ops.rollout_handlers).

``Slow`` sleeps for ``seconds`` inside the pump's transaction: the delivery is in
flight for that long, and its inbox marker commits only at the end. With
``ROLLOUT_MEMORY_MESSAGES=N`` set, the memory broker of ``worker run`` starts
with N such messages queued (the memory broker lives inside one process, so the
test cannot publish to it from outside).
"""

from __future__ import annotations

import asyncio
import os

from pydantic import BaseModel

import worker.brokers.memory as memory
from worker import Context, handler
from worker.settings import Settings


class Slow(BaseModel):
    seconds: float


@handler("Slow", Slow, consumer="slow")
async def slow(ctx: Context, message: Slow) -> None:
    await asyncio.sleep(message.seconds)


def _prefilled(settings: Settings) -> memory.MemoryConsumer:
    broker = memory.MemoryBroker.from_settings(settings)
    seconds = float(os.environ.get("ROLLOUT_SECONDS", "1.0"))
    for n in range(int(os.environ["ROLLOUT_MEMORY_MESSAGES"])):
        broker.publish(f"slow-{n:03d}", "Slow", {"seconds": seconds})
    return broker.connect()


if os.environ.get("ROLLOUT_MEMORY_MESSAGES"):
    memory.open_broker = _prefilled  # worker.brokers looks it up at call time
