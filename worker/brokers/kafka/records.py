"""Reading a Kafka record: header values as text, the dedup key, its type and body, the
dead-letter headers.

The consumer builds each delivery with these and ``worker dlq`` reads dead letters with
them, so both agree on what a header means. :func:`header_message_id` is the default
dedup key (``WORKER_MESSAGE_ID_FUNC`` replaces it): CloudEvents ``source`` + ``id``
(from a structured-mode value, ``content-type: application/cloudevents+json``, or the
binary-mode ``ce_`` headers), else the message-id header, else topic/partition/offset.
Its CloudEvents key is the string the RabbitMQ adapter builds too
(:func:`worker.brokers.cloudevents.event_key`), so an event bridged through both
brokers, in either mode, has one key. :func:`record_contents` gives a structured
event's type and data from the same reading of the same value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.brokers import IdentityFunc
from worker.brokers.cloudevents import Contents, Event, contents, event_key, structured

# The headers a dead letter carries: where the record came from, and why it failed.
DLT_TOPIC = "dlt-original-topic"
DLT_PARTITION = "dlt-original-partition"
DLT_OFFSET = "dlt-original-offset"
DLT_REASON = "dlt-reason"
DLT_MESSAGE_ID = "dlt-message-id"
DLT_DELIVERY_COUNT = "dlt-delivery-count"
DLT_DROPPED = "dlt-dropped"
DLT_ORIGINAL_SIZE = "dlt-original-size"
DLT_PREFIX = "dlt-"


def header_text(raw: bytes | None) -> str | None:
    """A header value as text; empty or undecodable is no value at all."""
    if not raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def record_headers(record: Any) -> dict[str, bytes]:
    return {key: value for key, value in record.headers or () if value is not None}


def cloud_event_key(source: str, event_id: str) -> str:
    """The dedup key of a CloudEvent, the same string on every broker: ``["source","id"]``
    (its digest past the inbox's length); kept under this name for callers of earlier
    releases, :func:`worker.brokers.cloudevents.event_key` is the one implementation."""
    return event_key(source, event_id)


CONTENT_TYPE = "content-type"  # the CloudEvents Kafka binding's header


def structured_event(record: Any) -> Event | None:
    """The event of a structured-mode record (its ``content-type`` header says so).

    The value is read only then: a record of any other content type is binary mode.
    """
    headers = record_headers(record)
    content_type = next(
        (header_text(value) for name, value in headers.items() if name.lower() == CONTENT_TYPE),
        None,
    )
    if content_type is None:
        return None
    return structured(content_type, record.value or b"")


def record_contents(
    record: Any, headers: Mapping[str, str], type_header: str, topic_types: Mapping[str, str]
) -> Contents:
    """What a delivery of ``record`` is made of (``headers``: its headers as text): in
    structured mode the event's type, data and attributes; otherwise the type header
    (else ``ce_type``, else the topic's type), the value and the headers as they are."""
    kind = headers.get(type_header) or headers.get("ce_type") or topic_types.get(record.topic)
    return contents(structured_event(record), Contents(kind, record.value or b"", headers), "ce_")


def header_message_id(header: str) -> IdentityFunc:
    """The default dedup key: CloudEvents source + id, else ``header``, else the offset.

    A CloudEvent is identified by its source and id wherever it travels, so they
    come first, as on RabbitMQ, from a structured-mode value or from the binary-mode
    headers. Either survives a producer retry: the retry writes a second record at a
    new offset, so the offset fallback would give the two copies two different keys.
    A header that is present but empty or not UTF-8, or half a CloudEvents pair
    without the header, is no usable id (the pump dead-letters it); so is a
    structured event without its pair (its refusal says why).
    """

    def identity(record: Any) -> str | None:
        event = structured_event(record)
        if event is not None and event.key is not None:
            return event.key
        headers = record_headers(record)
        ce_id, ce_source = headers.get("ce_id"), headers.get("ce_source")
        event_id, source = header_text(ce_id), header_text(ce_source)
        if event_id and source:
            return event_key(source, event_id)
        if header in headers:
            return header_text(headers[header])
        if ce_id is not None or ce_source is not None:
            return None  # half a CloudEvents pair identifies nothing
        return f"{record.topic}/{record.partition}/{record.offset}"

    return identity
