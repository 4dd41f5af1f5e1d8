"""RabbitMQ carries a message's uncounted give-backs on its confirmed copy
(``x-worker-give-backs``), so their bound holds across redeliveries: a message that always
gives back uncounted still ends in the dead-letter queue. Without it every redelivery
started again at zero give-backs and such a message looped for ever, uncounted."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from handlers.credit import CreditRequested
from tests.rabbitmq.rabbit_helpers import dead_letter_reason, publish, running, take_dead_letters
from tests.support.credits import credit
from tests.support.rabbitmq import MakeRabbitSettings
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import DELIVERIES_HEADER
from worker.context import Context
from worker.registry import Registry

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


async def test_a_message_that_always_gives_back_uncounted_ends_dead_lettered(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    registry, seen = Registry(), []

    @registry.handler("Audit", CreditRequested, consumer="audit")
    async def audit(ctx: Context, message: CreditRequested) -> None:
        seen.append((ctx.delivery_count, ctx.headers.get("x-worker-give-backs", 0)))
        await ctx.session.execute(text("INSERT INTO audit_never_migrated VALUES (1)"))

    rabbit = rabbit_settings(retry_delays=[0.2, 0.5])
    async with running(rabbit, pg, registry, max_give_backs=2, max_deliveries=2) as pump:
        await publish(rabbit, [credit("m1", "a", "1", type="Audit")])
        await wait_for(lambda: pump.stats["dead-letter"] == 1, 30, "the dead letter")
    # (count, give-backs carried): two uncounted, then counted past the limit
    assert seen == [(1, 0), (1, 1), (1, 2), (2, 2)]
    assert pump.stats["give-backs-bounded"] == 2
    (letter,) = await take_dead_letters(rabbit)
    assert "delivered 3 times" in dead_letter_reason(letter)
    assert letter.headers[DELIVERIES_HEADER] == 3
