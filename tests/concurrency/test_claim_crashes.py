"""SIGKILL a real worker process between claim and call, and between call and mark.

The replica (claim_replica.py) runs a pump on its own memory broker; once it is
killed, this test plays the broker's redelivery: the same message to a pump of
its own, against the same database and the same mail server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.concurrency.concurrency_helpers import MailServer, inbox_rows
from tests.concurrency.test_side_effect_claims import BODY, claim_settings, mail_registry
from tests.support.processes import clean_env
from tests.support.pumps import MakeSettings, RunPumps
from worker.brokers.memory import MemoryBroker
from worker.db import create_engine

REPLICA = Path(__file__).with_name("claim_replica.py")
ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.slow


async def start_replica(cut: str, database_url: str, server: MailServer) -> Any:
    env = clean_env()
    env.update(
        {
            "WORKER_DATABASE_URL": database_url,
            "WORKER_MAIL_API_URL": server.url,
            # Longer than claim_settings' 0.6 s: a fresh process's first HTTP call (client setup,
            # first connection) can take longer than 0.4 s on a loaded machine, and would then
            # be cut and taken over inside the replica before the test's kill arrives.
            "WORKER_CLAIM_LEASE": "2.0",
            "WORKER_CLAIM_CALL_TIMEOUT": "1.5",
            "WORKER_PURGE_INTERVAL": "0",
            "WORKER_LOG_LEVEL": "WARNING",
            "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        }
    )
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPLICA),
        cut,
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )


@pytest.mark.parametrize("cut", ["before-call", "after-call"])
async def test_sigkill_between_phases(
    cut: str,
    database_url: str,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    mail_server: MailServer,
) -> None:
    replica = await start_replica(cut, database_url, mail_server)
    try:
        async with asyncio.timeout(30):
            assert replica.stdout is not None
            line = await replica.stdout.readline()
        assert line.strip() == b"REACHED"
    finally:
        if replica.returncode is None:
            os.kill(replica.pid, signal.SIGKILL)
        await replica.wait()
    assert replica.returncode == -signal.SIGKILL

    engine = create_engine(database_url)
    try:
        [claimed] = await inbox_rows(engine)
        assert (claimed.state, claimed.processed_at, claimed.attempts) == ("claimed", None, 1)
        assert mail_server.calls["welcome-1"] == (1 if cut == "after-call" else 0)

        broker = MemoryBroker()  # the broker's redelivery of the unsettled message
        # the survivor's own call gets room too; it waits for the dead replica's 2 s lease
        settings = claim_settings(make_settings, claim_lease=3, claim_call_timeout=2)
        async with run_pumps([broker.connect()], [engine], mail_registry(), settings) as [pump]:
            broker.publish("welcome-1", "SendWelcomeEmail", BODY)
            await broker.wait_idle(15)
        [row] = await inbox_rows(engine)
    finally:
        await engine.dispose()
    assert (row.state, row.outcome, row.attempts) == ("finished", "HTTP 202", 2)
    # At least once in total; once per key at the provider after its deduplication.
    assert mail_server.calls["welcome-1"] == (2 if cut == "after-call" else 1)
    assert list(mail_server.effects) == ["welcome-1"]
    assert pump.stats["committed"] == 1
    assert pump.stats["claim-held"] == 1  # the dead replica's lease had to run out first
