"""Reading a Kafka record: header values as text, the dedup key, the dead-letter headers.

The consumer builds each delivery with these and ``worker dlq`` reads dead letters with
them, so both agree on what a header means. :func:`header_message_id` is the default
dedup key (``WORKER_MESSAGE_ID_FUNC`` replaces it); its CloudEvents key is the string the
RabbitMQ adapter builds too, so an event bridged through both brokers has one key.
"""

from __future__ import annotations

import json
from typing import Any

from worker.brokers import IdentityFunc

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
    """The dedup key of a CloudEvent, the same string on every broker: ``["source","id"]``.

    The RabbitMQ adapter builds it the same way, so an event bridged through both
    brokers has one key, and JSON keeps any pair of strings unambiguous.
    """
    return json.dumps([source, event_id], separators=(",", ":"))


def header_message_id(header: str) -> IdentityFunc:
    """The default dedup key: CloudEvents source + id, else ``header``, else the offset.

    A CloudEvent is identified by its source and id wherever it travels, so they
    come first, as on RabbitMQ. Either survives a producer retry: the retry writes
    a second record at a new offset, so the offset fallback would give the two
    copies two different keys. A header that is present but empty or not UTF-8,
    or half a CloudEvents pair without the header, is no usable id (the pump
    dead-letters it).
    """

    def identity(record: Any) -> str | None:
        headers = record_headers(record)
        ce_id, ce_source = headers.get("ce_id"), headers.get("ce_source")
        event_id, source = header_text(ce_id), header_text(ce_source)
        if event_id and source:
            return cloud_event_key(source, event_id)
        if header in headers:
            return header_text(headers[header])
        if ce_id is not None or ce_source is not None:
            return None  # half a CloudEvents pair identifies nothing
        return f"{record.topic}/{record.partition}/{record.offset}"

    return identity
