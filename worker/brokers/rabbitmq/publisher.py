"""The outbox relay's RabbitMQ :class:`~worker.brokers.publishers.Publisher`.

It has a connection of its own (a relay may run without a consumer), and it publishes
with confirms, so a row leaves the outbox only once RabbitMQ has taken its message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import aio_pika
from aiormq.exceptions import AMQPError, ChannelNotFoundEntity, DeliveryError

from worker.brokers.outgoing import Outgoing
from worker.brokers.rabbitmq.settings import RabbitMQSettings, connect_args, start_failure
from worker.errors import BrokerUnavailable
from worker.logs import scrub


class RabbitMQPublisher:
    """aio-pika on its own robust connection; a channel with publisher confirms.

    Every message is published ``mandatory``: a message no queue is bound for comes
    back (``basic.return``) and counts as refused instead of vanishing. A confirm
    that does not arrive within ``timeout`` means the broker is not answering.
    """

    name = "rabbitmq"

    def __init__(self, settings: RabbitMQSettings, timeout: float) -> None:
        self.settings = settings
        self.timeout = timeout
        self._connection: Any = None
        self._channel: Any = None
        self._exchanges: dict[str, Any] = {}

    async def _open(self) -> Any:
        if self._connection is None:
            try:
                self._connection = await aio_pika.connect_robust(
                    self.settings.url,
                    reconnect_interval=self.settings.reconnect_interval,
                    **connect_args(self.settings),
                )
            except Exception as exc:
                self._connection = None
                raise start_failure(self.settings, exc) from None
        if self._channel is None or self._channel.is_closed:
            try:
                async with asyncio.timeout(self.timeout):
                    self._channel = await self._connection.channel(
                        publisher_confirms=True, on_return_raises=True
                    )
            except Exception as exc:
                raise BrokerUnavailable(f"rabbitmq channel: {scrub(str(exc))}") from None
            self._exchanges = {}
        return self._channel

    def _route(self, message: Outgoing) -> tuple[str, str]:
        destination = message.destination
        if destination is None:
            return self.settings.exchange, message.type
        exchange, slash, routing_key = destination.partition("/")
        if not slash:
            return self.settings.exchange, destination
        return exchange, routing_key

    async def _exchange(self, name: str) -> Any:
        """The exchange, checked once (passively, on a throwaway channel): None if missing.

        A publish to a missing exchange closes the channel, failing every other
        publish in flight on it; checking first keeps the refusal on its own rows.
        """
        exchange = self._exchanges.get(name)
        if exchange is not None:
            return exchange
        channel = await self._open()
        if not name:
            exchange = self._exchanges[name] = channel.default_exchange
            return exchange
        probe = await self._connection.channel(publisher_confirms=False)
        try:
            await probe.get_exchange(name, ensure=True)
        except ChannelNotFoundEntity:
            return None
        finally:
            with contextlib.suppress(Exception):
                await probe.close()
        exchange = self._exchanges[name] = await channel.get_exchange(name, ensure=False)
        return exchange

    async def publish(self, messages: Sequence[Outgoing]) -> list[str | None]:
        async def send(message: Outgoing, exchange: Any, routing_key: str) -> str | None:
            amqp = aio_pika.Message(
                message.body,
                headers=dict(message.headers),
                message_id=message.message_id,
                type=message.type,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            try:
                await exchange.publish(amqp, routing_key, mandatory=True)
            except DeliveryError as exc:  # returned (unroutable: PublishError) or nacked
                what = "unroutable" if exc.message is not None else "refused by the broker"
                return f"{what}: exchange {exchange.name!r}, routing key {routing_key!r}"
            return None

        try:
            async with asyncio.timeout(self.timeout):
                results: list[str | None] = [None] * len(messages)
                sends = {}
                for index, message in enumerate(messages):
                    exchange_name, routing_key = self._route(message)
                    exchange = await self._exchange(exchange_name)
                    if exchange is None:
                        results[index] = f"no exchange {exchange_name!r}"
                    else:
                        sends[index] = send(message, exchange, routing_key)
                done = await asyncio.gather(*sends.values())
        except TimeoutError:
            raise BrokerUnavailable(f"rabbitmq: no confirms within {self.timeout}s") from None
        except (AMQPError, OSError, RuntimeError) as exc:  # connection or channel lost
            self._channel, self._exchanges = None, {}  # exchanges belong to their channel
            raise BrokerUnavailable(f"rabbitmq: {scrub(str(exc))}") from None
        for index, result in zip(sends, done, strict=True):
            results[index] = result
        return results

    async def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
        self._connection = self._channel = None
