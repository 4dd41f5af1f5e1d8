"""Handler registration: one decorator naming the message type and its pydantic model."""

from __future__ import annotations

import enum
import importlib
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, overload

from pydantic import BaseModel

from worker.db import PumpSession
from worker.errors import ConfigurationError

M = TypeVar("M", bound=BaseModel)


class Context:
    """What a handler gets besides its message: the pump's session and the delivery's facts."""

    __slots__ = (
        "_published",
        "attempt",
        "consumer",
        "delivery_count",
        "headers",
        "message_id",
        "session",
    )

    def __init__(
        self,
        session: PumpSession,
        message_id: str,
        consumer: str,
        delivery_count: int,
        attempt: int,
        headers: Any,
    ) -> None:
        self.session = session
        self.message_id = message_id
        self.consumer = consumer
        self.delivery_count = delivery_count
        self.attempt = attempt
        self.headers = headers
        self._published = 0  # the outbox sequence: the same ids on every re-run

    async def publish(
        self,
        message_type: str,
        body: Any,
        *,
        key: str | None = None,
        headers: dict[str, Any] | None = None,
        destination: str | None = None,
    ) -> str:
        """Publish through the outbox: a row in this session, sent after the commit.

        Nothing leaves the process until the pump commits; a rollback takes the event
        with it. ``body`` is a pydantic model, a JSON-able dict, bytes or text. The
        returned id is derived from this message's id, the consumer and the call's
        position in the handler, so a re-run publishes the same ids. ``key`` picks
        the Kafka partition and, with ``WORKER_OUTBOX_ORDERED``, the order.
        """
        from worker.outbox.publish import add

        sequence = self._published
        self._published += 1
        return await add(
            self,
            sequence,
            message_type,
            body,
            key=key,
            headers=headers,
            destination=destination,
        )


class BatchContext:
    """What a batch handler gets: the pump's session and the facts of every message in it.

    ``message_ids``, ``delivery_counts`` and ``headers`` run parallel to the messages;
    ``message(i)`` is the i-th message's own :class:`Context` (for ``publish``).
    """

    __slots__ = (
        "_contexts",
        "attempt",
        "consumer",
        "delivery_counts",
        "headers",
        "message_ids",
        "session",
    )

    def __init__(
        self,
        session: PumpSession,
        consumer: str,
        attempt: int,
        message_ids: list[str],
        delivery_counts: list[int],
        headers: list[Any],
    ) -> None:
        self._contexts: list[Context | None] = [None] * len(message_ids)
        self.session = session
        self.consumer = consumer
        self.attempt = attempt
        self.message_ids = message_ids
        self.delivery_counts = delivery_counts
        self.headers = headers

    @classmethod
    def of(cls, context: Context) -> BatchContext:
        """A batch of one: how a batch handler runs one message at a time."""
        batch = cls(
            context.session,
            context.consumer,
            context.attempt,
            [context.message_id],
            [context.delivery_count],
            [context.headers],
        )
        batch._contexts[0] = context
        return batch

    def message(self, index: int) -> Context:
        context = self._contexts[index]
        if context is None:
            context = self._contexts[index] = Context(
                self.session,
                self.message_ids[index],
                self.consumer,
                self.delivery_counts[index],
                self.attempt,
                self.headers[index],
            )
        return context


HandlerFunc = Callable[[Context, M], Awaitable[None]]
BatchHandlerFunc = Callable[[BatchContext, Sequence[M]], Awaitable[None]]


class Runs(enum.Enum):
    """Which runner a handler's deliveries go through (the pump holds one of each)."""

    TRANSACTION = "transaction"
    """worker.transaction: marker and writes in one commit per attempt."""
    CLAIM = "claim"
    """worker.claims: a leased two-phase claim around a call outside the database."""


@dataclass(frozen=True, slots=True)
class Handler(Generic[M]):
    """One registered handler. ``func`` always takes one message; for a batch handler it
    calls ``batch`` with a one-element list, so every per-message path runs it unchanged."""

    message_type: str
    model: type[M]
    func: HandlerFunc[M]
    consumer: str
    inbox: bool
    runs: Runs = Runs.TRANSACTION
    key: Callable[[M], Hashable] | None = None
    batch: BatchHandlerFunc[M] | None = None

    @property
    def batchable(self) -> bool:
        """Whether batch mode may run it inside a shared transaction (claims and keys: no)."""
        return self.runs is Runs.TRANSACTION and self.key is None


