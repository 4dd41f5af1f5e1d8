"""Two-phase claims with a lease, against a real HTTP server on 127.0.0.1 (side effects that
can't join the transaction get a two-phase claim with an idempotency key).

The crash cases here cut the attempt in-process: the pump is stopped with no
grace period while its handler waits between claim and call (or between call
and mark), so the attempt is cancelled there and its consumer vanishes
unsettled, exactly as a killed process leaves it. test_claim_crashes.py does
the same with SIGKILL and a real process.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from handlers.credit import CreditRequested, apply_credit
from handlers.notify import SendWelcomeEmail, send_welcome_email
from tests.concurrency.concurrency_helpers import (
    MailServer,
    add_marker,
    count,
    inbox_rows,
    record_statements,
)
from tests.support.database import INBOX
from tests.support.processes import json_env, run_cli
from tests.support.pumps import MakeSettings, RunPumps, running_pump
from tests.support.waiting import wait_for
from worker import leases, sweeper
from worker.brokers.memory import MemoryBroker
from worker.claims import ClaimContext, side_effect
from worker.context import session_factory
from worker.db import create_engine
from worker.logs import get_logger
from worker.registry import Context, Registry
from worker.settings import Settings

BODY = {"user_id": "u1", "email": "u1@example.com"}
LOG = get_logger(test="claims")


def claim_settings(make_settings: MakeSettings, **overrides: Any) -> Settings:
    """Short claim timings. The mail API's URL is the notify handler's own setting, not the
    worker's: the mail_server fixture hands it to the handler."""
    values: dict[str, Any] = {
        # a local HTTP call takes milliseconds, but a loaded CI machine can stall one for
        # far longer; a call cut by its timeout is a real (counted) failure in these tests
        "claim_lease": 1.5,
        "claim_call_timeout": 1.0,
        "purge_interval": 0,
        "max_deliveries": 6,
    }
    values.update(overrides)
    settings: Settings = make_settings(**values)
    return settings


def mail_registry(gate: Any = None) -> Registry:
    """The real notify handler; ``gate(ctx, phase)`` may hold it before or after the call."""
    registry = Registry()

    @side_effect("SendWelcomeEmail", SendWelcomeEmail, consumer="welcome-email", registry=registry)
    async def send(ctx: ClaimContext, message: SendWelcomeEmail) -> str | None:
        if gate is not None:
            await gate(ctx, "before-call")
        outcome = await send_welcome_email(ctx, message)
        if gate is not None:
            await gate(ctx, "after-call")
        return outcome

    return registry


async def test_two_replicas_racing_on_one_message_make_one_call(
    database_url: str, make_settings: MakeSettings, run_pumps: RunPumps, mail_server: MailServer
) -> None:
    mail_server.delay = 0.3  # the first call is still running when the twin arrives
    # a call timeout well above the call's 0.3 s, so a loaded machine does not time it out
    settings = claim_settings(make_settings, claim_lease=1.2, claim_call_timeout=0.9)
    broker = MemoryBroker()
    engines = [create_engine(database_url), create_engine(database_url)]
    try:
        async with run_pumps(
            [broker.connect(), broker.connect()], engines, mail_registry(), settings
        ) as pumps:
            broker.publish("welcome-1", "SendWelcomeEmail", BODY, to_all=True)
            await broker.wait_idle(10)
        stats = pumps[0].stats + pumps[1].stats
        [row] = await inbox_rows(engines[0])
    finally:
        for engine in engines:
            await engine.dispose()
    assert mail_server.calls == Counter({"welcome-1": 1})
    assert (row.state, row.outcome, row.lease_until, row.body) == (
        "finished",
        "HTTP 202",
        None,
        None,
    )
    assert row.processed_at is not None
    assert stats["committed"] == 1
    assert stats["claim-held"] >= 1  # the twin saw a live claim and came back later
    assert stats["duplicate"] == 1  # ... and found it finished
    assert not broker.dead_letters


async def test_a_finished_claim_is_acked_without_a_call(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, mail_server: MailServer
) -> None:
    broker = MemoryBroker()
    settings = claim_settings(make_settings)
    async with run_pumps([broker.connect()], [engine], mail_registry(), settings) as [pump]:
        broker.publish("welcome-1", "SendWelcomeEmail", BODY)
        await broker.wait_idle(5)
        broker.publish("welcome-1", "SendWelcomeEmail", BODY)  # a producer retry, later
        await broker.wait_idle(5)
    assert mail_server.calls["welcome-1"] == 1
    assert pump.stats["duplicate"] == 1
    assert [verb for verb, _, _ in broker.history] == ["ack", "ack"]


