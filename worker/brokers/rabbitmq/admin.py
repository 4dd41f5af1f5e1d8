"""``worker publish`` and ``worker dlq`` on RabbitMQ: the :class:`~worker.brokers.Admin`.

Short-lived and separate from the consumer: an operator tool opens a plain connection,
does its job and leaves. It declares nothing: a queue or exchange that does not exist
(a typo in WORKER_RABBITMQ_QUEUE, say) is a one-line error, never a new queue bound to
the shared exchange that would collect copies nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import unquote, urlsplit

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue
from aiormq.exceptions import ChannelNotFoundEntity, DeliveryError

from worker.brokers import (
    DEFAULT_SCAN,
    DeadLetterFilter,
    DeadLetterInfo,
    IdentityFunc,
    OutgoingMessage,
)
from worker.brokers.rabbitmq.messages import (
    REASON_HEADER,
    copy_message,
    dead_lettered_at,
    header_int,
    header_text,
    message_type,
)
from worker.brokers.rabbitmq.settings import (
    CONNECTION_LOST,
    RabbitMQSettings,
    connect_args,
    start_failure,
)
from worker.errors import BrokerUnavailable, ConfigurationError, PublishStopped
from worker.logs import scrub
from worker.startup import reason as error_reason

_PUBLISH_BATCH = 256


class RabbitMQAdmin:
    """``worker publish`` and ``worker dlq``: short-lived, plain (not robust) connection."""

    def __init__(self, settings: RabbitMQSettings, identity: IdentityFunc) -> None:
        self.settings = settings
        self.identity = identity
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None

    async def _open(self) -> AbstractChannel:
        if self._channel is None:
            try:
                self._connection = await aio_pika.connect(
                    self.settings.url, **connect_args(self.settings)
                )
                self._channel = await self._connection.channel(on_return_raises=True)
            except CONNECTION_LOST as exc:
                await self.close()
                raise start_failure(self.settings, exc) from None
        return self._channel

    async def _require(self, kind: str, name: str) -> None:
        """Look for a queue or exchange (a passive declare, on a channel of its own, which
        a missing one closes); declare nothing. Missing: a one-line configuration error."""
        await self._open()
        assert self._connection is not None
        channel = None
        try:
            channel = await self._connection.channel()
            if kind == "queue":
                await channel.get_queue(name, ensure=True)
            else:
                await channel.get_exchange(name, ensure=True)
        except ChannelNotFoundEntity:
            vhost = unquote(urlsplit(self.settings.url).path[1:]) or "/"
            variable = "EXCHANGE" if kind == "exchange" else "QUEUE"
            value = self.settings.exchange if kind == "exchange" else self.settings.queue
            raise ConfigurationError(
                f"WORKER_RABBITMQ_{variable}={value!r}: {kind} {name!r} does not exist in "
                f"virtual host {vhost!r}; nothing was declared (check the name: `worker run` "
                "declares its queues when it starts)"
            ) from None
        except CONNECTION_LOST as exc:
            raise BrokerUnavailable(f"looking for {kind} {name!r}: {error_reason(exc)}") from None
        finally:
            if channel is not None:
                with contextlib.suppress(*CONNECTION_LOST):
                    await channel.close()

    async def publish(self, messages: list[OutgoingMessage]) -> int:
        """Publish to the exchange with the type as routing key, in confirmed batches.

        Raises :class:`PublishStopped` naming which messages were confirmed when one is
        refused (unroutable) or the connection goes.
        """
        settings = self.settings
        if settings.exchange:
            await self._require("exchange", settings.exchange)
        else:
            await self._require("queue", settings.queue)
        channel = await self._open()
        if settings.exchange:
            exchange = await channel.get_exchange(settings.exchange, ensure=False)
        else:
            exchange = channel.default_exchange

        async def send(item: OutgoingMessage) -> None:
            message = aio_pika.Message(
                item.body,
                headers=dict(item.headers),
                message_id=item.message_id,
                type=item.type,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            key = item.type if settings.exchange else settings.queue
            try:
                await exchange.publish(message, key)
            except DeliveryError:  # returned: unroutable
                raise ConfigurationError(
                    f"WORKER_RABBITMQ_BINDING_KEYS={settings.binding_keys}: routing key {key!r} "
                    f"(message {item.message_id!r}) reaches no queue"
                ) from None

        confirmed: list[int] = []
        for start in range(0, len(messages), _PUBLISH_BATCH):
            batch = messages[start : start + _PUBLISH_BATCH]
            results = await asyncio.gather(*(send(m) for m in batch), return_exceptions=True)
            failed = None
            for offset, result in enumerate(results):
                if result is None:
                    confirmed.append(start + offset)
                elif failed is None:
                    failed = result
            if isinstance(failed, ConfigurationError):
                raise PublishStopped(str(failed), confirmed, configuration=True)
            if isinstance(failed, CONNECTION_LOST):  # the connection went (a broker restart)
                raise PublishStopped(
                    f"publishing to {settings.exchange or settings.queue!r}: "
                    f"{scrub(error_reason(failed))}",
                    confirmed,
                )
            if isinstance(failed, BaseException):
                raise failed
        return len(confirmed)

    async def dead_letters(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> list[DeadLetterInfo]:
        """Peek: take up to ``scan`` unacked, keep the matching ones, then give them all back.

        The dead-letter queue is a classic queue: a message taken unacked and given
        back by closing the channel returns to its place, and nothing counts it.
        """
        letters: list[DeadLetterInfo] = []
        async with self._scanning() as dead:
            for _ in range(scan):
                if len(letters) >= limit:
                    break
                message = await dead.get(no_ack=False, fail=False)
                if message is None:
                    break
                letter = self._describe(message)
                if match is None or match(letter):
                    letters.append(letter)
        return letters

    async def resubmit(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> int:
        """Move matching dead letters to the work queue with a fresh delivery count.

        Each is taken unacked, copied (publisher-confirmed), then acked; the others
        stay unacked until the scan ends and return to their places, in order.
        """
        await self._require("queue", self.settings.queue)
        channel = await self._open()
        moved = 0
        async with self._scanning() as dead:
            for _ in range(scan):
                if moved >= limit:
                    break
                message = await dead.get(no_ack=False, fail=False)
                if message is None:
                    break
                if match is not None and not match(self._describe(message)):
                    continue
                resubmits = header_int((message.headers or {}).get("x-worker-resubmitted")) + 1
                copy = copy_message(message, **{"x-worker-resubmitted": resubmits})
                try:  # the dead letter is acked only once its copy is confirmed
                    async with asyncio.timeout(self.settings.settle_timeout):
                        await channel.default_exchange.publish(copy, self.settings.queue)
                except CONNECTION_LOST as exc:  # returned, refused, unconfirmed in time
                    raise BrokerUnavailable(
                        f"re-submitting to {self.settings.queue!r}: {scrub(error_reason(exc))}; "
                        f"{moved} moved before, the rest are still in "
                        f"{self.settings.dead_letter_queue!r}"
                    ) from None
                try:
                    await message.ack()
                except CONNECTION_LOST as exc:
                    raise BrokerUnavailable(
                        f"re-submitting to {self.settings.queue!r}: {scrub(error_reason(exc))} "
                        f"after the copy of {message.message_id!r} was confirmed: it is in both "
                        f"queues, and the inbox absorbs the second ({moved} moved before)"
                    ) from None
                moved += 1
        return moved

    @contextlib.asynccontextmanager
    async def _scanning(self) -> AsyncIterator[AbstractQueue]:
        """The dead-letter queue on a channel of its own: closing it gives back what was taken."""
        await self._require("queue", self.settings.dead_letter_queue)
        assert self._connection is not None
        scan = None
        try:
            scan = await self._connection.channel(publisher_confirms=False)
            yield await scan.get_queue(self.settings.dead_letter_queue, ensure=False)
        except CONNECTION_LOST as exc:
            raise BrokerUnavailable(
                f"reading {self.settings.dead_letter_queue!r}: {scrub(str(exc))}"
            ) from None
        finally:
            if scan is not None:
                with contextlib.suppress(*CONNECTION_LOST):
                    await scan.close()  # unacked messages return to the queue

    def _describe(self, message: AbstractIncomingMessage) -> DeadLetterInfo:
        headers = dict(message.headers or {})
        reason = header_text(headers, REASON_HEADER)
        deaths = headers.get("x-death")
        first = deaths[0] if isinstance(deaths, list) and deaths else None
        first = first if isinstance(first, dict) else {}
        if reason is None:  # dead-lettered by the broker itself (a policy, a TTL)
            why, queue = header_text(first, "reason"), header_text(first, "queue")
            reason = f"broker: {why or 'unknown'} in {queue}"
        return DeadLetterInfo(
            self.identity(message),
            message_type(message),
            reason,
            message.body,
            headers,
            dead_lettered_at(headers, first) or message.timestamp,
        )

    async def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(*CONNECTION_LOST):
                await self._connection.close()
        self._connection = self._channel = None
