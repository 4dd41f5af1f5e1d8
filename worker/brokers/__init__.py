"""The transport seam: a small Protocol every broker adapter implements.

An adapter turns the broker's messages into :class:`~worker.delivery.Delivery`
objects (extracting the dedup key and the message type) and maps the three
settlement verbs onto the broker's own. The pump knows nothing else about it.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from worker.delivery import Settler
from worker.errors import ConfigurationError

if TYPE_CHECKING:
    from worker.delivery import Delivery
    from worker.settings import Settings


class Broker(Settler, Protocol):
    """What the pump needs from a transport: deliveries in, and their settlement verbs."""

    name: str
    destination: str
    """The queue, topic or subscription consumed: span names and logs say which."""
    stats: Counter[str]
    """The adapter's own event tallies (reconnects, lost acks, ...), exported to Prometheus
    as ``worker_broker_events_total{broker, event}``; plain counts, read at scrape time."""

    @property
    def ready(self) -> bool:
        """Connected and consuming (readiness probes report this)."""
        ...

    async def start(self, prefetch: int) -> None:
        """Connect, declare what is needed, start consuming at most ``prefetch`` unsettled."""
        ...

    async def receive(self) -> Delivery:
        """Wait for the next delivery. Cancel-safe: a cancelled wait takes nothing."""
        ...

    async def stop_receiving(self) -> None:
        """Stop taking new deliveries; in-flight ones may still be settled."""
        ...

    async def close(self) -> None:
        """Drop the connection; whatever is unsettled goes back to the broker."""
        ...


IdentityFunc = Callable[[Any], "str | None"]


def load_identity(path: str | None, default: IdentityFunc) -> IdentityFunc:
    """Resolve ``WORKER_MESSAGE_ID_FUNC`` ("module:function") or fall back to the default.

    The function receives the broker's raw message and returns the dedup key, or
    ``None`` when it has none (the pump dead-letters such a message).
    """
    if not path:
        return default
    module_name, _, attr = path.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigurationError(f"WORKER_MESSAGE_ID_FUNC: cannot import {path!r}: {exc}") from None
    if not callable(func):
        raise ConfigurationError(f"WORKER_MESSAGE_ID_FUNC: {path!r} is not callable")
    return func  # type: ignore[no-any-return]


DEFAULT_SCAN = 10_000
"""Dead letters one ``worker dlq`` call looks at, at most (``--scan``)."""


class Admin(Protocol):
    """Operator tools behind ``worker publish`` and ``worker dlq``, one per broker module.

    ``match`` selects dead letters (``None``: all); ``scan`` bounds how many dead
    letters one call looks at, so a queue of millions costs a bounded amount.
    """

    async def publish(self, messages: list[OutgoingMessage]) -> int:
        """Send messages to the worker's input; returns how many were sent."""
        ...

    async def dead_letters(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> list[DeadLetterInfo]:
        """Peek at up to ``limit`` matching dead letters, oldest first, changing nothing."""
        ...

    async def resubmit(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> int:
        """Move up to ``limit`` matching dead letters back to the input; returns how many moved.

        Each move is a confirmed copy, then the removal of the original; dead letters
        that do not match stay where they are.
        """
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """One line of ``worker publish`` input: ``{"id": ..., "type": ..., "body": {...}}``."""

    message_id: str | None
    type: str
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DeadLetterInfo:
    message_id: str | None
    type: str | None
    reason: str
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    dead_lettered_at: datetime | None = None  # None: the broker did not say


@dataclass(frozen=True, slots=True)
class DeadLetterFilter:
    """Which dead letters ``worker dlq`` lists or re-submits; the empty filter takes all.

    A letter matches when every given criterion holds: its type is one of ``types``,
    ``reason`` is a substring of its reason (case-insensitive), it was dead-lettered
    at or after ``since`` (a letter whose time is unknown does not match), its
    message id is one of ``ids``; with ``with_id``, it has a message id at all.
    """

    types: frozenset[str] = frozenset()
    reason: str | None = None
    since: datetime | None = None
    ids: frozenset[str] = frozenset()
    with_id: bool = False

    @property
    def everything(self) -> bool:
        return not (self.types or self.reason or self.since or self.ids)

    def __call__(self, letter: DeadLetterInfo) -> bool:
        if self.with_id and letter.message_id is None:
            return False
        if self.types and letter.type not in self.types:
            return False
        if self.ids and letter.message_id not in self.ids:
            return False
        if self.reason and self.reason.casefold() not in letter.reason.casefold():
            return False
        if self.since is not None:
            at = letter.dead_lettered_at
            if at is None or _aware(at) < _aware(self.since):
                return False
        return True


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _adapter_module(settings: Settings) -> Any:
    try:
        return importlib.import_module(f"worker.brokers.{settings.broker}")
    except ModuleNotFoundError as exc:
        raise ConfigurationError(
            f"WORKER_BROKER: {settings.broker!r} is not available: {exc}"
        ) from None


def open_broker(settings: Settings) -> Broker:
    """Build the adapter named by ``WORKER_BROKER``; imports only that adapter's SDK.

    Every adapter module exposes ``open_broker(settings) -> Broker`` and
    ``open_admin(settings) -> Admin``.
    """
    broker: Broker = _adapter_module(settings).open_broker(settings)
    return broker


def open_admin(settings: Settings) -> Admin:
    admin: Admin = _adapter_module(settings).open_admin(settings)
    return admin