async def test_a_live_claim_is_left_to_its_owner_and_nacked_with_a_delay(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, mail_server: MailServer
) -> None:
    await add_marker(
        engine, "welcome-1", consumer="welcome-email", state="claimed", lease=timedelta(seconds=30)
    )
    broker = MemoryBroker()
    settings = claim_settings(make_settings, claim_lease=60, claim_call_timeout=5)
    async with run_pumps([broker.connect()], [engine], mail_registry(), settings) as [pump]:
        broker.publish("welcome-1", "SendWelcomeEmail", BODY)
        await wait_for(lambda: pump.stats["claim-held"] == 1, 10.0, "the claim held", step=0.02)
        assert broker._delayed == 1  # held back for about the lease's remaining 30 s
    assert mail_server.calls["welcome-1"] == 0
    [row] = await inbox_rows(engine)
    assert (row.state, row.claimed_by) == ("claimed", "someone-else")


async def test_waiting_for_a_live_claim_spends_no_delivery(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, mail_server: MailServer
) -> None:
    """A delivery count is spent only by the message's own failure: with one delivery
    allowed, the wait for another replica's lease used to spend it, and the message was
    dead-lettered "exhausted" instead of being sent."""
    await add_marker(
        engine, "welcome-1", consumer="welcome-email", state="claimed", lease=timedelta(seconds=0.5)
    )
    broker = MemoryBroker()
    # room for a slow first HTTP call on a loaded machine: a cut call would be a real failure
    settings = claim_settings(make_settings, max_deliveries=1, claim_lease=3, claim_call_timeout=2)
    async with run_pumps([broker.connect()], [engine], mail_registry(), settings) as [pump]:
        broker.publish("welcome-1", "SendWelcomeEmail", BODY)
        await broker.wait_idle(10)
    assert not broker.dead_letters
    assert [(verb, count) for verb, _, count in broker.history] == [("nack", 1), ("ack", 1)]
    assert mail_server.calls == Counter({"welcome-1": 1})
    assert pump.stats["claim-held"] == 1


@pytest.mark.parametrize("cut", ["before-call", "after-call"])
async def test_a_crash_between_phases_still_ends_in_one_effect(
    cut: str,
    database_url: str,
    make_settings: MakeSettings,
    run_pumps: RunPumps,
    mail_server: MailServer,
) -> None:
    """Cut between claim and call: the call happens once, one lease later. Cut between call
    and mark: the call is repeated with the same key, and the provider applies it once."""
    reached = asyncio.Event()

    async def hold_first(ctx: ClaimContext, phase: str) -> None:
        if phase == cut and ctx.claim.attempts == 1:
            reached.set()
            await asyncio.Event().wait()  # until the pump is cut down

    broker = MemoryBroker()
    engines = [create_engine(database_url), create_engine(database_url)]
    doomed = claim_settings(make_settings, grace_period=0)
    try:
        async with run_pumps([broker.connect()], engines[:1], mail_registry(hold_first), doomed):
            broker.publish("welcome-1", "SendWelcomeEmail", BODY)
            await wait_for(reached.is_set, 10.0, "the held attempt", step=0.02)
        # The replica is gone: its attempt was cancelled, its delivery went back unsettled.
        [claimed] = await inbox_rows(engines[1])
        assert (claimed.state, claimed.processed_at) == ("claimed", None)
        assert mail_server.calls["welcome-1"] == (1 if cut == "after-call" else 0)

        survivor = claim_settings(make_settings)
        async with run_pumps([broker.connect()], engines[1:], mail_registry(), survivor) as [pump]:
            await broker.wait_idle(10)
        [row] = await inbox_rows(engines[1])
    finally:
        for engine in engines:
            await engine.dispose()
    assert (row.state, row.outcome, row.attempts) == ("finished", "HTTP 202", 2)  # taken over
    assert mail_server.calls["welcome-1"] == (2 if cut == "after-call" else 1)
    assert list(mail_server.effects) == ["welcome-1"]  # one effect per key at the provider
    assert pump.stats["committed"] == 1


