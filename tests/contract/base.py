"""The broker contract: what the pump promises on every broker, written once.

A broker variant is two small pieces:

- a :class:`Harness` subclass that publishes, opens a consumer, lists dead letters
  and counts what is left in the input (four methods over the adapter's own
  ``open_broker``/``open_admin`` objects), and
- a ``Test<Broker>Contract(BrokerContract)`` class with a ``harness`` fixture.

The tests drive a real :class:`~worker.pump.Pump` with the reference credit
handler on a SQLite file and judge only what the broker and the database show.
"""

from __future__ import annotations

import abc
import asyncio
import json
from collections.abc import Callable
from decimal import Decimal
from typing import Any, ClassVar

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from handlers.credit import CreditRequested, apply_credit
from tests.support.credits import credit
from tests.support.pumps import running_pump
from tests.support.waiting import wait_for
from worker.brokers import Broker, DeadLetterInfo, OutgoingMessage
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings


class Harness(abc.ABC):
    """One broker under test, seen from outside the adapter."""

    name: ClassVar[str]
    patience: ClassVar[float] = 15.0
    """Seconds any one expected outcome may take (retry hops, lock expiry, group joins)."""

    mode: ClassVar[dict[str, Any]] = {}
    """Overrides of the pump's settings for a mode of the whole suite (batch mode)."""

    def pump_settings(self) -> dict[str, Any]:
        """Overrides of the pump's settings this broker needs (most need none)."""
        return {}

    @abc.abstractmethod
    async def publish(self, messages: list[OutgoingMessage]) -> None:
        """Send to the worker's input, the way ``worker publish`` does."""

    @abc.abstractmethod
    def broker(self, settings: Settings) -> Broker:
        """A new consumer, not started."""

    @abc.abstractmethod
    async def dead_letters(self) -> list[DeadLetterInfo]:
        """Everything dead-lettered so far, as ``worker dlq`` lists it."""

    @abc.abstractmethod
    async def remaining(self) -> int:
        """Messages still owed to the input, once every consumer has closed."""

    async def close(self) -> None:  # noqa: B027 - an optional hook, not a duty
        """Release what the harness holds; tests call it once at the end."""


BATCH_MODE: dict[str, Any] = {"batch_size": 4}
"""The suite in batch mode: deliveries of one type share transactions, four at most."""


class Recorder:
    """What the handler saw, and the faults and stalls a test asks of it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.failures: dict[str, int] = {}  # message id -> fail deliveries up to this count
        self.stall: set[str] = set()  # message ids whose handler waits for `release`
        self.stalled = asyncio.Event()
        self.release = asyncio.Event()

    def counts(self, message_id: str) -> list[int]:
        return [count for seen, count in self.seen if seen == message_id]


def credit_registry(recorder: Recorder) -> Registry:
    registry = Registry()

    @registry.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit_handler(ctx: Context, message: CreditRequested) -> None:
        recorder.seen.append((ctx.message_id, ctx.delivery_count))
        if ctx.message_id in recorder.stall:
            recorder.stalled.set()
            await recorder.release.wait()
        if ctx.delivery_count <= recorder.failures.get(ctx.message_id, 0):
            raise RuntimeError(f"induced failure on delivery {ctx.delivery_count}")
        await apply_credit(ctx, message)

    return registry


class Bench:
    """One test's broker (seen through its harness), SQLite database and recording handler."""

    def __init__(self, harness: Harness, url: str, engine: AsyncEngine, recorder: Recorder) -> None:
        self.harness, self.url, self.engine, self.recorder = harness, url, engine, recorder

    def settings(self, **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": self.url,
            "concurrency": 4,
            "max_deliveries": 3,
            "retry_backoff": 0.001,
            "retry_backoff_max": 0.01,
            "grace_period": 5.0,
        }
        values.update(self.harness.pump_settings())
        values.update(self.harness.mode)
        values.update(overrides)
        return Settings(**values)

    async def consume(self, until: Callable[[Pump], bool], what: str, **overrides: Any) -> Pump:
        """Run one pump (``overrides`` on its settings) until ``until(pump)``, then stop it
        gracefully."""
        settings = self.settings(**overrides)
        async with running_pump(
            self.harness.broker(settings),
            self.engine,
            credit_registry(self.recorder),
            settings,
            name=f"contract-{self.harness.name}",
        ) as pump:
            await wait_for(lambda: until(pump), self.harness.patience, what, step=0.02)
        return pump

    async def balances(self) -> dict[str, Decimal]:
        async with self.engine.connect() as connection:
            rows = await connection.execute(text("SELECT id, balance FROM accounts"))
            return {row[0]: Decimal(row[1]) for row in rows}

    async def markers(self) -> list[str]:
        async with self.engine.connect() as connection:
            rows = await connection.execute(text("SELECT message_id FROM inbox"))
            return sorted(row[0] for row in rows)


