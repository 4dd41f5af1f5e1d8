"""What a handler does to the outside world, seen where the call is made: HTTP requests,
broker publishes and mails, each with the idempotency key it carries, if any.

Counting connections misses a client kept open across messages (a module-level
``httpx.AsyncClient``, a broker channel): its second call opens nothing. So the kit
wraps the send methods of the client libraries a handler is likely to use, once per
process, and only those already imported (a check never imports a library itself).
Outside a probed stage a wrapped method costs one context-variable read and calls the
original.

Seen: httpx (``Client.send``, ``AsyncClient.send``: every request, whatever the
transport, a mock one too), aiohttp (``ClientSession._request``), aio-pika
(``Exchange.publish``), pika (``BlockingChannel.basic_publish``), aiokafka
(``AIOKafkaProducer.send``), smtplib and aiosmtplib (``SMTP.sendmail``). A key is an
HTTP header named like ``Idempotency-Key``, an AMQP ``message_id``, or a Kafka header
named like an idempotency key or a message id.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

KINDS = ("request", "publish", "mail", "read")
"""``read``: a request of a safe method (GET, HEAD, OPTIONS, TRACE), which changes nothing
at the provider: seen, never counted as an effect."""
_SAFE = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

_KEY_HEADER = re.compile(r"^(?:x-)?idempotency[-_ ]?key$", re.IGNORECASE)
_KAFKA_KEY_HEADER = re.compile(r"^(?:x-)?(?:idempotency[-_ ]?key|message[-_ ]?id)$", re.IGNORECASE)
_MARK = "__worker_testing_effect__"
_CONTENT = 65_536  # characters of a call's content kept for finding a key in it

Seen = tuple[str, str, "str | None", str]
"""What a hook reports of a call: kind, target, key, content."""


@dataclass(frozen=True, slots=True)
class Effect:
    """One call to the outside world. ``content``: what it sent (header values and the
    body, cut short), for finding a key sent under another name; never compared."""

    kind: str  # one of KINDS
    target: str  # "POST http://127.0.0.1:8080/charge", "amqp exchange 'orders' key 'x'"
    key: str | None  # the idempotency key it carried
    content: str = field(default="", compare=False, repr=False)

    @property
    def address(self) -> str | None:
        """``host:port`` of an HTTP target, to tell its connections from unknown ones."""
        found = re.match(r"^\S+ \w+://(?:[^@/]*@)?([^/:]+)(?::(\d+))?", self.target)
        if not found:
            return None
        scheme = self.target.split(" ", 1)[1].split(":", 1)[0]
        port = found.group(2) or ("443" if scheme == "https" else "80")
        return f"{found.group(1)}:{port}"

    @property
    def host(self) -> str:
        """The target without its path: what is left to compare when paths vary."""
        found = re.match(r"^(\S+ )?(\w+://[^/]+)", self.target)
        return f"{self.kind} {found.group(2)}" if found else f"{self.kind} {self.target}"


Recorder = Callable[[Effect], None]

_recorder: list[Recorder] = []


def install(record: Recorder) -> None:
    """Send every effect to ``record`` from now on; wrap the client libraries imported
    so far (called again, it wraps the ones imported since)."""
    _recorder[:] = [record]
    for module, patch in _PATCHES:
        found = sys.modules.get(module)
        if found is not None:
            patch(found)


def _seen(kind: str, target: str, key: str | None, content: str = "") -> None:
    if _recorder:
        _recorder[0](Effect(kind, target, key, content[:_CONTENT]))


def header_key(headers: Any, pattern: re.Pattern[str] = _KEY_HEADER) -> str | None:
    """The idempotency key among ``headers`` (a mapping or pairs), if one is named so."""
    if headers is None:
        return None
    items: Iterable[Any] = headers.items() if isinstance(headers, Mapping) else headers
    try:
        for name, value in items:
            text = name.decode() if isinstance(name, bytes) else str(name)
            if pattern.match(text):
                return value.decode() if isinstance(value, bytes) else str(value)
    except (TypeError, ValueError):
        return None
    return None


def _request(method: str) -> str:
    return "read" if method in _SAFE else "request"


def _url(url: Any) -> str:
    """A URL without its query: ``scheme://host:port/path``."""
    text = str(url)
    return text.split("?", 1)[0].split("#", 1)[0]


