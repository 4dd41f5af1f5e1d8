"""A ``worker run`` process in batch mode SIGKILLed between its batches' commits and their acks:
the redeliveries, taken by a fresh worker, are all absorbed as duplicates (real RabbitMQ,
real PostgreSQL, real OS processes)."""

from __future__ import annotations

import signal
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.rabbitmq.rabbit_helpers import credit, publish, rabbit_env, take_dead_letters
from tests.support.database import balances, scalar
from tests.support.processes import WorkerProcess
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import RabbitMQSettings

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.slow]

UNIQUE, COPIES, ACCOUNTS = 48, 8, 6


async def test_a_kill_between_batch_commit_and_acks_leaves_only_duplicates(
    rabbit_settings: Any, pg: str, tmp_path: Path
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings()
    stream = [
        credit(f"k-{n}", f"acct-{n % ACCOUNTS}", "1.00", "BatchCredit") for n in range(UNIQUE)
    ]
    stream += stream[:COPIES]  # producer retries: second copies of the first eight
    await publish(rabbit, stream)
    env = rabbit_env(
        rabbit, pg, WORKER_HANDLERS="tests.rabbitmq.batch_crash_handlers",
        WORKER_CONCURRENCY="4", WORKER_BATCH_SIZE="16", WORKER_BATCH_WAIT="0.2",
        WORKER_GRACE_PERIOD="5",
    )  # fmt: skip
    doomed = WorkerProcess({**env, "WORKER_TEST_HOLD_ACKS": "60"}, tmp_path / "doomed.log")
    fresh: WorkerProcess | None = None
    try:
        await wait_for(
            lambda: scalar(pg, "SELECT count(*) FROM inbox"), 30, "the first commits", step=0.1
        )

        async def all_committed() -> bool:
            return await scalar(pg, "SELECT count(*) FROM inbox") == UNIQUE

        await wait_for(all_committed, 30, "every batch committed", step=0.1)
        assert doomed.logged("batch committed, acks held")
        assert not doomed.events("pump stopped")
        doomed.signal(signal.SIGKILL)  # committed, not one ack sent
        doomed.wait(10)

        fresh = WorkerProcess(env, tmp_path / "fresh.log")
        absorbed = fresh
        await wait_for(
            lambda: len(absorbed.events("duplicate")) >= len(stream), 60, "every redelivery"
        )
        fresh.signal(signal.SIGTERM)
        assert fresh.wait(30) == 0
        [stopped] = fresh.events("pump stopped")
        assert stopped.get("committed", 0) == 0  # nothing ran twice
        assert stopped["ack"] == len(stream)
    finally:
        doomed.kill()
        if fresh is not None:
            fresh.kill()
    assert await balances(pg) == {f"acct-{a}": Decimal(UNIQUE // ACCOUNTS) for a in range(ACCOUNTS)}
    assert await scalar(pg, "SELECT count(DISTINCT message_id) FROM inbox") == UNIQUE
    assert await take_dead_letters(rabbit) == []
