"""What a handler gets besides its message: the worker's session and the delivery's facts."""

from __future__ import annotations

from typing import Any

from worker.db import PumpSession
from worker.outbox.publish import add as outbox_add


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
        sequence = self._published
        self._published += 1
        return await outbox_add(
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
