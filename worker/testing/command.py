"""``worker check SAMPLES``: the handlers of ``WORKER_HANDLERS`` through every scenario of
:func:`worker.testing.check_idempotent`, on databases of the kit's own.

The samples file holds JSON lines (``-``: stdin), one of two kinds::

    {"type": "CreditRequested", "body": {"account_id": "a-1", "amount": "10.00"}}
    {"type": "CreditRequested", "id": "c-2", "body": {...}, "headers": {...}}
    {"table": "products", "row": {"id": "p-1", "name": "Widget", "price": "9.99", "version": 1}}

Messages are delivered in file order (ids default to ``sample-<n>``); every run starts
from the ``table`` rows. Exit 0 when every scenario agrees with applying each message
once, 1 with the report of the first that does not (or a database that cannot be
reached), 2 for a bad samples file or option.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

from sqlalchemy.exc import DBAPIError

from worker import logs
from worker.db import redact
from worker.errors import ConfigurationError
from worker.registry import import_handlers
from worker.settings import Settings
from worker.testing.check import Sample, check_idempotent


def read_samples(lines: Iterable[str]) -> tuple[list[Sample], list[tuple[str, dict[str, Any]]]]:
    """Messages and starting rows from JSON lines; the first bad line stops everything."""
    samples: list[Sample] = []
    rows: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise TypeError("not a JSON object")
            if "table" in item:
                table, row = item["table"], item["row"]
                if not isinstance(table, str) or not isinstance(row, dict):
                    raise TypeError('"table" must be a name and "row" an object')
                rows.append((table, row))
                continue
            samples.append(_sample(item))
        except (ValueError, KeyError, TypeError) as exc:
            what = f"missing {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise ConfigurationError(f"samples line {number}: {what}") from None
    if not samples:
        raise ConfigurationError('samples: no message (a line with "type" and "body")')
    return samples, rows


def _sample(item: dict[str, Any]) -> Sample:
    kind, body = item["type"], item["body"]
    message_id, headers = item.get("id"), item.get("headers")
    if not isinstance(kind, str) or not isinstance(message_id, str | None):
        raise TypeError('"type" and "id" must be strings')
    if not isinstance(headers, dict | None):
        raise TypeError('"headers" must be an object')
    if not isinstance(body, dict | str):  # any other JSON value, as JSON
        body = json.dumps(body)
    return Sample(kind, body, message_id, headers)


def _read(source: str) -> tuple[list[Sample], list[tuple[str, dict[str, Any]]]]:
    if source == "-":
        return read_samples(sys.stdin)
    try:
        with open(source, encoding="utf-8") as handle:
            return read_samples(handle)
    except OSError as exc:
        raise ConfigurationError(f"samples {source!r}: {exc.strerror or exc}") from None


async def check_command(settings: Settings, args: argparse.Namespace) -> int:
    """``worker check``: print the report; 0 idempotent, 1 not (or no database), 2 misuse."""
    if settings.log_level != "DEBUG":
        logs.configure("ERROR", settings.log_format)  # the crashes it injects log warnings
    samples, given = _read(args.samples)
    import_handlers(settings.handler_modules)
    database = args.database or None
    try:
        report = await check_idempotent(
            samples,
            tables=args.table or None,
            given=given,
            database=database,
            scenarios=args.scenario or None,
        )
    except (ValueError, LookupError) as exc:
        raise ConfigurationError(f"worker check: {exc}") from None
    except (DBAPIError, OSError) as exc:
        where = redact(database) if database else "a SQLite file"
        line = " ".join(str(getattr(exc, "orig", None) or exc).split()) or type(exc).__name__
        print(f"worker check: database unavailable: {where}: {logs.scrub(line)}", file=sys.stderr)
        return 1
    print(report)
    return 0 if report.ok else 1
