"""The invariant checks fail when they should, and only then: each on a journal made by hand."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from tests.explorer.invariants import (
    APPLIED_ONCE,
    BOUNDED,
    COUNTED,
    DEAD_LETTERS,
    FOOTPRINT,
    ORDER,
    SETTLED_ONCE,
    Observed,
    check,
)
from tests.explorer.recording import Journal
from tests.explorer.schedule import Action, Message, Schedule
from worker.brokers.memory import MemoryBroker
from worker.delivery import Delivery


class _Settler:
    pass


def _arrive(journal: Journal, pump: str, message_id: str, group: Any = None) -> object:
    handle = object()
    delivery = Delivery(message_id, "Op", b"{}", {}, 1, _Settler(), handle)  # type: ignore[arg-type]
    delivery.group = group
    journal.arrived(pump, handle, delivery)
    return handle


def _schedule(*messages: Message) -> Schedule:
    return Schedule(1, "sqlite", 1, 1, 2, 3, 3, False, messages)


def _seen(journal: Journal, broker: MemoryBroker | None = None, **fields: Any) -> Observed:
    values: dict[str, Any] = {
        "journal": journal,
        "broker": broker or MemoryBroker(),
        "settled_in_time": True,
        "unsettled": [],
        "effects": Counter(),
        "markers": Counter(),
        "extra": [],
        "pump_stats": {},
        "footprints": {},
    }
    values.update(fields)
    return Observed(**values)


def _kinds(schedule: Schedule, seen: Observed) -> set[str]:
    return {v.invariant for v in check(schedule, seen)}


def _applied(*ids: str) -> Counter[tuple[str, str]]:
    return Counter({(i, "op"): 1 for i in ids})


def test_a_same_key_delivery_received_later_that_starts_first_breaks_the_order() -> None:
    journal = Journal()
    first, second = _arrive(journal, "p0", "a"), _arrive(journal, "p0", "b")
    journal.invoked("p0", "b", "k")
    journal.invoked("p0", "a", "k")
    for handle in (first, second):
        journal.settled(handle, "ack")
    schedule = _schedule(Message("a", "Op", key="k"), Message("b", "Op", key="k"))
    seen = _seen(journal, effects=_applied("a", "b"), markers=_applied("a", "b"))
    assert _kinds(schedule, seen) == {ORDER}


def test_a_message_running_again_may_follow_later_ones_but_not_be_overtaken() -> None:
    journal = Journal()
    first = _arrive(journal, "p0", "a")
    twin = _arrive(journal, "p0", "a")  # a producer's retry, in the same batch
    later = _arrive(journal, "p0", "b")
    journal.invoked("p0", "a", "k")
    journal.own_failures["a"] += 1
    journal.settled(first, "nack")  # its first copy failed: the twin runs again, after b
    journal.invoked("p0", "b", "k")
    journal.invoked("p0", "a", "k")
    for handle in (twin, later):
        journal.settled(handle, "ack")
    schedule = _schedule(Message("a", "Op", key="k"), Message("b", "Op", key="k"))
    seen = _seen(journal, effects=_applied("a", "b"), markers=_applied("a", "b"))
    assert _kinds(schedule, seen) == set()


def test_a_delivery_settled_twice_or_never_is_caught() -> None:
    journal = Journal()
    twice = _arrive(journal, "p0", "a")
    _arrive(journal, "p0", "b")
    journal.settled(twice, "ack")
    journal.settled(twice, "ack")
    schedule = _schedule(Message("a", "Op"), Message("b", "Op"))
    seen = _seen(journal, effects=_applied("a", "b"), markers=_applied("a", "b"))
    assert _kinds(schedule, seen) == {SETTLED_ONCE}


def test_applied_twice_or_never_is_caught() -> None:
    schedule = _schedule(Message("a", "Op"), Message("b", "Op"))
    twice = Counter({("a", "op"): 2, ("b", "op"): 0})
    seen = _seen(Journal(), effects=twice, markers=_applied("a"))
    found = check(schedule, seen)
    assert {v.invariant for v in found} == {APPLIED_ONCE}
    assert len(found) == 2


def test_a_valid_message_dead_lettered_without_failures_of_its_own_is_caught() -> None:
    broker = MemoryBroker()
    consumer = broker.connect()
    outage = Action("outage", "refuse", 0.8)
    schedule = _schedule(Message("a", "Op", plan=(outage, outage)))

    async def dead_letter() -> None:
        await consumer.start(prefetch=1)
        broker.publish("a", "Op", {})
        delivery = await consumer.receive()
        await delivery.dead_letter("delivered 4 times (WORKER_MAX_DELIVERIES=3)")

    asyncio.run(dead_letter())
    assert _kinds(schedule, _seen(Journal(), broker)) == {DEAD_LETTERS}


def test_a_count_spent_without_a_failure_of_its_own_is_caught() -> None:
    journal = Journal()
    first, second = _arrive(journal, "p0", "a"), _arrive(journal, "p0", "a")
    journal.settled(first, "nack")  # counted, and its handler never failed
    journal.settled(second, "ack")
    schedule = _schedule(Message("a", "Op"))
    seen = _seen(journal, effects=_applied("a"), markers=_applied("a"))
    assert _kinds(schedule, seen) == {COUNTED}
    journal.own_failures["a"] += 1
    assert _kinds(schedule, seen) == set()


def test_unsettled_work_and_growth_at_rest_are_caught() -> None:
    schedule = _schedule()
    seen = _seen(
        Journal(), settled_in_time=False, unsettled=["m01 (#1@p0.1:unsettled)"], footprints={}
    )
    assert _kinds(schedule, seen) == {BOUNDED}
    growing = _seen(Journal(), footprints={"p0.1": [50, 60, 90, 120]})
    assert _kinds(schedule, growing) == {FOOTPRINT}
    flat = _seen(Journal(), footprints={"p0.1": [50, 60, 63, 63]})
    assert _kinds(schedule, flat) == set()
