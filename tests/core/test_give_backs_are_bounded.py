"""Every give-back that spends no count is bounded: a message that always takes one ends
in the dead-letter queue (DESIGN: "every give-back is bounded").

Uncounted for ``WORKER_MAX_GIVE_BACKS`` give-backs, each delayed a little longer, then
counted, so ``WORKER_MAX_DELIVERIES`` ends it. Here the path is "schema behind the code"
(a table no migration created, for a consumer that never committed), which nothing
else in the suite drives to its bound. The adapters carry the give-backs across
redeliveries: the memory broker on the message, RabbitMQ on its confirmed copy
(tests/rabbitmq/test_rabbitmq_give_backs.py), Service Bus and Kafka in their own tests.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from handlers.credit import CreditRequested
from tests.support.credits import credit_body
from tests.support.pumps import MakeSettings, RunPumps
from worker.brokers.memory import MemoryBroker
from worker.context import Context
from worker.registry import Registry


def audit_registry() -> Registry:
    registry = Registry()

    @registry.handler("Audit", CreditRequested, consumer="audit")
    async def audit(ctx: Context, message: CreditRequested) -> None:
        await ctx.session.execute(text("INSERT INTO audit_never_migrated VALUES (1)"))

    return registry


async def test_a_message_that_always_gives_back_uncounted_still_ends_dead_lettered(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    broker = MemoryBroker()
    settings = make_settings(max_give_backs=2, max_deliveries=2)
    async with run_pumps([broker.connect()], [engine], audit_registry(), settings) as [pump]:
        broker.publish("m1", "Audit", credit_body("a", "1"))
        await broker.wait_idle(timeout=30)
    # two give-backs uncounted (count 1 stays 1), then counted until past the limit
    assert [(verb, count) for verb, mid, count in broker.history if mid == "m1"] == [
        ("nack", 1),
        ("nack", 1),
        ("nack", 1),
        ("nack", 2),
        ("dead-letter", 3),
    ]
    (letter,) = broker.dead_letters
    assert "delivered 3 times" in letter.reason
    assert pump.stats["give-backs-bounded"] == 2
