"""Three real workers in batch mode, hot accounts, duplicates inside and across batches and
processes, a SIGKILL every 1-3 s (and at three random points of the stream): every balance
exact, one marker per message, nothing left in any queue, nothing dead-lettered. Both handler
shapes: the reference ORM handler (a savepoint each, hot rows sent around) and a set-based
batch handler. The broker and the database stay up (the restarts are the serial chaos test's)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from decimal import Decimal
from pathlib import Path

import pytest

from tests.rabbitmq.rabbit_helpers import (
    all_depths,
    publish,
    rabbit_env,
    take_dead_letters,
    unsettled,
)
from tests.support.credits import credit
from tests.support.database import balances, marker_count, scalar
from tests.support.processes import Fleet, KillSchedule
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.waiting import wait_for
from worker.brokers import OutgoingMessage
from worker.brokers.rabbitmq import RabbitMQSettings

pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.timeout(300),
]

HOT, UNIQUE, TWICE = 5, int(os.environ.get("WORKER_TEST_BATCH_CHAOS_MESSAGES", "1200")), 0.3
WORKERS = "abc"


def stream(seed: int) -> tuple[list[OutgoingMessage], dict[str, Decimal]]:
    """Half the credits through each handler shape, 30 % of all messages sent twice."""
    rng = random.Random(seed)
    messages: list[OutgoingMessage] = []
    expected: dict[str, Decimal] = {}
    for n in range(UNIQUE):
        shape = "BatchCredit" if n % 2 else "BatchUpsert"
        account = f"{shape}-{n % HOT}"
        amount = Decimal(rng.randint(1, 10_000)) / 100
        messages.append(credit(f"b{n:05d}", account, amount, shape))
        expected[account] = expected.get(account, Decimal(0)) + amount
    for copy in rng.sample(list(messages), int(UNIQUE * TWICE)):
        messages.insert(rng.randrange(len(messages) + 1), copy)  # some racing the original
    return messages, expected


async def test_batch_mode_under_kills_and_duplicates_comes_out_exact(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str, pg: str, tmp_path: Path
) -> None:
    seed = int(os.environ.get("WORKER_TEST_SEED", random.randrange(1 << 16)))
    rng = random.Random(seed)
    rabbit: RabbitMQSettings = rabbit_settings(retry_delays=[0.5, 1.0], reconnect_interval=0.5)
    messages, expected = stream(seed)
    env = rabbit_env(
        rabbit, pg, WORKER_HANDLERS="tests.rabbitmq.batch_crash_handlers",
        WORKER_CONCURRENCY="4", WORKER_BATCH_SIZE="16",
        WORKER_DB_POOL_SIZE="8", WORKER_DB_MAX_OVERFLOW="0", WORKER_GRACE_PERIOD="5",
        WORKER_MAX_DELIVERIES="20",
    )  # fmt: skip
    # A SIGKILL returns every delivery the process held (up to (4 + 1) x 16 here) and the
    # broker counts each return: under load a message held through five kills was
    # dead-lettered as exhausted, as a message that crashes its worker must be. These
    # kills are the test's, not the messages': the bound is raised, not the assertion.
    fleet = Fleet(env, tmp_path)
    started = time.monotonic()

    async def done() -> int:
        return await marker_count(pg)

    try:
        for slot in WORKERS:
            fleet.start(slot)
        await wait_for(fleet.all_started, 60, "3 workers")
        publishing = asyncio.create_task(publish(rabbit, messages))
        schedule = KillSchedule(rng, UNIQUE, step=16)  # by the clock: a batch of progress
        while True:
            count = await done()
            if (
                count >= UNIQUE
                and publishing.done()
                and await asyncio.to_thread(unsettled, rabbitmq_vhost, rabbit) == 0
            ):
                break
            await schedule.tick(fleet, count)
            if time.monotonic() - started > 240:
                pytest.fail(f"seed {seed}: not drained in time ({count}/{UNIQUE}), {fleet.events}")
            await asyncio.sleep(0.1)
        publishing.result()
        await fleet.stop()
    finally:
        fleet.kill_all()

    kills = sum(event.startswith("kill") for event in fleet.events)
    assert await balances(pg) == expected, f"seed {seed}, {fleet.events}"
    assert await marker_count(pg) == UNIQUE
    assert await scalar(pg, "SELECT count(DISTINCT message_id) FROM inbox") == UNIQUE
    assert set((await all_depths(rabbit)).values()) == {0}
    assert await take_dead_letters(rabbit) == [], f"seed {seed}: a valid message dead-lettered"
    assert kills >= 3, f"seed {seed}: too few kills to prove anything: {fleet.events}"
