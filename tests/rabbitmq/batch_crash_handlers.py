"""``WORKER_HANDLERS=tests.rabbitmq.batch_crash_handlers``: the credit handler, unkeyed (so batch
mode batches it), and with ``WORKER_TEST_HOLD_ACKS=<seconds>`` every batch waits that long
between its commit and its acks: the window a SIGKILL is aimed at."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from handlers.credit import CreditRequested, apply_credit
from worker import handler
from worker.logs import get_logger

# its own type: importing handlers.credit registers the keyed CreditRequested handler too
handler("BatchCredit", CreditRequested, consumer="batch-credit")(apply_credit)

HOLD = os.environ.get("WORKER_TEST_HOLD_ACKS")
if HOLD:
    from worker.batch import BatchRunner

    settle = BatchRunner._settle

    async def held(self: BatchRunner, items: Any) -> None:
        get_logger().info("batch committed, acks held", size=len(items))
        await asyncio.sleep(float(HOLD))
        await settle(self, items)

    BatchRunner._settle = held  # type: ignore[method-assign]
