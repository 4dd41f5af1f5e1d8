"""A ``worker run`` process in batch mode SIGKILLed between its batches' commits and their acks:
the redeliveries, taken by a fresh worker, are all absorbed as duplicates (real RabbitMQ,
real PostgreSQL, real OS processes)."""

from __future__ import annotations

import signal
from decimal import Decimal
from pathlib import Path

import pytest

from tests.rabbitmq.rabbit_helpers import publish, rabbit_env, take_dead_letters
from tests.support.credits import credit
from tests.support.database import balances, marker_count, scalar
from tests.support.processes import WorkerProcess
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import RabbitMQSettings

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.slow]

UNIQUE, COPIES, ACCOUNTS = 48, 8, 6


async def test_a_kill_between_batch_commit_and_acks_leaves_only_duplicates(
    rabbit_settings: MakeRabbitSettings, pg: str, tmp_path: Path
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings()
    stream = [
        credit(f"k-{n}", f"acct-{n % ACCOUNTS}", "1.00", "BatchCredit") for n in range(UNIQUE)
    ]
    stream += stream[:COPIES]  # producer retries: second copies of the first eight
    await publish(rabbit, stream)
    env = rabbit_env(
        rabbit, pg, WORKER_HANDLERS="tests.rabbitmq.batch_crash_handlers",
        WORKER_CONCURRENCY="8", WORKER_BATCH_SIZE="16",
        WORKER_GRACE_PERIOD="5",
    )  # fmt: skip
    doomed = WorkerProcess({**env, "WORKER_TEST_HOLD_ACKS": "60"}, tmp_path / "doomed.log")
    fresh: WorkerProcess | None = None
    try:
        counts: list[int] = []

        async def settled_down() -> bool:  # every worker holds a committed batch's acks
            counts.append(await marker_count(pg))
            return counts[-1] > 0 and counts[-10:] == [counts[-1]] * 10

        await wait_for(settled_down, 40, "the batches to commit and hold their acks", step=0.1)
        committed = counts[-1]
        assert doomed.logged("batch committed, acks held")
        assert not doomed.events("pump stopped")
        doomed.signal(signal.SIGKILL)  # committed, not one ack sent
        doomed.wait(10)

        fresh = WorkerProcess(env, tmp_path / "fresh.log")

        async def drained() -> bool:
            return await marker_count(pg) == UNIQUE

        await wait_for(drained, 60, "every message", step=0.2)
        absorbed = fresh
        twice = len(stream) - (UNIQUE - committed)  # every delivery but the first runs
        await wait_for(lambda: len(absorbed.events("duplicate")) >= twice, 30, "the duplicates")
        fresh.signal(signal.SIGTERM)
        assert fresh.wait(30) == 0
        [stopped] = fresh.events("pump stopped")
        # what the killed worker committed ran once: the fresh one committed only the rest
        assert stopped.get("committed", 0) == UNIQUE - committed
        assert stopped["ack"] == len(stream)
    finally:
        doomed.kill()
        if fresh is not None:
            fresh.kill()
    assert await balances(pg) == {f"acct-{a}": Decimal(UNIQUE // ACCOUNTS) for a in range(ACCOUNTS)}
    assert await scalar(pg, "SELECT count(DISTINCT message_id) FROM inbox") == UNIQUE
    assert await take_dead_letters(rabbit) == []
