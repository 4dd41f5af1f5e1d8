"""The watchdog: a member holding a record past its deadline leaves the group.

The consumer's fetch task keeps polling whatever the handlers do, so the group's
``max.poll.interval`` never notices a hung handler; this does. Every record handed out
gets a deadline. At hand-out it is generous: ``WORKER_HANDLER_TIMEOUT`` +
``WORKER_RETRY_BUDGET`` + ``WORKER_KAFKA_WATCHDOG_MARGIN`` (the record may wait in the
worker's intake, a batch bucket or behind its key, before its work starts). From then on
the deadline follows the unit of work: each phase it starts (a transaction attempt, a
batch retry, each record of a batch's one-by-one fallback) calls ``keep_alive`` with the
time that phase may take, and the deadline becomes now + that + the margin.

A record past its deadline means the pump's own time limits did not end it: the member
lets its other records settle, commits, and leaves the group (:meth:`Member.leave`), so
its partitions, the overdue record included, go to the other members. Once nothing is
overdue (the hung work settled at last, or said it is alive) it joins again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from worker.brokers.kafka.partitions import Handle


class Member(Protocol):
    """What the watchdog asks of the consumer it guards."""

    @property
    def stopping(self) -> bool: ...

    async def leave(self, overdue: list[Handle]) -> None:
        """Settle what can be settled, commit, and leave the group."""
        ...

    def rejoin(self) -> None: ...


class Watchdog:
    """The deadline of every record handed out and not settled; ``limit`` None: no watchdog."""

    def __init__(
        self,
        limit: float | None,
        margin: float,
        stats: Counter[str],
        log: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit  # the deadline at hand-out, from then
        self.margin = margin
        self.left = False  # out of the group because a record is overdue
        self._due: dict[Handle, float] = {}
        self._stats = stats
        self._log = log
        self._clock = clock

    @property
    def enabled(self) -> bool:
        return self.limit is not None

    def arm(self, handle: Handle) -> None:
        """A record was handed out."""
        if self.limit is not None:
            self._due[handle] = self._clock() + self.limit

    def keep_alive(self, handle: Handle, seconds: float) -> None:
        """The record's work starts a phase that may take ``seconds``."""
        if handle in self._due:
            self._due[handle] = self._clock() + seconds + self.margin

    def disarm(self, handle: Handle) -> None:
        """The record was settled (or given back)."""
        self._due.pop(handle, None)

    def overdue(self) -> list[Handle]:
        now = self._clock()
        return [handle for handle, due in self._due.items() if due <= now]

    async def run(self, member: Member) -> None:
        """Leave the group while a record of an owned partition is overdue; rejoin once none is."""
        assert self.limit is not None
        step = max(0.05, min(1.0, self.limit / 4))
        while True:
            await asyncio.sleep(step)
            try:
                await self.check(member)
            except Exception as exc:  # aiokafka refused: try again next round, never go quiet
                self._stats["watchdog_errors"] += 1
                self._log.error("kafka watchdog step failed", error=exc, left=self.left)

    async def check(self, member: Member) -> None:
        """One round of :meth:`run`."""
        overdue = self.overdue()
        if self.left:
            if not overdue and not member.stopping:
                self.left = False
                member.rejoin()
                self._stats["watchdog_rejoins"] += 1
                self._log.info("no record overdue any more, rejoining the consumer group")
            return
        owned = [handle for handle in overdue if handle.partition.owned]
        if not owned:
            return
        self.left = True  # not ready, and no fetching, from here on
        for handle in owned:
            self._log.error(
                "record overdue, leaving the consumer group so its partitions move on",
                message_id=handle.message_id,
                partition=handle.partition.label,
                offset=handle.record.offset,
                attempt=handle.attempt,
                limit=self.limit,
            )
        try:
            await member.leave(owned)
        except Exception:
            self.left = False  # still in the group: the next round tries again
            raise
        self._stats["watchdog_leaves"] += 1
