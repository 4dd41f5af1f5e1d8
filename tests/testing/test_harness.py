"""The harness runs handlers through the real pump on the memory broker, on both databases,
and reads back what a test needs: settlements, dead letters and their reasons, outcomes,
inbox markers, claims, outbox rows and tables."""

from __future__ import annotations

from decimal import Decimal

from handlers.credit import CreditRequested, apply_credit, apply_credit_and_announce
from handlers.pricing import ChangeProductPrice, change_price
from tests.testing.apis import RecordingAPI
from worker import side_effect
from worker.context import Context
from worker.registry import Registry
from worker.testing import HarnessFactory, Scratch, Settled, harness

CREDIT = {"account_id": "acct-1", "amount": "10.00"}


def credits(announce: bool = False) -> Registry:
    handlers = Registry()
    func = apply_credit_and_announce if announce else apply_credit
    handlers.handler("CreditRequested", CreditRequested, consumer="credit")(func)
    return handlers


async def test_a_delivered_message_is_committed_and_acked(kit_database: Scratch) -> None:
    async with harness(credits(), database=kit_database) as worker:
        done = await worker.deliver("CreditRequested", CREDIT, id="c-1")
        assert done.acked and not done.dead_lettered
        assert done.settlements == (Settled("ack", 1),)
        assert done.outcomes == {"committed": 1}
        rows = await worker.rows("accounts")
        assert [(r["id"], r["balance"], r["version"]) for r in rows] == [
            ("acct-1", Decimal("10.00"), 2)
        ]
        markers = await worker.markers()
        assert [(m.message_id, m.consumer, m.state) for m in markers] == [
            ("c-1", "credit", "finished")
        ]


async def test_the_same_message_twice_is_applied_once(kit_database: Scratch) -> None:
    async with harness(credits(), database=kit_database) as worker:
        done = await worker.deliver_twice("CreditRequested", CREDIT)
        assert done.outcomes == {"committed": 1, "duplicate": 1}
        assert [s.verb for s in done.settlements] == ["ack", "ack"]
        assert [r["balance"] for r in await worker.rows("accounts")] == [Decimal("10.00")]


async def test_twins_on_both_replicas_at_once_are_applied_once(kit_database: Scratch) -> None:
    async with harness(credits(), database=kit_database) as worker:
        done = await worker.deliver_concurrently("CreditRequested", CREDIT)
        assert done.outcomes == {"committed": 1, "duplicate": 1}
        assert len(done.settlements) == 2  # one per replica
        assert len(await worker.markers()) == 1


async def test_a_lost_ack_brings_the_message_back_as_a_duplicate(kit_database: Scratch) -> None:
    async with harness(credits(), database=kit_database) as worker:
        done = await worker.deliver("CreditRequested", CREDIT, lose_acks=1)
        assert done.settlements == (Settled("ack", 1), Settled("ack", 2))
        assert done.outcomes == {"committed": 1, "duplicate": 1}


async def test_a_message_that_can_never_succeed_is_dead_lettered_with_its_reason(
    kit_database: Scratch,
) -> None:
    async with harness(credits(), database=kit_database) as worker:
        done = await worker.deliver("CreditRequested", {"account_id": "acct-1"})
        assert done.dead_lettered and done.settlements == (Settled("dead-letter", 1),)
        assert done.dead_letter is not None and "amount" in done.dead_letter
        assert worker.dead_letters == {done.message_id: done.dead_letter}
        assert await worker.rows("accounts") == []


async def test_the_outbox_rows_a_handler_published_are_read(kit_database: Scratch) -> None:
    async with harness(credits(announce=True), database=kit_database) as worker:
        await worker.deliver("CreditRequested", CREDIT, id="c-9")
        [event] = await worker.outbox()
        assert (event.message_type, event.source_message_id, event.key, event.state) == (
            "CreditApplied",
            "c-9",
            "acct-1",
            "pending",
        )
        assert event.body == {"credit_id": "c-9", "account_id": "acct-1", "amount": "10.00"}
        assert event.headers["ce-id"] == event.message_id


async def test_a_side_effects_claim_is_read(mail_api: RecordingAPI, kit_database: Scratch) -> None:
    from handlers.notify import SendWelcomeEmail, send_welcome_email

    handlers = Registry()
    side_effect("SendWelcomeEmail", SendWelcomeEmail, consumer="welcome", registry=handlers)(
        send_welcome_email
    )
    async with harness(handlers, database=kit_database) as worker:
        body = {"user_id": "u-1", "email": "u-1@example.com"}
        done = await worker.deliver("SendWelcomeEmail", body, id="mail-1")
        assert done.acked
        [claim] = await worker.claims()
        assert (claim.message_id, claim.consumer, claim.state, claim.outcome) == (
            "mail-1",
            "welcome",
            "finished",
            "HTTP 202",
        )
        assert mail_api.drain() == [{"template": "welcome", "user_id": "u-1", "to": body["email"]}]


async def test_given_rows_are_there_before_the_first_message(kit_database: Scratch) -> None:
    handlers = Registry()
    handlers.handler("ChangeProductPrice", ChangeProductPrice, consumer="pricing")(change_price)
    product = {"id": "p-1", "name": "Widget", "price": "9.99", "version": 1}
    async with harness(handlers, database=kit_database, given=[("products", product)]) as worker:
        change = {"product_id": "p-1", "price": "12.50", "expected_version": 1}
        assert (await worker.deliver("ChangeProductPrice", change)).acked
        [row] = await worker.rows("products")
        assert (row["price"], row["version"]) == (Decimal("12.50"), 2)


async def test_each_harness_starts_from_an_empty_database(worker_harness: HarnessFactory) -> None:
    for _ in range(2):
        async with worker_harness(credits()) as worker:
            assert await worker.rows("accounts") == []
            await worker.deliver("CreditRequested", CREDIT)


async def test_the_settings_given_reach_the_pumps(worker_harness: HarnessFactory) -> None:
    handlers = Registry()

    @handlers.handler("Fails", CreditRequested, consumer="fails")
    async def fails(_ctx: Context, _message: CreditRequested) -> None:
        raise RuntimeError("never works")

    async with worker_harness(handlers, max_deliveries=2) as worker:
        done = await worker.deliver("Fails", CREDIT)
        assert [s.verb for s in done.settlements] == ["nack", "dead-letter"]
        assert done.dead_letter is not None and "RuntimeError: never works" in done.dead_letter