async def test_a_failing_server_is_retried_and_never_marked_processed(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, mail_server: MailServer
) -> None:
    mail_server.fail = 2
    broker = MemoryBroker()
    settings = claim_settings(make_settings)
    async with run_pumps([broker.connect()], [engine], mail_registry(), settings) as [pump]:
        broker.publish("welcome-1", "SendWelcomeEmail", BODY)
        await wait_for(
            lambda: mail_server.calls["welcome-1"] >= 1, 10.0, "the first call", step=0.02
        )
        await wait_for(lambda: pump.stats["retry-requested"] == 1, 10.0, "the retry", step=0.02)
        [row] = await inbox_rows(engine)
        assert (row.state, row.processed_at) == ("claimed", None)  # failed: not processed
        assert row.outcome == "failed: Retry: mail API answered HTTP 503"
        await broker.wait_idle(10)
    [row] = await inbox_rows(engine)
    assert (row.state, row.outcome, row.attempts) == ("finished", "HTTP 202", 3)
    assert mail_server.calls["welcome-1"] == 3
    assert [verb for verb, _, _ in broker.history] == ["nack", "nack", "ack"]


async def test_a_server_failing_for_good_dead_letters_and_leaves_an_unfinished_claim(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, mail_server: MailServer
) -> None:
    """Out of deliveries and out of attempts: the sweeper gives the claim up without a call;
    re-submitting the dead letter (a new delivery of the same id) takes it over and finishes."""
    mail_server.fail = 100
    broker = MemoryBroker()
    settings = claim_settings(make_settings, max_deliveries=3)
    async with run_pumps([broker.connect()], [engine], mail_registry(), settings):
        broker.publish("welcome-1", "SendWelcomeEmail", BODY)
        await broker.wait_idle(10)
    assert len(broker.dead_letters) == 1
    [row] = await inbox_rows(engine)
    assert (row.state, row.processed_at) == ("claimed", None)
    stale = await sweeper.stale_claims(session_factory(engine))
    assert [(s.message_id, s.consumer, s.attempts) for s in stale] == [
        ("welcome-1", "welcome-email", 3)
    ]

    # 3 attempts = WORKER_MAX_DELIVERIES: the sweeper abandons the claim instead of calling.
    mail_server.fail = 0
    results = await sweeper.redrive(session_factory(engine), mail_registry(), settings, LOG)
    assert results == Counter({"exhausted": 1})
    assert mail_server.calls["welcome-1"] == 3
    [row] = await inbox_rows(engine)
    assert (row.state, row.outcome) == ("abandoned", "failed: Retry: mail API answered HTTP 503")
    assert await sweeper.stale_claims(session_factory(engine)) == []

    # The provider recovered; an operator re-submits the dead letter.
    async with run_pumps([broker.connect()], [engine], mail_registry(), settings) as [pump]:
        broker.publish("welcome-1", "SendWelcomeEmail", BODY)
        await broker.wait_idle(10)
    [row] = await inbox_rows(engine)
    assert (row.state, row.outcome, row.attempts) == ("finished", "HTTP 202", 4)
    assert mail_server.calls["welcome-1"] == 4
    assert pump.stats["committed"] == 1


async def test_a_hanging_server_times_out_keeps_the_claim_and_is_called_again_after_the_lease(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, mail_server: MailServer
) -> None:
    """The server answers the first call after 1.2 s: later than the 1 s call timeout,
    within the 1.5 s lease. The second call comes only once the lease is over."""
    mail_server.hang, mail_server.hang_for = 1, 1.2
    broker = MemoryBroker()
    settings = claim_settings(make_settings)
    async with run_pumps([broker.connect()], [engine], mail_registry(), settings) as [pump]:
        broker.publish("welcome-1", "SendWelcomeEmail", BODY)
        await wait_for(lambda: pump.stats["call-timeout"] == 1, 10.0, "the call timeout", step=0.02)
        [row] = await inbox_rows(engine)
        assert row.state == "claimed" and row.lease_until is not None
        assert row.outcome.startswith("unknown: TimeoutError")  # not "failed": lease kept
        assert mail_server.calls["welcome-1"] == 1
        await broker.wait_idle(10)
    assert mail_server.calls["welcome-1"] == 2  # the same key both times
    [row] = await inbox_rows(engine)
    assert (row.state, row.attempts) == ("finished", 2)
    assert pump.stats["call-timeout"] == 1  # the timeout nacked the first delivery


