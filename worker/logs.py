"""structlog setup: JSON off a TTY, a readable console on one, and no secrets either way."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from typing import Any

import structlog

# A URL's credentials: everything from its scheme to the LAST "@" of the same token is the
# user information, and everything in it after the first ":" is the password. A raw "@" (or
# "/", "#", "?") inside a password makes parsers split at the first one and call the rest
# the host; masking up to the last one hides the whole password whichever way the URL was
# (mis)parsed, at the price of hiding a path or query "@" too.
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.\-]*://)(?P<userinfo>\S*)@", re.IGNORECASE)
# Names whose value is a secret, in a ``key=value`` pair, a quoted ``"key": "value"`` pair
# or as the key of a logged dict: passwords, *token (access_token, refresh_token...),
# *secret (client_secret), API, access and private keys, the storage AccountKey, Service
# Bus SharedAccessKey, a SAS URL's ``sig``, an Authorization header.
_SECRET_SUFFIXES = (
    *(f"{word}{joint}key" for word in ("api", "access", "private") for joint in ("", "_", "-")),
    *("password", "passwd", "pwd", "secret", "token", "sharedaccesskey", "accountkey"),
)
_SECRET_NAMES = frozenset({"sig", "authorization"})
_VALUE = r"(?P<value>\"[^\"]*\"|'[^']*'|[^;&\s]+)"
_KV_PAIR = re.compile(rf"(?<![\w.-])(?P<key>[\w.-]++)(?P<sep>\s*+=\s*+){_VALUE}")
_QUOTED_PAIR = re.compile(
    r"(?P<q>[\"'])(?P<key>[\w.-]++)(?P=q)(?P<sep>\s*+:\s*+)(?P<value>\"[^\"]*\"|'[^']*')"
)
# A Service Bus SAS token, alone or as a connection string's SharedAccessSignature=...:
# ``SharedAccessSignature sr=<uri>&sig=<hmac>&se=<expiry>&skn=<key name>``. Masked whole.
_SAS = re.compile(
    r"(?P<head>SharedAccessSignature\s*=\s*|SharedAccessSignature\s+(?=[\w%]+=))"
    r"(?:SharedAccessSignature\s+)?[^;\s\"']+",
    re.IGNORECASE,
)
# An Authorization header's credentials, whatever the scheme, and a bare bearer token.
_AUTHORIZATION = re.compile(
    r"(?P<head>\bauthorization[\"']?\s*:\s*[\"']?(?:[a-z]+\s+)?)[^\s\"',;]+", re.IGNORECASE
)
_BEARER = re.compile(r"(?P<head>\bbearer\s+)[\w\-.~+/]+=*", re.IGNORECASE)
_MASK = "***"
_MAX_DEPTH = 8
"""Nesting a logged value may have before it is rendered (and scrubbed) as one string."""


def scrub(text: str) -> str:
    """Mask secrets: URL passwords, ``key=value`` secrets, SAS tokens, Authorization values.

    Each pattern runs only when a substring it cannot match without is there: most log
    text costs a few substring tests and no regular expression.
    """
    if "@" in text:
        text = _URL_PASSWORD.sub(_mask_userinfo, text)
    if "ignature" in text or "IGNATURE" in text:
        text = _SAS.sub(r"\g<head>***", text)
    if ":" in text:
        if "uthorization" in text or "UTHORIZATION" in text:
            text = _AUTHORIZATION.sub(r"\g<head>***", text)
        if '":' in text or "':" in text:
            text = _QUOTED_PAIR.sub(_mask_pair, text)
    if "earer" in text or "EARER" in text:
        text = _BEARER.sub(r"\g<head>***", text)
    if "=" in text:
        text = _KV_PAIR.sub(_mask_pair, text)
    return text


def _mask_userinfo(match: re.Match[str]) -> str:
    user, colon, _password = match["userinfo"].partition(":")
    return f"{match['head']}{user}:{_MASK}@" if colon else match[0]


def _mask_pair(match: re.Match[str]) -> str:
    if not is_secret_name(match["key"]):
        return match[0]
    quote = match.groupdict().get("q") or ""
    masked = f"{match['value'][0]}{_MASK}{match['value'][0]}" if quote else _MASK
    return f"{quote}{match['key']}{quote}{match['sep']}{masked}"


def is_secret_name(name: str) -> bool:
    """True for a field or key whose value is a secret (``password``, ``api_key``...)."""
    lowered = name.lower()
    return lowered.endswith(_SECRET_SUFFIXES) or lowered in _SECRET_NAMES


_PLAIN = (int, float, type(None))  # bool is an int


def scrub_value(value: Any, depth: int = 0) -> Any:
    """A logged value with every secret in it masked, at any depth.

    Containers are copied (the caller's objects stay untouched) with their contents
    scrubbed, and the value of a secret-named key (``{"password": ...}``) is masked
    whole. Any other object is left alone unless its ``repr``, which is what the
    renderers print, carries a secret: then the scrubbed ``repr`` replaces it.
    """
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, BaseException):
        return scrub(f"{type(value).__name__}: {value}")
    if depth < _MAX_DEPTH:  # deeper (or cyclic): one string, below
        if isinstance(value, Mapping):
            return {
                key: _MASK
                if isinstance(key, str) and is_secret_name(key) and value[key] is not None
                else scrub_value(item, depth + 1)
                for key, item in value.items()
            }
        if isinstance(value, list | tuple | set | frozenset):
            items = [scrub_value(item, depth + 1) for item in value]
            return tuple(items) if isinstance(value, tuple) else items
    shown = repr(value)
    masked = scrub(shown)
    return value if masked == shown else masked


def _scrub_event(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in event.items():
        if isinstance(value, _PLAIN):
            continue
        if is_secret_name(key):
            event[key] = _MASK
        else:
            event[key] = scrub_value(value)
    return event


def configure(level: str = "INFO", fmt: str = "auto") -> None:
    """Configure structlog once per process; logs go to stderr, data to stdout."""
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        # tracebacks become text *before* the scrubber sees the event: an exception's
        # message may carry a connection string
        structlog.processors.format_exc_info,
        _scrub_event,
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(),
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries (aio-pika, aiokafka, azure, alembic) log through the standard library:
    # render their records the same way, scrubbed, so the stream stays one format.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *processors[3:],
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(logging.WARNING, logging.getLevelNamesMapping()[level]))


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger("worker").bind(**bound)
