"""The unit of work: what intake hands to a worker, the runners run, and settlement ends.

A :class:`Work` is one delivery, or N deliveries of one message type that share one
transaction per handler (batch mode). Whatever its size it passes through the same
stages, in :mod:`worker.pump`'s loop::

    intake (receive, refuse, lane, bucket) -> middleware -> runner, per handler -> settle

Each delivery is an :class:`Item`: its decoded messages, its key, and, once a stage
has run, the verdict that settles it and the consumer whose verdict that is.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from worker.delivery import Delivery
    from worker.registry import Handler
    from worker.verdict import Verdict

Messages = dict[type[BaseModel], BaseModel]
"""One delivery's body decoded once per model its handlers take."""


class Item:
    """One delivery inside a unit of work, and where its handlers left it."""

    __slots__ = (
        "arrival",
        "consumer",
        "counted",
        "deferred",
        "delivery",
        "key",
        "messages",
        "twins",
        "verdict",
    )

    def __init__(self, delivery: Delivery, messages: Messages, key: Hashable = None) -> None:
        self.delivery = delivery
        self.messages = messages
        self.key = key
        self.verdict: Verdict | None = None
        self.consumer: str | None = None  # whose verdict it is ("" before any handler)
        self.counted: str | None = None  # the consumer whose durable count this start moved
        self.twins: list[Item] = []  # later deliveries of the same id in one batch
        self.deferred = False  # lost to another writer inside a batch: runs again on its own
        self.arrival = 0  # its place in the order intake took deliveries

    @property
    def message_id(self) -> str:
        message_id = self.delivery.message_id
        assert message_id is not None  # intake refuses deliveries without one
        return message_id

    def message(self, handler: Handler[Any]) -> BaseModel:
        return self.messages[handler.model]

    def __repr__(self) -> str:
        return f"<Item {self.delivery!r} verdict={self.verdict}>"


@dataclass(slots=True, eq=False)
class Work:
    """One unit of work: its items, the handlers of their type, and how it must run.

    ``batch``: the items share one transaction per handler (a batch, even of one).
    ``alone``: a suspect, run with nothing else in flight in the process.
    ``lanes``: what it holds while it runs (keys, delivery groups); work that shares a
    lane waits for it. ``over_limit``: delivered more than WORKER_MAX_DELIVERIES times
    by the broker's own count. A refused work has no handlers and a verdict set.
    """

    items: list[Item]
    handlers: tuple[Handler[Any], ...] = ()
    batch: bool = False
    alone: bool = False
    lanes: frozenset[tuple[str, Hashable]] = frozenset()
    seed: bool = False
    started: float = 0.0  # time.monotonic() when a worker took it

    @property
    def refused(self) -> bool:
        return not self.handlers

    @property
    def deliveries(self) -> list[Delivery]:
        return [item.delivery for item in self.items]

    @property
    def size(self) -> int:
        return len(self.items) + sum(len(item.twins) for item in self.items)


@dataclass(slots=True, eq=False)
class Stage:
    """One handler over the live items of a unit of work: what a runner runs.

    ``last``: the type's last handler, whose commit carries the adapter's own writes
    (``Settler.in_commit``).
    """

    work: Work
    handler: Handler[Any]
    items: list[Item]
    last: bool = True
