"""The queues and exchanges the worker uses, declared idempotently by the worker and by
``worker publish`` / ``worker dlq`` (``Q`` is ``WORKER_RABBITMQ_QUEUE``)::

    exchange (WORKER_RABBITMQ_EXCHANGE) --binding keys--> Q  (quorum; its DLX is Q.dlx)
    Q.delay.<ms>ms  (quorum, x-message-ttl=<ms>, at-least-once dead-lettering)
        --TTL expiry, default exchange--> Q
    Q.dlx (fanout) --> Q.dlq  (the dead-letter queue, classic: peeking is free)

Also the migration from older versions' queues (drained at start) and the teardown
tests and benchmarks use; docs/rabbitmq.md explains the design.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue
from aiormq.exceptions import ChannelNotFoundEntity

from worker.brokers.rabbitmq.messages import WORKER_HEADERS, copy_message
from worker.brokers.rabbitmq.settings import CONNECTION_LOST

if TYPE_CHECKING:
    from worker.brokers.rabbitmq.settings import RabbitMQSettings


async def declare_topology(channel: AbstractChannel, settings: RabbitMQSettings) -> AbstractQueue:
    """Declare (idempotently) everything the worker uses; returns the work queue."""
    dlx = await channel.declare_exchange(
        settings.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
    )
    dead = await channel.declare_queue(
        settings.dead_letter_queue, durable=True, arguments={"x-queue-type": "classic"}
    )
    await dead.bind(dlx, routing_key="")
    work = await channel.declare_queue(
        settings.queue,
        durable=True,
        arguments={
            "x-queue-type": settings.queue_type,
            # where the broker itself dead-letters (a delivery-limit policy, a message TTL)
            "x-dead-letter-exchange": settings.dead_letter_exchange,
        },
    )
    if settings.exchange:
        exchange = await channel.declare_exchange(
            settings.exchange, aio_pika.ExchangeType(settings.exchange_type), durable=True
        )
        for key in settings.binding_keys:
            await work.bind(exchange, routing_key=key)
    for delay in settings.retry_delays:
        await channel.declare_queue(
            settings.retry_queue(delay),
            durable=True,
            arguments={
                # quorum + at-least-once: an expired copy leaves only once the work queue
                # confirmed it, even across a broker restart (RabbitMQ 3.10 and later)
                "x-queue-type": "quorum",
                "x-message-ttl": round(delay * 1000),
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
                # the default exchange routes by queue name: back to this worker's
                # queue only, never to other queues bound to the shared exchange
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": settings.queue,
            },
        )
    return work


async def drain_legacy_queues(connection: AbstractConnection, settings: RabbitMQSettings) -> int:
    """Move what earlier versions' queues still hold to where it belongs now, then delete them.

    Each message is copied (confirmed) before the original is acked, so a crash in
    between leaves a duplicate for the inbox, never a loss; replicas draining at the
    same time share the messages, since a ``basic.get`` hands each to one of them.
    """
    moved = 0
    for legacy, target in settings.legacy_queues.items():
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        try:
            try:
                queue = await channel.declare_queue(legacy, passive=True)
            except ChannelNotFoundEntity:
                continue  # never existed, or drained already
            if legacy.endswith(".dead"):  # stop the fanout from filling it while it drains
                await queue.unbind(settings.dead_letter_exchange, "")
            # Quorum queues refuse ``if_empty``: drain, look again, delete once it reads
            # empty (a count can lag the acks by a moment); nothing routes to an old queue
            # any more (the dead-letter one was unbound above). Bounded: a queue that old
            # workers still feed is drained again at the next start.
            for _ in range(5):
                while (message := await queue.get(no_ack=False, fail=False)) is not None:
                    await channel.default_exchange.publish(_moved(message), target, mandatory=True)
                    await message.ack()
                    moved += 1
                again = await channel.declare_queue(legacy, passive=True)
                if again.declaration_result.message_count == 0:
                    await again.delete(if_unused=False, if_empty=False)
                    break
                await asyncio.sleep(0.2)
        finally:
            with contextlib.suppress(*CONNECTION_LOST):
                await channel.close()
    return moved


def _moved(message: AbstractIncomingMessage) -> aio_pika.Message:
    """A copy that keeps the worker's headers (its count, its dead-letter reason)."""
    ours = {k: v for k, v in (message.headers or {}).items() if k in WORKER_HEADERS}
    return copy_message(message, **ours)


async def delete_topology(channel: AbstractChannel, settings: RabbitMQSettings) -> None:
    """Remove what :func:`declare_topology` made, messages included (tests, benchmarks)."""
    names = [settings.queue, settings.dead_letter_queue, *settings.legacy_queues]
    names += [settings.retry_queue(delay) for delay in settings.retry_delays]
    for name in names:
        await channel.queue_delete(name, if_unused=False, if_empty=False)
    for exchange in (settings.exchange, settings.dead_letter_exchange):
        if exchange:  # "" is the default exchange, which cannot be deleted
            await channel.exchange_delete(exchange)