class SlowProvider:
    """A provider whose work goes on when the caller stops waiting, as a real one's does:
    a timeout ends the wait, not the call. Tracks how many calls per key run at once."""

    def __init__(self, slow_calls: int, takes: float) -> None:
        self.slow_calls = slow_calls
        self.takes = takes
        self.calls: Counter[str] = Counter()
        self.running: Counter[str] = Counter()
        self.most_at_once: Counter[str] = Counter()
        self._work: set[asyncio.Task[None]] = set()

    async def call(self, key: str) -> str:
        self.calls[key] += 1
        takes = self.takes if self.calls[key] <= self.slow_calls else 0.01
        work = asyncio.create_task(self._serve(key, takes))
        self._work.add(work)
        work.add_done_callback(self._work.discard)
        await asyncio.shield(work)
        return "sent"

    async def _serve(self, key: str, takes: float) -> None:
        self.running[key] += 1
        self.most_at_once[key] = max(self.most_at_once[key], self.running[key])
        try:
            await asyncio.sleep(takes)
        finally:
            self.running[key] -= 1

    async def drain(self) -> None:
        async with asyncio.timeout(5):
            await asyncio.gather(*self._work)


async def test_a_timed_out_call_keeps_its_lease_so_one_key_is_never_called_twice_at_once(
    database_url: str, make_settings: MakeSettings, run_pumps: RunPumps, mail_server: MailServer
) -> None:
    """Issue 15 item 2, scaled down from a 10 s lease, 1 s call timeout and 2.5 s provider
    call: when a timeout released the lease, each redelivery took the claim over at once,
    and three calls with the same key ran together. Now each waits for the lease."""
    provider = SlowProvider(slow_calls=3, takes=0.4)
    registry = Registry()

    @side_effect("SendWelcomeEmail", SendWelcomeEmail, consumer="welcome-email", registry=registry)
    async def send(ctx: ClaimContext, message: SendWelcomeEmail) -> str:
        return await provider.call(ctx.idempotency_key)

    settings = claim_settings(make_settings, claim_lease=0.8, claim_call_timeout=0.15)
    broker = MemoryBroker()
    engines = [create_engine(database_url), create_engine(database_url)]
    try:
        async with run_pumps(
            [broker.connect(), broker.connect()], engines, registry, settings
        ) as pumps:
            broker.publish("welcome-1", "SendWelcomeEmail", BODY)
            await broker.wait_idle(15)
        await provider.drain()
        stats = pumps[0].stats + pumps[1].stats
        [row] = await inbox_rows(engines[0])
    finally:
        for engine in engines:
            await engine.dispose()
    assert provider.most_at_once == Counter({"welcome-1": 1})
    assert provider.calls == Counter({"welcome-1": 4})  # three slow ones, then an answer
    assert (row.state, row.attempts, row.outcome) == ("finished", 4, "sent")
    assert stats["call-timeout"] == 3
    assert broker.history[-1][0] == "ack" and not broker.dead_letters


async def test_a_refusing_server_dead_letters_at_once(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, mail_server: MailServer
) -> None:
    mail_server.fail, mail_server.fail_status = 1, 422
    broker = MemoryBroker()
    async with run_pumps(
        [broker.connect()], [engine], mail_registry(), claim_settings(make_settings)
    ):
        broker.publish("welcome-1", "SendWelcomeEmail", BODY)
        await broker.wait_idle(5)
    [letter] = broker.dead_letters
    assert letter.reason == "welcome-email: mail API refused the message: HTTP 422"
    [row] = await inbox_rows(engine)
    assert row.state == "abandoned"  # never marked finished: the effect did not happen
    assert await sweeper.stale_claims(session_factory(engine)) == []  # nor re-driven


async def test_only_one_replica_takes_over_an_expired_claim(database_url: str) -> None:
    engines = [create_engine(database_url) for _ in range(4)]
    try:
        await add_marker(
            engines[0], "m1", consumer="mail", state="claimed", lease=timedelta(seconds=-5)
        )
        [stale] = await inbox_rows(engines[0])
        taken = await asyncio.gather(
            *(leases.take_over(session_factory(e), stale.id, lease=30) for e in engines)
        )
        acquired = await asyncio.gather(
            *(leases.acquire(session_factory(e), "m2", "mail", 30) for e in engines)
        )
    finally:
        for engine in engines:
            await engine.dispose()
    winners = [claim for claim in taken if claim is not None]
    assert len(winners) == 1 and winners[0].attempts == 2
    assert sum(isinstance(got, leases.Claim) for got in acquired) == 1
    assert sum(isinstance(got, leases.Held) for got in acquired) == 3


