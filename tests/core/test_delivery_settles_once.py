"""worker.delivery.Delivery: settled exactly once, whatever the verbs and their order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest

from worker.delivery import Delivery
from worker.errors import AlreadySettled, SettlementLost

VERBS = ("ack", "nack", "dead_letter")
SETTLED_AS = {"ack": "acked", "nack": "nacked", "dead_letter": "dead-lettered"}


class RecordingSettler:
    """Records every call that reaches the broker; optionally fails them."""

    watches = False
    writes_in_commit = False

    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail

    async def ack(self, handle: Any) -> None:
        self.calls.append(("ack", handle))
        if self.fail is not None:
            raise self.fail

    async def nack(self, handle: Any, delay: float | None, counted: bool) -> None:
        self.calls.append(("nack", handle, delay, counted))
        if self.fail is not None:
            raise self.fail

    async def dead_letter(self, handle: Any, reason: str) -> None:
        self.calls.append(("dead_letter", handle, reason))
        if self.fail is not None:
            raise self.fail

    async def ack_many(self, handles: Sequence[Any]) -> list[Any]:
        for handle in handles:
            await self.ack(handle)
        return []

    def keep_alive(self, handle: Any, seconds: float) -> None:
        self.calls.append(("keep_alive", handle, seconds))

    async def in_commit(self, session: Any, handles: Sequence[Any]) -> None:
        return None


def delivery(settler: RecordingSettler, count: int = 1) -> Delivery:
    return Delivery("m-1", "Credit", b"{}", {}, count, settler, handle="h-1")


async def settle(target: Delivery, verb: str) -> None:
    if verb == "ack":
        await target.ack()
    elif verb == "nack":
        await target.nack()
    else:
        await target.dead_letter("because")


@pytest.mark.parametrize(("first", "second"), list(itertools.product(VERBS, VERBS)))
async def test_a_delivery_is_settled_once_in_every_order(first: str, second: str) -> None:
    settler = RecordingSettler()
    target = delivery(settler)
    await settle(target, first)
    assert target.settled == SETTLED_AS[first]
    with pytest.raises(AlreadySettled, match=f"already {SETTLED_AS[first]}"):
        await settle(target, second)
    assert [call[0] for call in settler.calls] == [first]  # the second never reached the broker
    assert target.settled == SETTLED_AS[first]


@pytest.mark.parametrize("order", list(itertools.permutations(VERBS)))
async def test_only_the_first_of_all_three_verbs_counts(order: tuple[str, ...]) -> None:
    settler = RecordingSettler()
    target = delivery(settler)
    await settle(target, order[0])
    for verb in order[1:]:
        with pytest.raises(AlreadySettled):
            await settle(target, verb)
    assert [call[0] for call in settler.calls] == [order[0]]


@pytest.mark.parametrize("first", VERBS)
async def test_a_settlement_the_broker_refused_is_still_the_one(first: str) -> None:
    """The broker will redeliver: settling again (say, a fallback nack) would be a second
    settlement of the same delivery, so it is refused as well."""
    settler = RecordingSettler(fail=SettlementLost("lock lost"))
    target = delivery(settler)
    with pytest.raises(SettlementLost):
        await settle(target, first)
    for verb in VERBS:
        with pytest.raises(AlreadySettled):
            await settle(target, verb)
    assert len(settler.calls) == 1


async def test_dead_letter_reasons_reach_the_broker_scrubbed() -> None:
    settler = RecordingSettler()
    reason = (
        "credit: OperationalError: refused postgresql://ledger:S3cr3tPassw0rd@db:5432/ledger "
        "(Authorization: Bearer eyJhbGciOi.x.y; token=t0k3n)"
    )
    await delivery(settler).dead_letter(reason)
    [(verb, handle, sent)] = settler.calls
    assert (verb, handle) == ("dead_letter", "h-1")
    assert sent == (
        "credit: OperationalError: refused postgresql://ledger:***@db:5432/ledger "
        "(Authorization: Bearer ***; token=***"  # a bare value runs to ; & or a space
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, (None, True)),
        ({"delay": 2.5}, (2.5, True)),
        ({"counted": False}, (None, False)),
        ({"delay": 0.0, "counted": False}, (0.0, False)),
    ],
)
async def test_nack_passes_delay_and_counted_to_the_broker(
    kwargs: dict[str, Any], expected: tuple[float | None, bool]
) -> None:
    settler = RecordingSettler()
    await delivery(settler).nack(**kwargs)
    assert settler.calls == [("nack", "h-1", *expected)]


def test_only_a_later_delivery_is_a_redelivery() -> None:
    assert not delivery(RecordingSettler(), count=1).redelivered
    assert delivery(RecordingSettler(), count=2).redelivered
