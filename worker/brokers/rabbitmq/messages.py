"""What the worker reads from, and writes onto, an AMQP message: its type, its dedup key,
its delivery count, and the copies that carry them from one queue to the next.

Dedup key (the default, ``WORKER_MESSAGE_ID_FUNC`` replaces it): the CloudEvents
``source`` + ``id``, from the body of a structured-mode event (content type
``application/cloudevents+json``) or from binary-mode ``ce-`` headers, as
:func:`worker.brokers.cloudevents.event_key` builds it on every broker; else the AMQP
``message_id``. A structured event's ``type`` and ``data`` are the delivery's type and
body (:func:`message_contents`), so its three parts come from one reading of one body.

Delivery count = ``x-worker-deliveries`` (the worker's own count, carried across its
copies; ignored on a dead letter moved back by an operator tool) + the quorum
queue's ``x-delivery-count`` (returns inside the queue: crashed consumers, lost
connections) + 1. ``x-worker-give-backs`` carries the uncounted give-backs the same way.

aiormq stamps a random ``message_id`` on every message published without one, copies
included: a copy of a message that had none says so in ``x-worker-no-id``, and that
invented id is never read as the message's.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from worker.brokers import IdentityFunc, load_identity
from worker.brokers.cloudevents import Contents, Event, contents, event_key, structured

if TYPE_CHECKING:
    from worker.brokers.rabbitmq.settings import RabbitMQSettings

DELIVERIES_HEADER = "x-worker-deliveries"
REASON_HEADER = "x-worker-reason"
GIVE_BACKS_HEADER = "x-worker-give-backs"
NO_ID_HEADER = "x-worker-no-id"  # kept on every later copy: the message never had an id
WORKER_HEADERS = (
    DELIVERIES_HEADER,
    REASON_HEADER,
    GIVE_BACKS_HEADER,
    "x-worker-queue",
    "x-worker-dead-lettered-at",
)
_BROKER_HEADERS = (
    "x-delivery-count",
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
)
_CE_PREFIXES = ("ce-", "ce_", "cloudEvents:", "cloudEvents_")


def header_text(headers: Mapping[str, Any], name: str) -> str | None:
    value = headers.get(name)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return str(value) if value not in (None, "") else None


def _cloud_event(headers: Mapping[str, Any], attribute: str) -> str | None:
    for prefix in _CE_PREFIXES:
        value = header_text(headers, prefix + attribute)
        if value is not None:
            return value
    return None


def structured_event(message: AbstractIncomingMessage) -> Event | None:
    """The event of a structured-mode message (the ``content_type`` property says so)."""
    return structured(message.content_type, message.body)


def message_contents(message: AbstractIncomingMessage) -> Contents:
    """What a delivery of ``message`` is made of: in structured mode the event's type,
    data and attributes; otherwise the AMQP ``type`` property (else the ``ce-type``
    header), the body and the headers as they are."""
    headers = message.headers or {}
    binary = Contents(message.type or _cloud_event(headers, "type"), message.body, headers)
    return contents(structured_event(message), binary, "ce-")


def message_type(message: AbstractIncomingMessage) -> str | None:
    """The type that picks the handler (see :func:`message_contents`)."""
    return message_contents(message).type


def default_message_id(message: AbstractIncomingMessage) -> str | None:
    """CloudEvents source + id (structured body, else binary headers), else the AMQP
    ``message_id``, else None.

    The CloudEvents pair comes first because aiormq (under aio-pika) stamps a
    random ``message_id`` on every message published without one, so a producer
    retry through aio-pika carries a new id while its event id stays the same. For
    the same reason a pair too long for the inbox becomes its digest, never the
    ``message_id``. A structured event without a usable pair is dead-lettered (its
    ``refusal``); the ``message_id`` then only names it in the dead letter.
    """
    event = structured_event(message)
    if event is not None:
        return event.key or _amqp_id(message)
    headers = message.headers or {}
    ce_id, ce_source = _cloud_event(headers, "id"), _cloud_event(headers, "source")
    if ce_id is not None and ce_source is not None:
        return event_key(ce_source, ce_id)
    return _amqp_id(message)


def _amqp_id(message: AbstractIncomingMessage) -> str | None:
    """The AMQP ``message_id``; None on a worker's copy of a message that had none (the
    copy's id is the one aiormq invented when it was published)."""
    if NO_ID_HEADER in (message.headers or {}):
        return None
    return message.message_id or None


def content_hash_id(message: AbstractIncomingMessage) -> str:
    """Two identical messages become one: only for producers that never repeat a payload."""
    digest = hashlib.sha256(f"{message_type(message)}\0".encode() + message.body)
    return f"sha256:{digest.hexdigest()}"


def make_identity(settings: RabbitMQSettings, path: str | None = None) -> IdentityFunc:
    if not settings.content_hash_ids:
        return load_identity(path, default_message_id)

    def identity_or_hash(message: AbstractIncomingMessage) -> str | None:
        return default_message_id(message) or content_hash_id(message)

    return load_identity(path, identity_or_hash)


def delivery_count(message: AbstractIncomingMessage) -> int:
    """1 on the first delivery; counts the worker's own retry hops and crashed consumers.

    The carried count is honoured only where the worker's own retry hop set it: a
    dead letter (it carries ``x-worker-reason``) moved back to the work queue by a
    shovel or the management UI starts afresh, as ``worker dlq --resubmit`` does.
    """
    headers = message.headers or {}
    before = 0 if REASON_HEADER in headers else header_int(headers.get(DELIVERIES_HEADER))
    returned = headers.get("x-delivery-count")  # quorum queues only
    inside = header_int(returned) if returned is not None else int(bool(message.redelivered))
    return before + inside + 1


def give_backs(message: AbstractIncomingMessage) -> int:
    """Uncounted give-backs so far, as the worker's own copies carried them (0 on a dead
    letter moved back, which starts afresh like its count)."""
    headers = message.headers or {}
    return 0 if REASON_HEADER in headers else header_int(headers.get(GIVE_BACKS_HEADER))


def returned(message: AbstractIncomingMessage) -> bool:
    """RabbitMQ took the message back from a consumer that never settled it (a process
    that died, a lost connection): the worker's own give-backs are fresh copies."""
    headers = message.headers or {}
    return bool(message.redelivered) or header_int(headers.get("x-delivery-count")) > 0


def header_int(value: Any) -> int:
    try:
        return max(int(value), 0)
    except (TypeError, ValueError):
        return 0


def dead_lettered_at(headers: Mapping[str, Any], death: Mapping[str, Any]) -> datetime | None:
    """When the worker (``x-worker-dead-lettered-at``) or the broker (``x-death``) dead-lettered."""
    stamp = header_text(headers, "x-worker-dead-lettered-at")
    if stamp is not None:
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(stamp)
    at = death.get("time")
    return at if isinstance(at, datetime) else None


def copy_message(message: AbstractIncomingMessage, **extra: Any) -> aio_pika.Message:
    """A persistent copy without the broker's bookkeeping headers (or ours, unless given)."""
    headers = {
        k: v
        for k, v in (message.headers or {}).items()
        if k not in _BROKER_HEADERS and k not in WORKER_HEADERS
    }
    if not message.message_id:
        headers[NO_ID_HEADER] = True
    headers.update(extra)
    return aio_pika.Message(
        message.body,
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
    )