class Registry:
    """Message type -> the handlers that consume it, each under its own consumer name."""

    def __init__(self) -> None:
        self._by_type: dict[str, tuple[Handler[Any], ...]] = {}

    @overload
    def handler(
        self,
        message_type: str,
        model: type[M],
        *,
        consumer: str | None = None,
        inbox: bool = True,
        side_effect: bool = False,
        key: Callable[[M], Hashable] | None = None,
        batch: Literal[False] = False,
    ) -> Callable[[HandlerFunc[M]], HandlerFunc[M]]: ...

    @overload
    def handler(
        self,
        message_type: str,
        model: type[M],
        *,
        consumer: str | None = None,
        inbox: bool = True,
        side_effect: bool = False,
        key: Callable[[M], Hashable] | None = None,
        batch: Literal[True],
    ) -> Callable[[BatchHandlerFunc[M]], BatchHandlerFunc[M]]: ...

    def handler(
        self,
        message_type: str,
        model: type[M],
        *,
        consumer: str | None = None,
        inbox: bool = True,
        side_effect: bool = False,
        key: Callable[[M], Hashable] | None = None,
        batch: bool = False,
    ) -> Callable[[Any], Any]:
        """Register ``func`` for ``message_type``.

        ``consumer`` names the inbox marker; it defaults to the function's
        dotted path, so renaming the function renames the consumer (set it
        explicitly in production). ``inbox=False`` opts a handler that is
        idempotent by nature (an upsert of an absolute value) out of the inbox.
        ``side_effect=True`` makes it a two-phase claim handler for calls that
        cannot join the transaction (see :mod:`worker.claims`).

        ``key`` serializes work inside the process: deliveries whose messages map to
        equal keys (``key=lambda m: m.account_id``) run one after another, in the
        order they arrived, while other keys run in parallel. Use it for hot rows:
        writers of one row then queue instead of colliding on its version token.
        Keys are shared across message types, so two types that write the same row
        should return the same key for it.

        ``batch=True`` registers a batch handler, ``async def f(ctx: BatchContext,
        messages: Sequence[Model])``, for set-based SQL over many messages in one
        transaction (WORKER_BATCH_SIZE, docs/batch.md). It is called with a one-element
        list outside batch mode and when a failed batch falls back to one at a time.
        """
        if side_effect and not inbox:
            raise ConfigurationError(f"{message_type}: a side-effect handler needs the inbox")

        def register(func: Any) -> Any:
            name = consumer or f"{func.__module__}.{func.__qualname__}"
            if name in self.consumers():
                raise ConfigurationError(f"consumer name {name!r} is registered twice")
            if batch and (side_effect or key is not None):
                what = "side_effect=True" if side_effect else "key="
                raise ConfigurationError(
                    f"handler {name!r}: batch=True cannot be combined with {what} "
                    "(claims and keyed handlers run one message at a time)"
                )
            one = _one_at_a_time(func) if batch else func
            entry: Handler[M] = Handler(
                message_type,
                model,
                one,
                name,
                inbox,
                Runs.CLAIM if side_effect else Runs.TRANSACTION,
                key,
                func if batch else None,
            )
            self._by_type[message_type] = (*self._by_type.get(message_type, ()), entry)
            return func

        return register

    def for_type(self, message_type: str | None) -> tuple[Handler[Any], ...]:
        return self._by_type.get(message_type, ()) if message_type else ()

    @property
    def keyed(self) -> bool:
        """Whether any handler serializes by key (the pump then prefetches more)."""
        return any(h.key is not None for h in self)

    def consumers(self) -> set[str]:
        return {h.consumer for group in self._by_type.values() for h in group}

    @property
    def message_types(self) -> list[str]:
        return sorted(self._by_type)

    def __iter__(self) -> Iterator[Handler[Any]]:
        return (h for group in self._by_type.values() for h in group)


def _one_at_a_time(batch: BatchHandlerFunc[M]) -> HandlerFunc[M]:
    async def one(context: Context, message: M) -> None:
        await batch(BatchContext.of(context), [message])

    return one


registry = Registry()
"""The default registry that ``@handler`` fills and ``worker run`` serves."""

handler = registry.handler


def import_handlers(modules: Iterable[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigurationError(f"WORKER_HANDLERS: cannot import {name!r}: {exc}") from None
