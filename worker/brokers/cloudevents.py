"""CloudEvents on any broker: one dedup key per event however it travels, and the
structured content mode, where the whole event (its data included) is the JSON body.

A producer sends an event in one of two modes (the CloudEvents protocol bindings):

- **binary**: the attributes travel as headers (AMQP ``ce-id``, Kafka ``ce_id``, ...)
  and the body is the event's data. Each adapter reads those headers itself.
- **structured**: the content type is ``application/cloudevents+json`` and the body is
  the event, ``{"specversion": "1.0", "id": ..., "source": ..., "type": ...,
  "data": ...}``. :func:`structured` reads it here, once for every broker, so the
  RabbitMQ, Kafka and memory adapters agree on what such a body means.

Both modes give the event the same dedup key, :func:`event_key` of its ``source`` and
``id``, so one event sent once each way (or once per broker) is applied once. The type
is the event's ``type`` and the handler's model validates the event's ``data`` (or the
bytes of ``data_base64``), exactly what it would validate in binary mode.

A key longer than the inbox stores (255 characters) becomes a fixed-length digest of
itself, ``ce-sha256:<64 hex digits>``: the same for every copy of the event on every
broker, and never the key of another event. The broker's own message id is no
fallback: aiormq (under aio-pika) invents one per publish, so a producer's retry would
carry a new one and be applied twice.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeGuard

from worker.inbox import MESSAGE_ID_LENGTH

STRUCTURED = "application/cloudevents+json"
DIGEST_PREFIX = "ce-sha256:"
BOM = b"\xef\xbb\xbf"
# The media types whose data is a JSON value, as the CloudEvents JSON format defines them.
_JSON_DATA = re.compile(r"^(application|text)/([a-z0-9.\-]+\+)?json$")
_JSON_NAMES: dict[type, str] = {
    list: "array",
    str: "string",
    int: "number",
    Decimal: "number",
    bool: "boolean",
    type(None): "null",
}


def event_key(source: str, event_id: str) -> str:
    """The dedup key of the event ``source`` + ``id``, the same string on every broker.

    ``["<source>","<id>"]`` as compact JSON keeps every pair of strings apart (no
    separator can be forged); past the inbox's length, its digest.
    """
    key = json.dumps([source, event_id], separators=(",", ":"))
    if len(key) <= MESSAGE_ID_LENGTH:
        return key
    return DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def media_type(content_type: str | None) -> str:
    """``Application/CloudEvents+JSON; charset=utf-8`` -> ``application/cloudevents+json``."""
    return (content_type or "").split(";", 1)[0].strip().lower()


@dataclass(frozen=True, slots=True)
class Event:
    """A structured-mode event, read from a body: what a delivery is made of.

    ``problem`` says why no handler can ever run it (dead-lettered at once with that
    reason); ``key`` is None when the event has no usable source and id.
    """

    key: str | None
    type: str | None
    data: bytes
    attributes: Mapping[str, str] = field(default_factory=dict)
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class Contents:
    """What a delivery is made of besides its dedup key: the type that picks the
    handler, the body its model validates, the headers it sees, and the reason no
    handler can ever run it (None: none known yet)."""

    type: str | None
    body: bytes
    headers: Mapping[str, Any]
    refusal: str | None = None


def contents(event: Event | None, binary: Contents, prefix: str) -> Contents:
    """A delivery's contents: ``binary`` (what the adapter read from the message's
    properties and headers) unless the message is a structured event, whose type, data
    and reason win; its attributes join the headers under ``prefix`` (``ce-``, ``ce_``),
    as a binary-mode producer would have sent them, so a handler reads one set of
    headers whichever mode its producer chose.
    """
    if event is None:
        return binary
    attributes = {prefix + name: value for name, value in event.attributes.items()}
    return Contents(event.type, event.data, {**binary.headers, **attributes}, event.problem)


def structured(content_type: str | None, body: bytes) -> Event | None:
    """The event a structured-mode message carries, or None when it is not one.

    Any other CloudEvents format (``application/cloudevents-batch+json``, ``+avro``, ...)
    is an event the worker cannot read: an :class:`Event` with that problem, so it is
    dead-lettered with a reason instead of reaching a handler as a plain body.
    """
    kind = media_type(content_type)
    if kind != STRUCTURED:
        if kind.startswith("application/cloudevents"):
            reason = (
                f"unsupported CloudEvents content type {kind!r} (the worker reads {STRUCTURED})"
            )
            return Event(None, None, body, problem=reason)
        return None
    try:
        # A Decimal for every JSON number with a fraction or an exponent, so the data
        # handed on keeps the number exactly as the producer wrote it (money).
        event = json.loads(body.removeprefix(BOM), parse_float=Decimal, parse_constant=_refuse)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return Event(None, None, body, problem=f"structured CloudEvent is not JSON: {exc}")
    if not isinstance(event, dict):
        what = _JSON_NAMES.get(type(event), "value")
        return Event(
            None, None, body, problem=f"structured CloudEvent is a JSON {what}, not an object"
        )
    return _read(event, body)


def _read(event: dict[str, Any], body: bytes) -> Event:
    source, event_id, kind = (event.get(name) for name in ("source", "id", "type"))
    key = event_key(source, event_id) if _text(source) and _text(event_id) else None
    # each of the three must be a non-empty string (the CloudEvents spec's "String")
    problems = [
        f"no {name}" if event.get(name) is None else f"{name} is not a non-empty string"
        for name, value in (("id", event_id), ("source", source), ("type", kind))
        if not _text(value)
    ]
    data, problem = _data(event)
    if problem is not None:
        problems.append(problem)
    attributes = {
        name: _attribute(value)
        for name, value in event.items()
        if name not in ("data", "data_base64") and isinstance(value, str | int | bool)
    }
    return Event(
        key,
        kind if _text(kind) else None,
        data if problem is None else body,
        attributes,
        "structured CloudEvent: " + ", ".join(problems) if problems else None,
    )


def _data(event: dict[str, Any]) -> tuple[bytes, str | None]:
    """The bytes a binary-mode producer would have sent as the body, or a problem."""
    if "data_base64" in event:
        if "data" in event:
            return b"", "both data and data_base64"
        encoded = event["data_base64"]
        try:
            return base64.b64decode(encoded, validate=True), None
        except (TypeError, ValueError, binascii.Error):
            return b"", "data_base64 is not base64"
    if "data" not in event:
        return b"", None  # no data: what a binary-mode event without data has as its body
    data = event["data"]
    content_type = event.get("datacontenttype")
    if isinstance(data, str):
        if event.get("datacontentencoding") == "base64":  # CloudEvents 0.3's data_base64
            try:
                return base64.b64decode(data, validate=True), None
            except (ValueError, binascii.Error):
                return b"", "data is not base64 (datacontentencoding base64)"
        if isinstance(content_type, str) and not _JSON_DATA.match(media_type(content_type)):
            try:  # text (XML, CSV, ...) travels as a JSON string
                return data.encode(), None
            except UnicodeEncodeError:  # "\ud800": JSON can say it, UTF-8 cannot
                return b"", "data is not UTF-8 text"
    try:
        return _json(data).encode(), None
    except RecursionError:
        return b"", "data nested too deeply"


def _json(value: Any) -> str:
    """JSON text of a value :func:`json.loads` made, its numbers written as they came."""
    if isinstance(value, Decimal):
        return str(value)  # 12.10 stays 12.10, 1e400 stays 1E+400
    if isinstance(value, dict):
        items = (json.dumps(name) + ":" + _json(item) for name, item in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_json(item) for item in value) + "]"
    return json.dumps(value)


def _attribute(value: str | int | bool) -> str:
    """An attribute as the header a binary-mode producer would have sent."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _text(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value)


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


__all__ = [
    "BOM",
    "DIGEST_PREFIX",
    "STRUCTURED",
    "Contents",
    "Event",
    "contents",
    "event_key",
    "media_type",
    "structured",
]