def _wrap(owner: Any, name: str, before: Callable[..., Seen]) -> None:
    """Replace ``owner.name`` with a wrapper that reports ``before(self, *args, **kw)``
    (kind, target, key) and then calls the original, sync or async alike."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, _MARK, False):
        return

    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            _report(before, self, args, kwargs)
            return await original(self, *args, **kwargs)

    else:

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            _report(before, self, args, kwargs)
            return original(self, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


def _report(
    before: Callable[..., Seen],
    self: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    if not _recorder:
        return
    try:
        kind, target, key, content = before(self, *args, **kwargs)
    except Exception:  # a call shaped unlike the one we know: still a call
        kind, target, key, content = "request", f"{type(self).__name__}", None, ""
    _seen(kind, target, key, content)


def _text(*parts: Any) -> str:
    """What a call sends, as text: header values, bodies, whatever can be read cheaply."""
    out = []
    for part in parts:
        if part is None:
            continue
        if isinstance(part, bytes | bytearray):
            out.append(bytes(part[:_CONTENT]).decode(errors="replace"))
        elif isinstance(part, Mapping):
            out.extend(_text(k, v) for k, v in part.items())
        elif isinstance(part, list | tuple):
            out.extend(_text(item) for item in part)
        else:
            out.append(str(part)[:_CONTENT])
    return " ".join(out)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


# -- the libraries ----------------------------------------------------------------------


def _httpx(module: Any) -> None:
    def sent(_client: Any, request: Any, *_args: Any, **_kwargs: Any) -> Seen:
        method = str(request.method).upper()
        try:
            body: Any = request.content
        except Exception:  # a stream not read yet
            body = None
        content = _text(list(request.headers.values()), str(request.url), body)
        target = f"{method} {_url(request.url)}"
        return _request(method), target, header_key(request.headers), content

    _wrap(module.AsyncClient, "send", sent)
    _wrap(module.Client, "send", sent)


def _aiohttp(module: Any) -> None:
    def sent(session: Any, method: str, url: Any, **kwargs: Any) -> Seen:
        base = getattr(session, "_base_url", None)
        where = f"{base}{url}" if base is not None and not str(url).startswith("http") else url
        verb = method.upper()
        headers = kwargs.get("headers")
        content = _text(headers, str(where), kwargs.get("json"), kwargs.get("data"))
        return _request(verb), f"{verb} {_url(where)}", header_key(headers), content

    _wrap(module.ClientSession, "_request", sent)


def _aio_pika(module: Any) -> None:
    def sent(exchange: Any, *args: Any, **kwargs: Any) -> Seen:
        message = _arg(args, kwargs, 0, "message")
        routing_key = _arg(args, kwargs, 1, "routing_key")
        target = f"amqp exchange {getattr(exchange, 'name', '')!r} key {routing_key!r}"
        content = _text(getattr(message, "headers", None), getattr(message, "body", None))
        return "publish", target, getattr(message, "message_id", None), content

    _wrap(module.Exchange, "publish", sent)


def _pika(module: Any) -> None:
    def sent(_channel: Any, *args: Any, **kwargs: Any) -> Seen:
        exchange = _arg(args, kwargs, 0, "exchange")
        routing_key = _arg(args, kwargs, 1, "routing_key")
        properties = _arg(args, kwargs, 3, "properties")
        target = f"amqp exchange {exchange!r} key {routing_key!r}"
        content = _text(getattr(properties, "headers", None), _arg(args, kwargs, 2, "body"))
        return "publish", target, getattr(properties, "message_id", None), content

    _wrap(module.BlockingChannel, "basic_publish", sent)


def _aiokafka(module: Any) -> None:
    def sent(_producer: Any, *args: Any, **kwargs: Any) -> Seen:
        topic = _arg(args, kwargs, 0, "topic")
        headers = _arg(args, kwargs, 5, "headers")
        content = _text(headers, _arg(args, kwargs, 1, "value"), _arg(args, kwargs, 2, "key"))
        key = header_key(headers, _KAFKA_KEY_HEADER)
        return "publish", f"kafka topic {topic!r}", key, content

    _wrap(module.AIOKafkaProducer, "send", sent)


def _smtp(module: Any) -> None:
    def sent(smtp: Any, *args: Any, **kwargs: Any) -> Seen:
        host = getattr(smtp, "_host", None) or getattr(smtp, "hostname", None) or "?"
        recipients = _arg(args, kwargs, 1, "to_addrs") or _arg(args, kwargs, 1, "recipients")
        if isinstance(recipients, str):
            recipients = [recipients]
        to = ", ".join(str(r) for r in recipients or ())
        return "mail", f"smtp {host} to {to}", None, _text(_arg(args, kwargs, 2, "msg"))

    _wrap(module.SMTP, "sendmail", sent)


_PATCHES: tuple[tuple[str, Callable[[Any], None]], ...] = (
    ("httpx", _httpx),
    ("aiohttp", _aiohttp),
    ("aio_pika", _aio_pika),
    ("pika.adapters.blocking_connection", _pika),
    ("aiokafka", _aiokafka),
    ("smtplib", _smtp),
    ("aiosmtplib", _smtp),
)
