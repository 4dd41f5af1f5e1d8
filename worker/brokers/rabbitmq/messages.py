"""What the worker reads from, and writes onto, an AMQP message: its type, its dedup key,
its delivery count, and the copies that carry them from one queue to the next.

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
import json
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from worker.brokers import IdentityFunc, load_identity

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


def message_type(message: AbstractIncomingMessage) -> str | None:
    """The AMQP ``type`` property, else the CloudEvents ``ce-type`` header."""
    return message.type or _cloud_event(message.headers or {}, "type")


def default_message_id(message: AbstractIncomingMessage) -> str | None:
    """CloudEvents source + id when both are present, else the AMQP ``message_id``, else None.

    The CloudEvents pair comes first because aiormq (under aio-pika) stamps a
    random ``message_id`` on every message published without one, so a producer
    retry through aio-pika carries a new id while its ``ce-id`` stays the same.
    """
    headers = message.headers or {}
    ce_id, ce_source = _cloud_event(headers, "id"), _cloud_event(headers, "source")
    if ce_id is not None and ce_source is not None:
        return json.dumps([ce_source, ce_id], separators=(",", ":"))
    if NO_ID_HEADER in headers:  # a copy of a message that had none: the id is aiormq's
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
