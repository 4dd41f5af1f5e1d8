"""A message that kills the process takes only itself to the dead-letter queue.

One ``worker run`` (concurrency 16, WORKER_MAX_DELIVERIES=5) on a quorum queue and
PostgreSQL, restarted each time it dies as a cluster would restart it, over a few hundred
valid credits and one (or two) whose handler ends the process at once. Every return of
the deliveries a dead process held is counted by RabbitMQ; the worker counts starts
instead, and runs a delivery that came back again after a counted start alone, so:

- the killer is dead-lettered after exactly WORKER_MAX_DELIVERIES deaths;
- every valid credit is applied exactly once, and none is dead-lettered.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

import pytest

from tests.rabbitmq.rabbit_helpers import publish, rabbit_env, take_dead_letters, unsettled
from tests.support.credits import credit
from tests.support.database import balances, scalar
from tests.support.processes import Fleet
from tests.support.rabbitmq import MakeRabbitSettings

pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.timeout(400),
]

VALID = 300
MAX_DELIVERIES = 5


@pytest.mark.parametrize(
    ("batch_size", "killers", "max_deliveries"),
    [
        (1, ["kill-1"], MAX_DELIVERIES),
        (32, ["kill-1"], MAX_DELIVERIES),
        (1, ["kill-1", "kill-2"], MAX_DELIVERIES),
        (32, ["kill-1", "kill-2"], MAX_DELIVERIES),
        # a bystander spends one count, for the one death it ran beside: at a limit of 2 a
        # second death beside the killer would dead-letter it
        (1, ["kill-1"], 2),
        (32, ["kill-1"], 2),
    ],
    ids=[
        "per-message",
        "batch",
        "per-message-two-killers",
        "batch-two-killers",
        "per-message-limit-2",
        "batch-limit-2",
    ],
)
async def test_a_killer_is_dead_lettered_alone_after_max_deliveries_deaths(
    rabbit_settings: MakeRabbitSettings,
    rabbitmq_vhost: str,
    pg: str,
    tmp_path: Path,
    batch_size: int,
    killers: list[str],
    max_deliveries: int,
) -> None:
    rabbit = rabbit_settings(retry_delays=[0.2, 1.0], queue_type="quorum")
    deaths_file = tmp_path / "deaths"
    env = rabbit_env(
        rabbit, pg, WORKER_HANDLERS="tests.support.killer_handlers",
        WORKER_CONCURRENCY="16", WORKER_MAX_DELIVERIES=str(max_deliveries),
        WORKER_BATCH_SIZE=str(batch_size), WORKER_GRACE_PERIOD="5",
        WORKER_TEST_KILLERS=",".join(killers), WORKER_TEST_DEATHS=str(deaths_file),
    )  # fmt: skip
    stream = [credit(f"ok-{n:03d}", f"acct-{n % 10}", "1.00", "Credit") for n in range(VALID)]
    for index, killer in enumerate(killers):  # among the valid ones, not at the ends
        stream.insert((index + 1) * VALID // (len(killers) + 1), credit(killer, "x", "1", "Credit"))
    await publish(rabbit, stream)
    fleet = Fleet(env, tmp_path)
    restarts = 0
    try:
        fleet.start("w")
        deadline = time.monotonic() + 300
        while True:
            applied = await scalar(pg, "SELECT count(*) FROM inbox WHERE message_id LIKE 'ok-%'")
            if applied == VALID and not unsettled(rabbitmq_vhost, rabbit):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{applied}/{VALID} applied after {restarts} restarts")
            if fleet.live["w"].process.poll() is not None:
                restarts += 1
                fleet.restart_exited()
            await asyncio.sleep(0.2)
        await fleet.stop()
    finally:
        fleet.kill_all()
    letters = await take_dead_letters(rabbit)
    dead = sorted(str(letter.message_id) for letter in letters)
    deaths = Counter(line.split()[0] for line in deaths_file.read_text().splitlines())
    report = {"deaths": dict(deaths), "restarts": restarts, "dead letters": dead}
    print(f"\nkiller ({batch_size=}, {killers=}): {report}")
    assert dead == sorted(killers), report  # 0 valid messages dead-lettered
    assert await balances(pg) == {f"acct-{n}": Decimal(VALID // 10) for n in range(10)}
    if batch_size == 1 or len(killers) == 1:  # each killer: exactly WORKER_MAX_DELIVERIES
        assert deaths == dict.fromkeys(killers, max_deliveries), report
    else:  # a batch is one unit of work: a killer in the batch another killer took down
        # spent that count as its bystander, and goes one death earlier
        assert all(max_deliveries - 1 <= deaths[k] <= max_deliveries for k in killers), report
    assert restarts <= sum(deaths.values()), report
    if len(killers) == 1:
        assert restarts == max_deliveries, report
