"""A real worker process for the SIGKILL tests: one pump, one SendWelcomeEmail message.

``python claim_replica.py before-call|after-call`` (settings from WORKER_*): the
handler prints ``REACHED`` at that point and waits there until it is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

from handlers.notify import SendWelcomeEmail, send_welcome_email
from worker import logs
from worker.brokers.memory import MemoryBroker
from worker.claims import ClaimContext, side_effect
from worker.db import create_engine
from worker.pump import Pump
from worker.registry import Registry
from worker.settings import Settings, load


async def main(cut: str) -> None:
    settings = load(Settings)
    logs.configure(settings.log_level, "json")  # logs to stderr; stdout is the signal
    registry = Registry()

    async def reached(where: str) -> None:
        if where == cut:
            print("REACHED", flush=True)
            # Until SIGKILL (60 s at most). The claim cuts the call before its lease ends;
            # waiting on through that cut keeps this replica from moving on (nack, then a
            # takeover of its own) in the moment before the test's kill arrives.
            until = time.monotonic() + 60
            while time.monotonic() < until:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(until - time.monotonic())

    @side_effect("SendWelcomeEmail", SendWelcomeEmail, consumer="welcome-email", registry=registry)
    async def send(ctx: ClaimContext, message: SendWelcomeEmail) -> str | None:
        await reached("before-call")
        outcome = await send_welcome_email(ctx, message)
        await reached("after-call")
        return outcome

    broker = MemoryBroker()
    engine = create_engine(settings.database_url)
    pump = Pump(broker.connect(), engine, registry, settings, name="doomed")
    broker.publish("welcome-1", "SendWelcomeEmail", {"user_id": "u1", "email": "u1@example.com"})
    await pump.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
