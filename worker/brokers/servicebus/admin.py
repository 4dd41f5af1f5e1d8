"""``worker publish`` and ``worker dlq`` on Service Bus: sending to the entity, listing
its dead-letter queue, and moving dead letters back.

Apart from the consumer: an operator tool opens its own client, peeks and receives
on the ``$DeadLetterQueue`` sub-queue, and never takes part in the pump's locks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage, ServiceBusSubQueue
from azure.servicebus.exceptions import MessageSizeExceededError, ServiceBusError

from worker.brokers import DEFAULT_SCAN, DeadLetterFilter, DeadLetterInfo, OutgoingMessage
from worker.brokers.servicebus.client import (
    SEND_CHUNK,
    Client,
    ClientFactory,
    Receiver,
    Sender,
    describe,
    quietly,
)
from worker.brokers.servicebus.messages import (
    TypeResolver,
    application_properties,
    body_of,
    default_message_id,
    resubmission,
)
from worker.brokers.servicebus.settings import ServiceBusSettings
from worker.errors import BrokerUnavailable


class ServiceBusAdmin:
    """``worker publish`` and ``worker dlq`` for one queue or topic subscription.

    Re-submitting from a subscription's dead-letter queue publishes to the topic,
    so every subscription gets the copy: the others' inboxes drop it only if they
    deduplicate by message id too.
    """

    def __init__(
        self,
        settings: ServiceBusSettings,
        client_factory: ClientFactory,
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self._factory = client_factory
        self._on_close = on_close
        self._client: Client | None = None
        self._type_of = TypeResolver(settings)

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = self._factory()
        return self._client

    def _sender(self) -> Sender:
        settings = self.settings
        if settings.queue:
            return self.client.get_queue_sender(settings.queue)
        assert settings.topic is not None
        return self.client.get_topic_sender(settings.topic)

    def _dead_letter_receiver(self) -> Receiver:
        settings = self.settings
        options: dict[str, Any] = {"sub_queue": ServiceBusSubQueue.DEAD_LETTER}
        if settings.queue:
            return self.client.get_queue_receiver(settings.queue, **options)
        assert settings.topic and settings.subscription
        return self.client.get_subscription_receiver(
            settings.topic, settings.subscription, **options
        )

    def outgoing(self, message: OutgoingMessage) -> ServiceBusMessage:
        properties: dict[str | bytes, Any] = {k: _simple(v) for k, v in message.headers.items()}
        properties[self.settings.type_property] = message.type
        outgoing = ServiceBusMessage(
            message.body,
            message_id=message.message_id,
            subject=message.type,
            content_type="application/json",
            application_properties=properties,
        )
        # The SDK invents a random id when none is given; a line without an id must
        # stay without one (the pump dead-letters it, as on every other broker).
        outgoing.message_id = message.message_id
        return outgoing

    async def publish(self, messages: list[OutgoingMessage]) -> int:
        async with self._translated("publishing"):
            return await self.send([self.outgoing(m) for m in messages])

    async def send(self, messages: list[ServiceBusMessage]) -> int:
        sender = self._sender()
        try:
            for start in range(0, len(messages), SEND_CHUNK):
                chunk = messages[start : start + SEND_CHUNK]
                try:
                    await sender.send_messages(chunk)
                except MessageSizeExceededError:  # the chunk is over the batch limit: one by one
                    for message in chunk:
                        await sender.send_messages(message)
        finally:
            await sender.close()
        return len(messages)

    async def dead_letters(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> list[DeadLetterInfo]:
        """Peek (no lock, no delivery count) at up to ``scan`` dead letters; keep the matching."""
        receiver = self._dead_letter_receiver()
        letters: list[DeadLetterInfo] = []
        scanned = 0
        try:
            async with self._translated("peeking at dead letters"):
                await receiver.__aenter__()
                sequence = 0
                while len(letters) < limit and scanned < scan:
                    page = await receiver.peek_messages(
                        min(100, scan - scanned), sequence_number=sequence
                    )
                    if not page:
                        break
                    scanned += len(page)
                    found = (self._info(message) for message in page)
                    letters.extend(f for f in found if match is None or match(f))
                    sequence = (page[-1].sequence_number or 0) + 1
        finally:
            await quietly(receiver.close())
        return letters[:limit]

    def _info(self, message: ServiceBusReceivedMessage) -> DeadLetterInfo:
        reason = message.dead_letter_reason or "unknown"
        if message.dead_letter_error_description:
            reason = f"{reason}: {message.dead_letter_error_description}"
        return DeadLetterInfo(
            default_message_id(message),
            self._type_of(message),
            reason,
            body_of(message),
            application_properties(message),
            # Service Bus records no dead-letter time: the time the message was enqueued
            message.enqueued_time_utc,
        )

    async def resubmit(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> int:
        """Copy each matching dead letter to the entity, then complete it.

        A crash in between duplicates (the inbox absorbs it). Dead letters that do
        not match stay locked until the scan ends, then are abandoned: they keep
        their sequence numbers (their order), and their delivery count grows by one,
        which nothing acts on in a dead-letter queue.
        """
        receiver = self._dead_letter_receiver()
        moved = scanned = 0
        held: list[ServiceBusReceivedMessage] = []
        try:
            async with self._translated("re-submitting dead letters"):
                await receiver.__aenter__()
                while moved < limit and scanned < scan:
                    wanted = limit - moved if match is None else scan - scanned
                    batch = await receiver.receive_messages(
                        min(SEND_CHUNK, wanted), max_wait_time=self.settings.receive_wait
                    )
                    if not batch:
                        break
                    scanned += len(batch)
                    chosen: list[ServiceBusReceivedMessage] = []
                    for message in batch:
                        wanted_more = moved + len(chosen) < limit
                        if wanted_more and (match is None or match(self._info(message))):
                            chosen.append(message)
                        else:
                            held.append(message)
                    if chosen:
                        await self.send([resubmission(message) for message in chosen])
                        for message in chosen:
                            await receiver.complete_message(message)
                        moved += len(chosen)
        finally:
            for message in held:
                await quietly(receiver.abandon_message(message))
            await quietly(receiver.close())
        return moved

    @contextlib.asynccontextmanager
    async def _translated(self, what: str) -> AsyncIterator[None]:
        """Service Bus errors become :class:`BrokerUnavailable`, naming the entity."""
        try:
            yield
        except ServiceBusError as exc:
            entity = self.settings.queue or f"{self.settings.topic}/{self.settings.subscription}"
            raise BrokerUnavailable(f"service bus {entity!r}, {what}: {describe(exc)}") from None

    async def close(self) -> None:
        if self._client is not None:
            await quietly(self._client.close())
        if self._on_close is not None:
            await self._on_close()


def _simple(value: Any) -> Any:
    """Application property values must be simple AMQP types."""
    if value is None or isinstance(value, str | bytes | int | float | bool):
        return value
    return json.dumps(value, default=str)


__all__ = ["ServiceBusAdmin"]
