"""structlog setup: JSON off a TTY, a readable console on one, and no secrets either way."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import structlog

_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.\-]*://[^:/@\s]*:)[^@\s]+@", re.IGNORECASE)
_KV_SECRET = re.compile(
    r"(?P<key>password|pwd|sharedaccesskey|accountkey|secret)=[^;&\s]+", re.IGNORECASE
)


def scrub(text: str) -> str:
    """Mask passwords in URLs and ``Key=value`` connection strings."""
    if "=" not in text and "@" not in text:
        return text
    text = _URL_PASSWORD.sub(r"\g<head>***@", text)
    return _KV_SECRET.sub(r"\g<key>=***", text)


def _scrub_event(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = scrub(value)
        elif isinstance(value, BaseException):
            event[key] = scrub(f"{type(value).__name__}: {value}")
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
