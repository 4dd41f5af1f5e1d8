"""``WORKER_HANDLERS=tests.rabbitmq.slow_handlers``: the real credit handler, slowly.

``SlowCredit`` messages take ``WORKER_TEST_HANDLER_SECONDS`` each, so a SIGTERM
lands while deliveries are in flight.
"""

from __future__ import annotations

import asyncio
import os

from handlers.credit import CreditRequested, apply_credit
from worker import Context, handler

SECONDS = float(os.environ.get("WORKER_TEST_HANDLER_SECONDS", "0.5"))


@handler("SlowCredit", CreditRequested, consumer="slow-credit")
async def slow_credit(ctx: Context, message: CreditRequested) -> None:
    await asyncio.sleep(SECONDS)
    await apply_credit(ctx, message)
