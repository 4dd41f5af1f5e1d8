"""Reading a received message: its identity, properties, body and type, and the copies
made of it (the uncounted give-back's, and a re-submitted dead letter's).

Shared by the consumer and the operator tools, so a delivery and a listed dead
letter read the same fields the same way. ``x-worker-deliveries``,
``x-worker-give-backs`` and ``x-worker-copied-at`` are the worker's own properties:
handlers never see them, and a re-submitted dead letter carries none of them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage
from azure.servicebus.amqp import AmqpMessageBodyType

if TYPE_CHECKING:
    from worker.brokers.servicebus.settings import ServiceBusSettings

DEAD_LETTER_REASON = b"DeadLetterReason"
DEAD_LETTER_DESCRIPTION = b"DeadLetterErrorDescription"
DELIVERIES_PROPERTY = "x-worker-deliveries"  # deliveries spent before an uncounted give-back
GIVE_BACKS_PROPERTY = "x-worker-give-backs"  # uncounted give-backs so far, that one included
COPIED_AT_PROPERTY = "x-worker-copied-at"  # epoch ms (a string) when the worker sent that copy
_WORKER_PROPERTIES = (DELIVERIES_PROPERTY, GIVE_BACKS_PROPERTY, COPIED_AT_PROPERTY)


def default_message_id(message: ServiceBusReceivedMessage) -> str | None:
    """Service Bus ``MessageId``; AMQP allows a uuid or a number there too, so it is str()-ed."""
    message_id = message.message_id
    if message_id is None or message_id == "":
        return None
    return str(message_id)


def text(value: Any) -> Any:
    """Keys and string values come back from the wire as bytes."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    return value


def application_properties(message: ServiceBusReceivedMessage) -> dict[str, Any]:
    return {str(text(k)): text(v) for k, v in (message.application_properties or {}).items()}


def handler_headers(message: ServiceBusReceivedMessage) -> dict[str, Any]:
    """What a handler sees: the application properties without the worker's own."""
    properties = application_properties(message)
    return {k: v for k, v in properties.items() if k not in _WORKER_PROPERTIES}


def wall() -> float:
    """The local wall clock, the one the SDK's lock checks use (tests move it)."""
    return time.time()


def given_back(
    message: ServiceBusReceivedMessage, spent: int, give_backs: int
) -> ServiceBusMessage:
    """The copy an uncounted give-back sends: the same message, plus the counts so far."""
    properties: dict[str | bytes, Any] = {k: v for k, v in handler_headers(message).items()}
    properties[DELIVERIES_PROPERTY] = spent
    properties[GIVE_BACKS_PROPERTY] = give_backs
    properties[COPIED_AT_PROPERTY] = str(int(wall() * 1000))  # an int would overflow AMQP's
    copy = ServiceBusMessage(
        body_of(message),
        application_properties=properties,
        subject=message.subject,
        content_type=message.content_type,
        correlation_id=message.correlation_id,
        to=message.to,
        reply_to=message.reply_to,
        time_to_live=message.time_to_live,
    )
    copy.message_id = message.message_id  # as it was, None included (the SDK invents one)
    return copy


def body_of(message: ServiceBusReceivedMessage) -> bytes:
    """The payload: data sections joined; a str or bytes AMQP value as is."""
    if message.body_type == AmqpMessageBodyType.DATA:
        return b"".join(message.body)
    value = message.body
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return repr(value).encode()  # a sequence or a structured value: the pump rejects it as invalid


class TypeResolver:
    """Message type: an application property, else the subject, else the entity's mapping."""

    def __init__(self, settings: ServiceBusSettings) -> None:
        self._keys = (settings.type_property.encode(), settings.type_property)
        mapping = settings.type_mapping
        candidates = [settings.entity, settings.topic or settings.queue or ""]
        self._fallback = next((mapping[c] for c in candidates if c in mapping), None)

    def __call__(self, message: ServiceBusReceivedMessage) -> str | None:
        properties = message.application_properties or {}
        for key in self._keys:
            value = properties.get(key)
            if value:
                return str(text(value))
        return message.subject or self._fallback


def resubmission(message: ServiceBusReceivedMessage) -> ServiceBusMessage:
    """The copy ``worker dlq --resubmit`` sends back: without the dead-letter reason and
    without the worker's own properties."""
    properties: dict[str | bytes, Any] = {
        k: v
        for k, v in application_properties(message).items()
        if k.encode() not in (DEAD_LETTER_REASON, DEAD_LETTER_DESCRIPTION)
        and k not in _WORKER_PROPERTIES  # a resubmitted dead letter starts from delivery 1
    }
    return ServiceBusMessage(
        body_of(message),
        message_id=default_message_id(message),
        subject=message.subject,
        content_type=message.content_type,
        correlation_id=message.correlation_id,
        application_properties=properties,
    )


__all__ = [
    "COPIED_AT_PROPERTY",
    "DEAD_LETTER_DESCRIPTION",
    "DEAD_LETTER_REASON",
    "DELIVERIES_PROPERTY",
    "GIVE_BACKS_PROPERTY",
    "TypeResolver",
    "application_properties",
    "body_of",
    "default_message_id",
    "given_back",
    "handler_headers",
    "resubmission",
    "text",
    "wall",
]
