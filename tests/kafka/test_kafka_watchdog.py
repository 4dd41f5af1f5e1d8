"""The watchdog on its own (issue 21 defect 6): a record's deadline follows what its unit of
work says it is doing, on a clock the test moves. The end-to-end cases, a member leaving
its group over a hung record and one kept alive keeping its partition, are in
test_kafka_hangs.py."""

from __future__ import annotations

from collections import Counter

import pytest
import structlog
from aiokafka import TopicPartition  # type: ignore[import-untyped]

from worker.brokers.kafka.partitions import Handle, Partition
from worker.brokers.kafka.watchdog import Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Record:
    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.key = None


class Member:
    """What a consumer does when the watchdog asks (the real one talks to the group)."""

    def __init__(self) -> None:
        self.stopping = False
        self.left: list[list[Handle]] = []
        self.rejoined = 0
        self.refuse: Exception | None = None

    async def leave(self, overdue: list[Handle]) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.left.append(overdue)

    def rejoin(self) -> None:
        self.rejoined += 1


LIMIT, MARGIN = 360.0, 30.0  # 300 + 30 + 30: the hand-out deadline with the defaults


def setup() -> tuple[Watchdog, Clock, Partition]:
    clock = Clock()
    watchdog = Watchdog(LIMIT, MARGIN, Counter(), structlog.get_logger(), clock=clock)
    return watchdog, clock, Partition(TopicPartition("t", 0), generation=1)


def handle(partition: Partition, offset: int) -> Handle:
    return Handle(partition, Record(offset), attempt=1, message_id=f"m{offset}")


def test_a_record_kept_alive_is_not_overdue_and_one_left_alone_is() -> None:
    """A batch that retries: each phase says how long it may take, and its records get
    that long plus the margin, counted from the phase's start, not from the hand-out."""
    watchdog, clock, partition = setup()
    kept, alone = handle(partition, 0), handle(partition, 1)
    start = clock.now
    watchdog.arm(kept)
    watchdog.arm(alone)
    clock.now = start + 300  # the first attempt ran its whole time limit and lost a conflict
    watchdog.keep_alive(kept, 300)  # the retry starts: another 300 s
    retry_ends = start + 300 + 300 + MARGIN
    clock.now = start + LIMIT + 1  # past the hand-out deadline
    assert watchdog.overdue() == [alone]
    clock.now = retry_ends - 1
    assert watchdog.overdue() == [alone]
    clock.now = retry_ends + 1
    assert watchdog.overdue() == [kept, alone]


def test_the_deadline_follows_the_phase_even_when_it_is_shorter() -> None:
    """A one-by-one fallback of 5 s per record: a record stuck in it is overdue after
    5 s + the margin, not after the generous hand-out deadline."""
    watchdog, clock, partition = setup()
    record = handle(partition, 0)
    watchdog.arm(record)
    watchdog.keep_alive(record, 5)
    clock.now += 5 + MARGIN + 0.1
    assert watchdog.overdue() == [record]


def test_a_settled_record_is_never_overdue_and_keep_alive_does_not_rearm_it() -> None:
    watchdog, clock, partition = setup()
    record = handle(partition, 0)
    watchdog.arm(record)
    watchdog.disarm(record)
    watchdog.keep_alive(record, 1)  # a late phase of work already settled
    clock.now += 10 * LIMIT
    assert watchdog.overdue() == []


def test_without_a_handler_time_limit_there_is_no_watchdog() -> None:
    clock = Clock()
    watchdog = Watchdog(None, MARGIN, Counter(), structlog.get_logger(), clock=clock)
    record = handle(Partition(TopicPartition("t", 0), generation=1), 0)
    watchdog.arm(record)
    watchdog.keep_alive(record, 1)
    clock.now += 10**6
    assert not watchdog.enabled and watchdog.overdue() == []


async def test_it_leaves_for_an_owned_overdue_record_and_rejoins_once_none_is() -> None:
    watchdog, clock, partition = setup()
    gone = Partition(TopicPartition("t", 1), generation=1)
    gone.owned = False  # revoked meanwhile: its record is another member's business now
    hung, elsewhere = handle(partition, 0), handle(gone, 0)
    watchdog.arm(hung)
    watchdog.arm(elsewhere)
    member = Member()
    await watchdog.check(member)
    assert member.left == [] and not watchdog.left
    clock.now += LIMIT + 1
    await watchdog.check(member)
    assert member.left == [[hung]] and watchdog.left
    await watchdog.check(member)  # still overdue: stays out, leaves once
    assert member.left == [[hung]] and member.rejoined == 0
    watchdog.disarm(hung)  # the hung work ended at last
    watchdog.keep_alive(elsewhere, 60)  # and the other one says what it is doing
    await watchdog.check(member)
    assert member.rejoined == 1 and not watchdog.left


async def test_a_leave_the_group_refused_is_tried_again() -> None:
    watchdog, clock, partition = setup()
    record = handle(partition, 0)
    watchdog.arm(record)
    clock.now += LIMIT + 1
    member = Member()
    member.refuse = RuntimeError("the coordinator is away")
    with pytest.raises(RuntimeError):
        await watchdog.check(member)
    assert not watchdog.left  # still in the group: the next round tries again
    member.refuse = None
    await watchdog.check(member)
    assert watchdog.left and member.left == [[record]]