async def test_a_claim_that_lost_its_lease_cannot_release_the_new_owners(
    engine: AsyncEngine, make_settings: MakeSettings
) -> None:
    sessions = session_factory(engine)
    first = await leases.acquire(sessions, "m1", "mail", lease=0.05)
    assert isinstance(first, leases.Claim)
    await asyncio.sleep(0.1)
    second = await leases.acquire(sessions, "m1", "mail", lease=30)
    assert isinstance(second, leases.Claim) and second.attempts == 2
    await leases.release(sessions, first, RuntimeError("late failure"), LOG)
    [row] = await inbox_rows(engine)
    assert row.claimed_by == second.owner
    assert isinstance(await leases.acquire(sessions, "m1", "mail", lease=30), leases.Held)


def test_worker_sweep_lists_stale_claims_as_json(database_url: str) -> None:
    async def seed() -> None:
        engine = create_engine(database_url)
        try:
            await add_marker(
                engine,
                "m1",
                consumer="welcome-email",
                state="claimed",
                lease=timedelta(minutes=-3),
                message_type="SendWelcomeEmail",
            )
            await add_marker(
                engine, "m2", consumer="welcome-email", state="claimed", lease=timedelta(minutes=3)
            )
        finally:
            await engine.dispose()

    asyncio.run(seed())
    done = run_cli(json_env({"WORKER_DATABASE_URL": database_url}), "sweep")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()  # the live claim m2 is not listed
    listed = json.loads(line)
    assert (listed["message_id"], listed["consumer"], listed["type"]) == (
        "m1",
        "welcome-email",
        "SendWelcomeEmail",
    )
    assert 170 < listed["overdue_s"] < 200


async def test_regular_markers_are_finished_at_insert_with_no_extra_statement(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    statements = record_statements(engine)
    registry = Registry()

    @registry.handler("Nothing", CreditRequested, consumer="nothing")
    async def nothing(ctx: Context, message: CreditRequested) -> None:
        return None

    registry.handler("Credit", CreditRequested, consumer="credit")(apply_credit)
    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings()):
        statements.clear()
        broker.publish("m1", "Nothing", {"account_id": "a", "amount": "1"})
        await broker.wait_idle(5)
        [insert] = statements  # the marker and nothing else: same cost as before claims existed
        broker.publish("m2", "Credit", {"account_id": "a", "amount": "1"})
        await broker.wait_idle(5)
    assert insert.startswith("INSERT INTO inbox (message_id, consumer) VALUES")
    rows = await inbox_rows(engine)
    assert [(r.state, r.lease_until, r.claimed_by) for r in rows] == [("finished", None, None)] * 2
    assert all(r.processed_at is not None for r in rows)
    assert await count(engine, INBOX, INBOX.c.state == "finished") == 2


async def test_a_call_cut_by_shutdown_keeps_its_lease_and_stays_unfinished(
    engine: AsyncEngine, make_settings: MakeSettings, mail_server: MailServer
) -> None:
    """Cancelled mid-call: nothing is released or marked; the lease runs out, then a takeover."""
    mail_server.hang, mail_server.hang_for = 1, 1.0
    broker = MemoryBroker()
    settings = claim_settings(make_settings, grace_period=0, claim_call_timeout=0.5)
    async with running_pump(broker.connect(), engine, mail_registry(), settings):
        broker.publish("welcome-1", "SendWelcomeEmail", BODY)
        await wait_for(mail_server.arrived.is_set, 10.0, "the call", step=0.02)
    [row] = await inbox_rows(engine)
    assert (row.state, row.attempts) == ("claimed", 1)
    assert row.outcome is None  # cancelled, not failed: nothing released, the lease runs out
    assert broker.ready and broker.ready[0].message_id == "welcome-1"  # back on the queue


def test_a_side_effect_handler_cannot_skip_the_inbox() -> None:
    from worker.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="a side-effect handler needs the inbox"):
        Registry().handler("X", SendWelcomeEmail, consumer="x", inbox=False, side_effect=True)


async def test_the_idempotency_key_is_the_message_id_on_every_delivery(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps, mail_server: MailServer
) -> None:
    """The dedup key must be stable across redeliveries: not the delivery count, a
    correlation id or a receive time, which all change."""
    mail_server.fail = 2
    broker = MemoryBroker()
    headers = {"correlation_id": "conversation-7"}
    async with run_pumps(
        [broker.connect()], [engine], mail_registry(), claim_settings(make_settings)
    ):
        broker.publish("welcome-1", "SendWelcomeEmail", BODY, headers)
        await broker.wait_idle(10)
    assert mail_server.calls == Counter({"welcome-1": 3})  # three deliveries, one key
