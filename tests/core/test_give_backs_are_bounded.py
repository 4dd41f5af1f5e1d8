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

import pytest
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
    assert_given_back_twice_then_counted_out(broker)
    assert pump.stats["give-backs-bounded"] == 2


def conflict_registry() -> Registry:
    """A handler whose every transaction loses: a real serialization failure (40001)."""
    registry = Registry()

    @registry.handler("Conflict", CreditRequested, consumer="conflict")
    async def conflict(ctx: Context, message: CreditRequested) -> None:
        await ctx.session.execute(
            text(
                "DO $$ BEGIN RAISE EXCEPTION 'always loses' "
                "USING ERRCODE = 'serialization_failure'; END $$"
            )
        )

    return registry


async def test_contention_that_never_ends_is_bounded_too(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """Contention is never the message's fault, so a spent retry budget gives the message
    back uncounted; a message that always loses must still end, by the same bound."""
    if engine.dialect.name != "postgresql":
        pytest.skip("raises SQLSTATE 40001 from PL/pgSQL; SQLite's contention is its lock")
    broker = MemoryBroker()
    settings = make_settings(max_give_backs=2, max_deliveries=2, retry_budget=0.2)
    async with run_pumps([broker.connect()], [engine], conflict_registry(), settings) as [pump]:
        broker.publish("m1", "Conflict", credit_body("a", "1"))
        await broker.wait_idle(timeout=60)
    assert_given_back_twice_then_counted_out(broker)
    assert pump.stats["retrying"] > 0  # each delivery spent its retry budget first
    assert pump.stats["give-backs-bounded"] == 2


def assert_given_back_twice_then_counted_out(broker: MemoryBroker) -> None:
    """With ``max_give_backs=2, max_deliveries=2``: two give-backs uncounted (count 1 stays
    1), then counted until past the limit, and dead-lettered for that."""
    assert [(verb, count) for verb, mid, count in broker.history if mid == "m1"] == [
        ("nack", 1),
        ("nack", 1),
        ("nack", 1),
        ("nack", 2),
        ("dead-letter", 3),
    ]
    (letter,) = broker.dead_letters
    assert "delivered 3 times" in letter.reason