class BrokerContract:
    """The behavioural tests every adapter must pass; subclasses provide ``harness``."""

    @pytest.fixture
    def recorder(self) -> Recorder:
        return Recorder()

    @pytest.fixture
    def bench(
        self, harness: Harness, contract_db: tuple[str, AsyncEngine], recorder: Recorder
    ) -> Bench:
        url, engine = contract_db
        return Bench(harness, url, engine, recorder)

    # -- the contract -----------------------------------------------------------

    async def test_commit_is_settled(
        self, harness: Harness, recorder: Recorder, bench: Bench
    ) -> None:
        await harness.publish([credit("c-1", "acct", "5.00")])
        pump = await bench.consume(lambda p: p.stats["ack"] >= 1, "the ack")
        assert recorder.seen == [("c-1", 1)]
        assert pump.stats["committed"] == 1
        assert await bench.balances() == {"acct": Decimal("5.00")}
        assert await harness.remaining() == 0
        assert await harness.dead_letters() == []

    async def test_duplicate_is_settled(self, harness: Harness, bench: Bench) -> None:
        await harness.publish([credit("d-1", "acct", "2.50"), credit("d-1", "acct", "2.50")])
        pump = await bench.consume(lambda p: p.stats["ack"] >= 2, "both acks")
        assert pump.stats["committed"] == 1 and pump.stats["duplicate"] == 1
        assert await bench.balances() == {"acct": Decimal("2.50")}
        assert await bench.markers() == ["d-1"]
        assert await harness.remaining() == 0
        assert await harness.dead_letters() == []

    async def test_error_is_redelivered_with_a_higher_count(
        self, harness: Harness, recorder: Recorder, bench: Bench
    ) -> None:
        recorder.failures["e-1"] = 1
        await harness.publish([credit("e-1", "acct", "1.00")])
        pump = await bench.consume(lambda p: p.stats["ack"] >= 1, "the retry's ack")
        assert recorder.counts("e-1") == [1, 2]
        assert pump.stats["nack"] == 1 and pump.stats["committed"] == 1
        assert await bench.balances() == {"acct": Decimal("1.00")}
        assert await harness.remaining() == 0

    async def test_max_deliveries_dead_letter_with_the_reason(
        self, harness: Harness, recorder: Recorder, bench: Bench
    ) -> None:
        recorder.failures["x-1"] = 99
        await harness.publish([credit("x-1", "acct", "1.00")])
        pump = await bench.consume(
            lambda p: p.stats["dead-letter"] >= 1, "the dead letter", max_deliveries=2
        )
        assert recorder.counts("x-1") == [1, 2]
        assert pump.stats["nack"] == 1
        [letter] = await harness.dead_letters()
        assert letter.message_id == "x-1" and letter.type == "CreditRequested"
        assert "failed 2 deliveries" in letter.reason and "RuntimeError" in letter.reason
        assert json.loads(letter.body) == {"account_id": "acct", "amount": "1.00"}
        assert await harness.remaining() == 0
        assert await bench.balances() == {}

    async def test_poison_is_dead_lettered_at_once(
        self, harness: Harness, recorder: Recorder, bench: Bench
    ) -> None:
        invalid = OutgoingMessage("p-1", "CreditRequested", b'{"account_id": "acct"}')
        unknown = credit("p-2", "acct", "1.00", type="NoSuchType")
        await harness.publish([invalid, unknown])
        pump = await bench.consume(lambda p: p.stats["dead-letter"] >= 2, "two dead letters")
        assert recorder.seen == [] and pump.stats["nack"] == 0
        reasons = {letter.message_id: letter.reason for letter in await harness.dead_letters()}
        assert set(reasons) == {"p-1", "p-2"}
        assert "invalid body" in reasons["p-1"] and "amount" in reasons["p-1"]
        assert "no handler for message type 'NoSuchType'" in reasons["p-2"]
        assert await harness.remaining() == 0

    async def test_shutdown_settles_nothing_unfinished(
        self, harness: Harness, recorder: Recorder, bench: Bench
    ) -> None:
        recorder.stall.add("s-1")
        await harness.publish([credit("s-1", "acct", "7.00")])
        pump = await bench.consume(
            lambda _: recorder.stalled.is_set(), "the stalled handler", grace_period=0.2
        )
        # unfinished work is given back (uncounted, where the broker can), never acked
        assert pump.stats["ack"] == pump.stats["dead-letter"] == pump.stats["committed"] == 0
        assert await harness.remaining() == 1  # back in the input, not acked, not dead
        assert await harness.dead_letters() == []
        assert await bench.balances() == {}

        recorder.stall.clear()  # the next worker finishes it
        pump = await bench.consume(
            lambda p: p.stats["ack"] >= 1, "the redelivery's ack", grace_period=0.2
        )
        assert len(recorder.counts("s-1")) == 2  # counts after a restart are per broker
        assert await bench.balances() == {"acct": Decimal("7.00")}
        assert await harness.remaining() == 0
