"""The transport seam: a small Protocol every broker adapter implements.

An adapter turns the broker's messages into :class:`~worker.delivery.Delivery`
objects (extracting the dedup key and the message type) and maps the three
settlement verbs onto the broker's own. The pump knows nothing else about it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from worker.errors import ConfigurationError

if TYPE_CHECKING:
    from worker.delivery import Delivery
    from worker.settings import Settings


class Broker(Protocol):
    """What the pump needs from a transport."""

    name: str

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


class Admin(Protocol):
    """Operator tools behind ``worker publish`` and ``worker dlq``, one per broker module."""

    async def publish(self, messages: list[OutgoingMessage]) -> int:
        """Send messages to the worker's input; returns how many were sent."""
        ...

    async def dead_letters(self, limit: int) -> list[DeadLetterInfo]:
        """Peek at up to ``limit`` dead letters without removing them."""
        ...

    async def resubmit(self, limit: int) -> int:
        """Move up to ``limit`` dead letters back to the input; returns how many moved."""
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
