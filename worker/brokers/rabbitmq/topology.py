"""The queues and exchanges the worker uses, declared idempotently by the worker and by
``worker publish`` / ``worker dlq`` (``Q`` is ``WORKER_RABBITMQ_QUEUE``)::

    exchange (WORKER_RABBITMQ_EXCHANGE) --binding keys--> Q  (quorum; its DLX is Q.dlx)
    Q.delay.<ms>ms  (quorum, x-message-ttl=<ms>, at-least-once dead-lettering)
        --TTL expiry, default exchange--> Q
    Q.dlx (fanout) --> Q.dlq  (the dead-letter queue, classic: peeking is free)

A new quorum ``Q`` is declared with at-least-once dead-lettering too (so the broker's
own dead-lettering, under a ``delivery-limit`` policy, is at-least-once); an existing
one keeps the arguments it was declared with, which RabbitMQ never changes.

Also the migration from older versions' queues (drained at start) and the teardown
tests and benchmarks use; docs/rabbitmq.md explains the design. Only ``worker run``
declares: the operator tools look for what exists and declare nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.request
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
)
from aiormq.exceptions import ChannelNotFoundEntity, ChannelPreconditionFailed

from worker.brokers.rabbitmq.messages import (
    REASON_HEADER,
    WORKER_HEADERS,
    copy_message,
    header_text,
)
from worker.brokers.rabbitmq.settings import CONNECTION_LOST

if TYPE_CHECKING:
    from worker.brokers.rabbitmq.settings import RabbitMQSettings


# What a quorum work queue is declared with besides its type and DLX: the broker's own
# dead-lettering (a delivery-limit policy, a message TTL) then waits for Q.dlx's queue to
# confirm, instead of dropping what a full or missing dead-letter queue refuses.
AT_LEAST_ONCE = {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}


def work_queue_arguments(settings: RabbitMQSettings, *, at_least_once: bool) -> dict[str, Any]:
    arguments: dict[str, Any] = {
        "x-queue-type": settings.queue_type,
        # where the broker itself dead-letters (a delivery-limit policy, a message TTL)
        "x-dead-letter-exchange": settings.dead_letter_exchange,
    }
    if at_least_once and settings.queue_type == "quorum":
        arguments.update(AT_LEAST_ONCE)
    return arguments


async def at_least_once_accepted(
    connection: AbstractConnection, settings: RabbitMQSettings
) -> bool:
    """Whether ``Q`` is new or already at-least-once: False for a quorum queue declared by an
    earlier version, whose arguments RabbitMQ refuses to change (PRECONDITION_FAILED).

    Tried on a channel of its own, since a refused declaration closes the channel.
    """
    if settings.queue_type != "quorum":
        return False
    channel = await connection.channel()
    try:
        await channel.declare_queue(
            settings.queue,
            durable=True,
            arguments=work_queue_arguments(settings, at_least_once=True),
        )
    except ChannelPreconditionFailed:
        return False
    finally:
        with contextlib.suppress(*CONNECTION_LOST):
            await channel.close()
    return True


async def declare_topology(
    channel: AbstractChannel, settings: RabbitMQSettings, *, at_least_once: bool = True
) -> AbstractQueue:
    """Declare (idempotently) everything the worker uses; returns the work queue.

    ``at_least_once=False`` declares ``Q`` as earlier versions did (see
    :func:`at_least_once_accepted`).
    """
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
        arguments=work_queue_arguments(settings, at_least_once=at_least_once),
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


def listed_retry_queues(settings: RabbitMQSettings) -> list[str]:
    """The vhost's ``Q.retry.<ms>ms`` queues of any delay, as the management API lists them.

    AMQP cannot list queues: without ``WORKER_RABBITMQ_MANAGEMENT_URL`` only the
    configured and default delays are looked for. Blocking (call it in a thread);
    raises ``OSError`` or ``ValueError`` when the API cannot answer.
    """
    assert settings.management_url is not None
    amqp = urlsplit(settings.url)
    api = urlsplit(settings.management_url)
    vhost = unquote(amqp.path[1:]) or "/"
    path = f"{api.path.rstrip('/')}/api/queues/{quote(vhost, safe='')}?columns=name"
    netloc = api.hostname or ""
    if api.port is not None:
        netloc += f":{api.port}"
    request = urllib.request.Request(f"{api.scheme}://{netloc}{path}")
    user = unquote(api.username or amqp.username or "guest")
    password = unquote(api.password or amqp.password or "guest")
    passwords = urllib.request.HTTPPasswordMgrWithDefaultRealm()
    passwords.add_password(None, f"{api.scheme}://{netloc}/", user, password)
    opener = urllib.request.build_opener(urllib.request.HTTPBasicAuthHandler(passwords))
    with opener.open(request, timeout=settings.connect_timeout) as response:
        listed = json.load(response)
    pattern = re.compile(rf"{re.escape(settings.queue)}\.retry\.\d+ms")
    names = [item.get("name") for item in listed if isinstance(item, dict)]
    return sorted(name for name in names if isinstance(name, str) and pattern.fullmatch(name))


async def legacy_queues(settings: RabbitMQSettings, log: Any = None) -> dict[str, str]:
    """Earlier versions' queues -> where their messages belong now: the configured and
    default delays' retry queues, ``Q.dead``, and every ``Q.retry.<ms>ms`` the management
    API lists (custom delays of earlier configurations)."""
    found = dict(settings.legacy_queues)
    if settings.management_url is None:
        return found
    try:
        listed = await asyncio.to_thread(listed_retry_queues, settings)
    except (OSError, ValueError) as exc:  # the API is optional: look for the known names only
        if log is not None:
            log.warning("could not list old retry queues", error=f"{type(exc).__name__}: {exc}")
        return found
    for name in listed:
        found.setdefault(name, settings.queue)
    return found


async def drain_legacy_queues(
    connection: AbstractConnection, settings: RabbitMQSettings, log: Any = None
) -> int:
    """Move what earlier versions' queues still hold to where it belongs now, then delete them.

    Each message is copied (confirmed) before the original is acked, so a crash in
    between leaves a duplicate for the inbox, never a loss; replicas draining at the
    same time share the messages, since a ``basic.get`` hands each to one of them.
    """
    moved = 0
    for legacy, target in (await legacy_queues(settings, log)).items():
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        try:
            try:
                queue = await _look(channel, legacy)
            except ChannelNotFoundEntity:
                continue  # never existed, or drained already
            if legacy.endswith(".dead"):  # stop the fanout from filling it while it drains
                await queue.unbind(settings.dead_letter_exchange, "")
            # Quorum queues refuse ``if_empty``: drain, look again, delete once it reads
            # empty (a count can lag the acks by a moment); nothing routes to an old queue
            # any more (the dead-letter one was unbound above). Bounded: a queue that old
            # workers still feed is drained again at the next start.
            dead = target == settings.dead_letter_queue
            for _ in range(5):
                while (message := await queue.get(no_ack=False, fail=False)) is not None:
                    copy = _moved(message, dead_letter=dead)
                    await channel.default_exchange.publish(copy, target, mandatory=True)
                    await message.ack()
                    moved += 1
                again = await _look(channel, legacy)
                if again.declaration_result.message_count == 0:
                    await again.delete(if_unused=False, if_empty=False)
                    break
                await asyncio.sleep(0.2)
        finally:
            with contextlib.suppress(*CONNECTION_LOST):
                await channel.close()
    return moved


async def _look(channel: AbstractChannel, name: str) -> AbstractQueue:
    """A passive declare that asks the broker every time. A robust channel would answer
    a second one from its cache (a stale message count, so a drained queue was never
    deleted) and would declare the queue again after a reconnect, deleted or not."""
    if isinstance(channel, AbstractRobustChannel):
        return await channel.declare_queue(name, passive=True, robust=False)
    return await channel.declare_queue(name, passive=True)


_DEATH_HEADERS = (
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
)


def _moved(message: AbstractIncomingMessage, *, dead_letter: bool) -> aio_pika.Message:
    """A copy that keeps the worker's headers (its count, its dead-letter reason); a dead
    letter also keeps the broker's ``x-death``, and one the broker dead-lettered gets its
    reason in ``x-worker-reason`` too (a broker that ignores a published ``x-death``
    would otherwise lose it)."""
    headers = message.headers or {}
    ours = {k: v for k, v in headers.items() if k in WORKER_HEADERS}
    if dead_letter:
        ours.update({k: v for k, v in headers.items() if k in _DEATH_HEADERS})
        deaths = headers.get("x-death")
        death = deaths[0] if isinstance(deaths, list) and deaths else None
        if REASON_HEADER not in ours and isinstance(death, dict):
            why, queue = header_text(death, "reason"), header_text(death, "queue")
            ours[REASON_HEADER] = f"broker: {why or 'unknown'} in {queue}"
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
