"""A real relay process that dies between the broker's confirm and its mark.

``python -m tests.outbox.relay_process`` (settings from WORKER_* as for ``worker relay``)
claims and publishes one batch with confirms, prints ``confirmed <n>`` and then
waits, bounded, without marking anything: the test SIGKILLs it there.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from worker.brokers.publishers import open_publisher
from worker.db import create_engine
from worker.outbox.model import settings as outbox_settings
from worker.outbox.relay import Relay
from worker.settings import Settings, load


class DiesBeforeMarking(Relay):
    async def mark_sent(self, ids: Sequence[int]) -> None:
        print(f"confirmed {len(ids)}", flush=True)
        await asyncio.sleep(60)  # the SIGKILL lands here
        sys.exit(3)  # never reached in the test: it would mean nobody killed us


async def main() -> int:
    settings = load(Settings)
    engine = create_engine(settings.database_url, pool_size=2)
    relay_settings = outbox_settings()
    publisher = open_publisher(settings, timeout=relay_settings.publish_timeout)
    relay = DiesBeforeMarking(engine, publisher, relay_settings, name="doomed")
    result = await relay.run_once()
    print(f"nothing claimed: {result}", flush=True)
    return 4


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
