"""The worker command line: run the consumer, migrate its schema, operate its queues and inbox.

Every failure a person can fix (a bad setting, a database or broker that cannot be
reached, a refused login, a schema never migrated) ends as one line on stderr naming
what failed, with secrets masked: exit code 2 for configuration, 1 for the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker import logs
from worker.brokers import (
    DEFAULT_SCAN,
    DeadLetterFilter,
    DeadLetterInfo,
    OutgoingMessage,
    open_admin,
)
from worker.errors import BrokerUnavailable, ConfigurationError, MigrationFailed, PublishStopped
from worker.settings import Settings, check_environment, load

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from worker.brokers import Broker
    from worker.histories import History
    from worker.migrate import Status
    from worker.pump import Pump
    from worker.registry import Registry


def command_line() -> argparse.ArgumentParser:
    """The command line: each command with what it does and the settings it reads."""
    parser = argparse.ArgumentParser(
        prog="worker",
        description="An idempotent message consumer, and the tools to operate it.",
        epilog="Settings come from WORKER_* environment variables: README.md, Configuration. "
        "`worker COMMAND --help` says what a command does and which ones it reads.",
        formatter_class=_OneLinePerCommand,
    )
    parser.add_argument(
        "-V", "--version", action=_Version, help="print the version and revision, then exit"
    )
    commands = parser.add_subparsers(
        dest="command", required=True, title="commands", metavar="COMMAND"
    )
    _command(commands, "run", "consume from WORKER_BROKER until SIGTERM/SIGINT")
    migrate = _command(
        commands,
        "migrate",
        "upgrade WORKER_DATABASE_URL: the worker's tables, then your handlers', or wait",
    )
    gate = migrate.add_mutually_exclusive_group()
    gate.add_argument("--check", action="store_true", help="exit 0 if at head, 1 if not")
    gate.add_argument("--wait", action="store_true", help="wait until at head (exit 0)")
    migrate.add_argument("--timeout", type=float, default=600.0, help="--wait: give up after")
    migrate.add_argument(
        "--lock-timeout",
        type=_positive_seconds,
        default=5.0,
        help="seconds a DDL waits for its lock (more than 0)",
    )
    migrate.add_argument(
        "--worker-only",
        action="store_true",
        help="only the worker's own tables (your application runs its own Alembic)",
    )
    _revision_arguments(
        _command(
            commands,
            "revision",
            "add a migration to your handlers' history (migrations/versions/)",
        )
    )
    demo = _command(commands, "demo", "the race and its cure, on SQLite and the memory broker")
    demo.add_argument("--messages", type=int, default=400, help="credit messages to send")
    publish = _command(
        commands, "publish", 'send JSON lines {"id", "type", "body", "headers"?} to the work queue'
    )
    publish.add_argument("file", nargs="?", default="-", help="JSON lines file; - for stdin")
    publish.add_argument(
        "--allow-missing-ids",
        action="store_true",
        help='send lines without "id" (the broker or its client invents one: a re-run '
        "sends them again as new messages)",
    )
    _dlq_arguments(
        _command(
            commands,
            "dlq",
            "list, group or re-submit dead letters, filtered by type, reason, time or id",
        )
    )
    sweep = _command(commands, "sweep", "list side-effect claims left past their lease")
    sweep.add_argument("--redrive", action="store_true", help="finish them from the stored body")
    sweep.add_argument("--limit", type=_positive, default=100, help="at most this many")
    sweep.add_argument("--abandoned", action="store_true", help="list abandoned claims instead")
    _command(commands, "purge-inbox", "delete finished markers older than the retention")
    relay = _command(commands, "relay", "send committed outbox rows to WORKER_BROKER")
    relay.add_argument("--once", action="store_true", help="send what is due, then exit")
    outbox = _command(commands, "outbox", "list pending and parked outbox rows")
    outbox.add_argument("--retry", action="store_true", help="re-queue the parked rows")
    outbox.add_argument("--limit", type=_positive, default=100, help="at most this many")
    check = _command(
        commands, "check", "prove handlers idempotent on sample messages (docs/testing.md)"
    )
    check.add_argument("samples", help='JSON lines: {"type", "body"} messages, {"table", "row"}')
    check.add_argument("--table", action="append", default=[], help="compare this table")
    check.add_argument("--database", metavar="URL", help="PostgreSQL server for scratch databases")
    check.add_argument("--scenario", action="append", default=[], help="run only this scenario")
    return parser


def main(argv: Sequence[str] | None = None) -> int:  # noqa: C901 - one branch per command
    put_project_on_path()
    line = command_line()
    args = line.parse_args(argv)
    if args.command == "revision" and not args.message and not args.dry_run:
        line.error("revision: -m/--message is required (what the revision does), or --dry-run")

    try:
        settings = load(Settings, check=False)
        logs.configure(settings.log_level, settings.log_format)
        if _serves_handlers(args):
            # First, before the unknown-variable check imports them for their settings: a
            # module that fails half-way would otherwise run its registrations twice.
            from worker.registry import import_handlers

            import_handlers(settings.handler_modules)
        check_environment(Settings)
        if args.command == "run":
            return asyncio.run(_serve(settings))
        if args.command == "migrate":
            return _migrate(settings, args)
        if args.command == "revision":
            return _revision(settings, args)
        if args.command == "publish":
            _quiet_libraries(settings)
            lines = _read_input(args.file, allow_missing_ids=args.allow_missing_ids)
            return asyncio.run(_publish(settings, lines))
        if args.command == "dlq":
            _quiet_libraries(settings)
            return asyncio.run(_dlq_command(settings, args))
        if args.command == "sweep":
            return asyncio.run(
                sweep_command(
                    settings,
                    redrive_claims=args.redrive,
                    limit=args.limit,
                    abandoned=args.abandoned,
                )
            )
        if args.command == "purge-inbox":
            from worker.retention import purge_command

            refuse_transaction_pooling(settings, "worker purge-inbox holds a session lock")
            return asyncio.run(purge_command(settings))
        if args.command == "check":
            from worker.testing.command import check_command

            return asyncio.run(check_command(settings, args))
        if args.command in ("relay", "outbox"):
            from worker.outbox.commands import outbox_command, relay_command

            if args.command == "relay":
                return asyncio.run(relay_command(settings, once=args.once))
            return asyncio.run(outbox_command(settings, retry=args.retry, limit=args.limit))
        run_demo = _demo()
        logs.configure("ERROR", settings.log_format)  # the demo's output is its table
        return asyncio.run(run_demo(messages=args.messages))
    except PublishStopped as exc:
        print(f"worker: publish stopped: {logs.scrub(str(exc))}", file=sys.stderr)
        return 2 if exc.configuration else 1
    except ConfigurationError as exc:
        print(f"worker: configuration error: {logs.scrub(str(exc))}", file=sys.stderr)
        return 2
    except BrokerUnavailable as exc:
        print(f"worker: broker unavailable: {logs.scrub(str(exc))}", file=sys.stderr)
        return 1
    except MigrationFailed as exc:
        print(f"worker: migration failed: {logs.scrub(str(exc))}", file=sys.stderr)
        return 1
    except SchemaBehind as exc:
        where = _database_named()
        print(f"worker: database not migrated: {where}: {exc} ({exc.remedy})", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader left (`worker demo | head`): end quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 1
    except Exception as exc:  # a database that cannot serve: one line, not a traceback
        failure = database_failure(exc, args.command)
        if failure is None:
            raise
        print(failure.line, file=sys.stderr)
        return failure.code


class _Version(argparse.Action):
    """``worker -V``: the package's version and the source revision, looked up only when
    asked (a source checkout asks git)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> None:
        import worker

        print(f"{parser.prog} {worker.__version__} (revision {revision() or 'unknown'})")
        parser.exit()


def revision() -> str:
    """The source revision: the image's (its build sets the variable), else the commit of the
    git checkout the package runs from (an editable install; ``-dirty`` with uncommitted
    changes to tracked files), else ""."""
    from worker.metrics import REVISION_VARIABLE

    told = os.environ.get(REVISION_VARIABLE, "").strip()
    if told:
        return told
    checkout = Path(__file__).resolve().parent.parent
    git = shutil.which("git")
    if git is None or not (checkout / ".git").exists():  # a file in a worktree, else a folder
        return ""
    try:
        head = _git(git, checkout, "rev-parse", "--short=12", "HEAD")
        changes = _git(git, checkout, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # git refuses (not a repository, ownership)
        return ""
    return f"{head}-dirty" if changes else head


def _git(git: str, checkout: Path, *command: str) -> str:
    done = subprocess.run(
        [git, "-C", str(checkout), *command], capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def _demo() -> Callable[..., Coroutine[Any, Any, int]]:
    """The demo, which runs the example application: the repository's ``handlers/``,
    imported from the checkout (the package does not install it, so that it never shadows
    a user's own ``handlers``)."""
    try:
        from worker.demo import demo
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "handlers":
            raise
        raise ConfigurationError(
            "worker demo runs the example application, handlers/ of the source repository, "
            "which the package does not install: run it in a checkout (README, Two commands)"
        ) from None
    return demo


def _serves_handlers(args: argparse.Namespace) -> bool:
    """Whether the command imports WORKER_HANDLERS (and refuses a module that fails to)."""
    if args.command == "migrate":
        return not args.worker_only
    if args.command == "revision":
        return not args.worker
    return args.command in ("run", "check", "sweep")


def put_project_on_path() -> None:
    """Import handlers from the working directory, whichever way the worker was started.

    ``python -m worker`` puts the working directory first on ``sys.path``; the ``worker``
    console script puts its own bin directory there instead, so ``WORKER_HANDLERS=shop.orders``
    run from the project folder imported with one and not the other. Both now find the
    project's packages the way ``python -m`` does, and neither does under ``python -P`` /
    ``PYTHONSAFEPATH``, which keeps the working directory off the path on purpose.
    """
    if sys.flags.safe_path:
        return
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def _applications(settings: Settings) -> tuple[list[History], list[str]]:
    """The histories of the applications WORKER_HANDLERS names, and their models' tables.

    The handler modules are imported as ``worker run`` imports them: one that cannot be
    refuses the command, so a migration never reports success for code that cannot start.
    """
    from worker.histories import application_histories, model_tables
    from worker.registry import import_handlers

    import_handlers(settings.handler_modules)
    return list(application_histories(settings.handler_modules)), sorted(model_tables())


def _migrate(settings: Settings, args: argparse.Namespace) -> int:
    from worker.migrate import migrate_command

    if not args.check and not args.wait:  # the gate only reads: fine behind any pooler
        refuse_transaction_pooling(settings, "worker migrate holds a session lock")
    applications, tables = ([], []) if args.worker_only else _applications(settings)
    return migrate_command(
        settings.database_url,
        check=args.check,
        wait=args.wait,
        timeout=args.timeout,
        lock_timeout=args.lock_timeout,
        applications=applications,
        tables=tables,
        inbox_layout=settings.inbox_layout,
        partition_period=settings.partition_period,
    )


def _revision_arguments(revision: argparse.ArgumentParser) -> None:
    revision.add_argument("-m", "--message", help="what the revision does (required to write)")
    revision.add_argument(
        "--autogenerate",
        action="store_true",
        help="from your models against WORKER_DATABASE_URL (migrated to head first)",
    )
    revision.add_argument(
        "--dry-run",
        action="store_true",
        help="print what --autogenerate would write, write nothing: exit 0 when your models "
        "and the database agree, 1 when a revision is needed",
    )
    revision.add_argument(
        "--application", help="the package to write for, when WORKER_HANDLERS names several"
    )
    revision.add_argument("--rev-id", help="the revision's id (default: a random one)")
    revision.add_argument(
        "--worker",
        action="store_true",
        help="the worker's own history (its maintainers, in a source checkout)",
    )


def _revision(settings: Settings, args: argparse.Namespace) -> int:
    from worker.histories import WORKER, history_to_write
    from worker.migrate import revision

    if args.worker:
        history = WORKER
    else:
        _applications(settings)  # the models autogenerate compares, and the refusal
        history = history_to_write(settings.handler_modules, args.application)
    if args.dry_run:
        from worker.migrate import pending_changes

        changes = pending_changes(history, settings.database_url)
        if not changes:
            print(f"{history.name}: your models and the database agree: no revision needed")
            return 0
        print(f"{history.name}: `worker revision -m MESSAGE --autogenerate` would write:")
        print(changes)
        return 1
    path = revision(
        history,
        args.message,
        database_url=settings.database_url if args.autogenerate else None,
        rev_id=args.rev_id,
    )
    print(f"{history.name}: wrote {path} (read it before you migrate)")
    return 0


class PublishInput:
    """``worker publish`` input, checked whole before anything is sent: the messages and the
    input line each came from."""

    __slots__ = ("lines", "messages")

    def __init__(self) -> None:
        self.messages: list[OutgoingMessage] = []
        self.lines: list[int] = []


def read_messages(lines: Iterable[str], *, allow_missing_ids: bool = False) -> PublishInput:
    """Parse ``worker publish`` input; a bad line stops everything before anything is sent.

    A line without ``"id"`` is refused unless ``allow_missing_ids``: the broker (or its
    client) would invent an id, and a re-run after a partial failure would apply it twice.
    """
    parsed = PublishInput()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            message_id, kind, headers = item.get("id"), item["type"], item.get("headers") or {}
            body = item["body"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigurationError(
                f"publish input line {number}: {type(exc).__name__}: {exc}"
            ) from None
        problem = _publish_problem(message_id, kind, headers, allow_missing_ids)
        if problem:
            raise ConfigurationError(f"publish input line {number}: {problem}; nothing was sent")
        raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        parsed.messages.append(OutgoingMessage(message_id, kind, raw, headers))
        parsed.lines.append(number)
    return parsed


def _publish_problem(message_id: Any, kind: Any, headers: Any, allow_missing_ids: bool) -> str:
    if message_id is None and not allow_missing_ids:
        return 'no "id" (a re-run would send it again as a new message; --allow-missing-ids)'
    if message_id is not None and (not isinstance(message_id, str) or not message_id):
        return '"id" must be a non-empty string'
    if not isinstance(kind, str) or not kind:
        return '"type" must be a non-empty string'
    if not isinstance(headers, dict):
        return '"headers" must be an object'
    return ""


def _read_input(path: str, *, allow_missing_ids: bool) -> PublishInput:
    if path == "-":
        return read_messages(sys.stdin, allow_missing_ids=allow_missing_ids)
    try:
        with open(path, encoding="utf-8") as handle:
            return read_messages(handle, allow_missing_ids=allow_missing_ids)
    except OSError as exc:
        raise ConfigurationError(f"publish input {path!r}: {exc.strerror or exc}") from None


async def _publish(settings: Settings, parsed: PublishInput) -> int:
    admin = open_admin(settings)
    try:
        sent = await admin.publish(parsed.messages)
    except PublishStopped as exc:
        lines = [parsed.lines[index] for index in exc.confirmed]
        rest = len(parsed.messages) - len(lines)
        raise PublishStopped(
            f"{exc}; confirmed {len(lines)} of {len(parsed.messages)} messages: input lines "
            f"{line_ranges(lines) or 'none'} went out, the {rest} others may not have",
            exc.confirmed,
            configuration=exc.configuration,
        ) from None
    finally:
        await admin.close()
    print(f"published {sent} messages", file=sys.stderr)
    return 0


def line_ranges(numbers: Sequence[int]) -> str:
    """``1-35,37``: sorted line numbers as ranges."""
    ranges: list[str] = []
    for number in sorted(numbers):
        if ranges and ranges[-1].rsplit("-", 1)[-1] == str(number - 1):
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{number}"
        else:
            ranges.append(str(number))
    return ",".join(ranges)


# -- what each command's --help says -----------------------------------------------

_CONFIGURATION = "README.md, Configuration: every variable, its default and what it means"
_BROKER_SETTINGS = (
    "WORKER_BROKER and its own WORKER_RABBITMQ_*, WORKER_KAFKA_* or WORKER_SERVICEBUS_* "
    "(docs/rabbitmq.md, docs/kafka.md, docs/servicebus.md)"
)
# command -> (what it does, at length; the settings it reads)
_ABOUT: dict[str, tuple[str, str]] = {
    "run": (
        "Consume from WORKER_BROKER with the handlers of WORKER_HANDLERS: each delivery in one\n"
        "transaction with its inbox marker, acked after the commit. Refuses to start on a\n"
        "schema behind the code (run `worker migrate` first). Alive and not ready while the\n"
        "database or the broker is not there yet (WORKER_START_TIMEOUT); SIGTERM or SIGINT\n"
        "stops it gracefully within WORKER_GRACE_PERIOD.",
        "WORKER_DATABASE_URL, WORKER_HANDLERS, WORKER_CONCURRENCY, WORKER_MAX_DELIVERIES, "
        f"WORKER_BATCH_SIZE, WORKER_OPS_PORT, the retention and purge variables, and "
        f"{_BROKER_SETTINGS}",
    ),
    "migrate": (
        "Upgrade WORKER_DATABASE_URL: the worker's history, then the history found beside\n"
        "each module of WORKER_HANDLERS (README, Your own handlers). --check and --wait only\n"
        "read: they compare each history's revision and look for the models' tables (not\n"
        "their columns: `worker revision --dry-run` compares your models with the database).\n"
        "\nexamples:\n  worker migrate\n  worker migrate --check\n"
        "  worker migrate --wait --timeout 600",
        "WORKER_DATABASE_URL, WORKER_HANDLERS, WORKER_INBOX_LAYOUT, WORKER_INBOX_PARTITION_PERIOD",
    ),
    "revision": (
        "Write the next revision of your application's history, beside its handlers.\n"
        "--autogenerate fills it from your models against WORKER_DATABASE_URL (migrated to\n"
        "head first); --dry-run prints what that would write, and writes nothing.\n"
        '\nexamples:\n  worker revision -m "orders" --autogenerate\n  worker revision --dry-run',
        "WORKER_HANDLERS, WORKER_DATABASE_URL (--autogenerate, --dry-run)",
    ),
    "demo": (
        "The race and its cure: one stream of credit messages (duplicates, both replicas at\n"
        "once, lost acks) through a naive check-then-insert handler and through the worker,\n"
        "then an event per applied credit three ways. SQLite files in a temporary folder and\n"
        "the in-memory broker; about 10-20 seconds.",
        "none (it makes its own databases)",
    ),
    "publish": (
        'Send JSON lines {"id": ..., "type": ..., "body": {...}, "headers": {...}} to the\n'
        "work queue. The whole input is checked first; a line without an id is refused\n"
        "unless --allow-missing-ids.\n"
        "\nexamples:\n  worker publish messages.jsonl\n"
        '  echo \'{"id": "c-1", "type": "CreditRequested", "body": {}}\' | worker publish',
        _BROKER_SETTINGS,
    ),
    "dlq": (
        "List the dead letters with their reasons: a table on a terminal, JSON lines when\n"
        "piped (or with --json). Listing only peeks: the dead letters keep their order and\n"
        "no delivery count is spent.\n"
        "\n"
        "The filters (--type, --reason, --since, --id) select the same dead letters for a\n"
        "listing, for --group-by and for --resubmit; try a --resubmit with --dry-run first.\n"
        "At most --scan dead letters are looked at, oldest first.\n"
        "\n"
        "examples:\n"
        "  worker dlq --group-by reason\n"
        '  worker dlq --type CreditRequested --reason "invalid body" --since 2h\n'
        '  worker dlq --reason "account service" --resubmit --dry-run',
        _BROKER_SETTINGS,
    ),
    "sweep": (
        "List the side-effect claims left past their lease (a replica died between its claim\n"
        "and its call), as JSON lines; --redrive finishes them from the stored body.",
        "WORKER_DATABASE_URL, WORKER_HANDLERS, WORKER_CLAIM_LEASE, WORKER_CLAIM_CALL_TIMEOUT",
    ),
    "purge-inbox": (
        "Delete finished inbox markers older than the retention, in bounded batches, one\n"
        "replica at a time (a partitioned inbox: make partitions ahead, drop whole ones).\n"
        "`worker run` does the same every WORKER_PURGE_INTERVAL seconds.",
        "WORKER_DATABASE_URL, WORKER_INBOX_RETENTION (and the redelivery window's "
        "WORKER_BROKER_LOCK_TIMEOUT, WORKER_MAX_DELIVERIES, WORKER_MESSAGE_TTL, "
        "WORKER_DEAD_LETTER_MARGIN), WORKER_PURGE_BATCH, WORKER_PURGE_MAX_BATCHES",
    ),
    "relay": (
        "Send the committed outbox rows to WORKER_BROKER on their own (a dedicated\n"
        "deployment; `worker run` relays them too unless WORKER_OUTBOX_RELAY=false).",
        f"WORKER_DATABASE_URL, WORKER_OUTBOX_*, {_BROKER_SETTINGS}",
    ),
    "outbox": (
        "List the pending and parked outbox rows; --retry queues the parked ones again.",
        "WORKER_DATABASE_URL, WORKER_OUTBOX_*",
    ),
    "check": (
        "Run your handlers' sample messages through the races this worker exists for\n"
        "(twice, twins, a crash at every statement, a concurrent writer, a lost ack) on\n"
        "databases of its own, and report the first that changes the outcome\n"
        "(docs/testing.md). Exit 0 idempotent, 1 not, 2 for a bad samples file.\n"
        "\nexamples:\n  worker check samples.jsonl\n"
        "  worker check samples.jsonl --database postgresql+asyncpg://postgres@localhost/",
        "WORKER_HANDLERS",
    ),
}


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str
) -> argparse.ArgumentParser:
    about, settings = _ABOUT[name]
    return commands.add_parser(
        name,
        help=summary,
        description=about,
        epilog=f"settings: {settings}.\n{_CONFIGURATION}.",
        formatter_class=_Paragraphs,
    )


class _Paragraphs(argparse.RawDescriptionHelpFormatter):
    """The description as written (its lines and examples); the epilog wrapped."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("settings: "):
            import textwrap

            return "\n".join(
                textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                for line in text.splitlines()
            )
        return super()._fill_text(text, width, indent)


class _OneLinePerCommand(argparse.HelpFormatter):
    """Wide enough that no command's description wraps onto a second line.

    argparse measures the command names one indent short of where it prints them,
    so a long name (purge-inbox) would push its description to the next line.
    """

    def __init__(self, prog: str) -> None:
        width = max(100, shutil.get_terminal_size((100, 24)).columns)
        super().__init__(prog, max_help_position=24, width=width)

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            names = [len(choice) for choice in action.choices]
            longest = max(names, default=0) + self._current_indent + 2 * self._indent_increment
            self._action_max_length = max(self._action_max_length, longest)


# -- worker dlq ------------------------------------------------------------------


def _dlq_arguments(dlq: argparse.ArgumentParser) -> None:
    dlq.add_argument("--json", action="store_true", help="JSON lines, even on a terminal")
    dlq.add_argument(
        "--group-by", choices=("reason", "type"), help="one row per reason or type, with counts"
    )
    dlq.add_argument("--type", action="append", default=[], help="this message type (repeatable)")
    dlq.add_argument("--reason", help="reason contains this text (case-insensitive)")
    dlq.add_argument(
        "--since", type=_since, help="dead-lettered at or after: ISO time, or an age (30m, 2h, 7d)"
    )
    dlq.add_argument("--id", action="append", default=[], help="this message id (repeatable)")
    dlq.add_argument("--resubmit", action="store_true", help="move them back to the work queue")
    dlq.add_argument("--dry-run", action="store_true", help="with --resubmit: show, move nothing")
    dlq.add_argument(
        "--include-no-id",
        action="store_true",
        help="with --resubmit: move dead letters without a message id too (left out by default)",
    )
    dlq.add_argument(
        "--limit", type=_positive, default=100, help="list or move at most this many (100)"
    )
    dlq.add_argument(
        "--scan", type=_positive, default=DEFAULT_SCAN, help=f"look at most at ({DEFAULT_SCAN})"
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number of seconds") from None
    if not value > 0 or value == float("inf"):  # 0 would turn the lock timeout off
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value


_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _since(text: str) -> datetime:
    """``2h`` (an age) or ``2026-12-01T08:00:00Z`` (a time; no zone means UTC)."""
    age = _AGE.match(text.strip())
    if age:
        return datetime.now(UTC) - timedelta(seconds=float(age[1]) * _AGE_UNITS[age[2]])
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: not an ISO time or an age like 30m, 2h, 7d"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


async def _dlq_command(settings: Settings, args: argparse.Namespace) -> int:
    if args.dry_run and not args.resubmit:
        raise ConfigurationError("worker dlq: --dry-run goes with --resubmit")
    if args.group_by and args.resubmit:
        raise ConfigurationError("worker dlq: --group-by lists; it does not go with --resubmit")
    if args.include_no_id and not args.resubmit:
        raise ConfigurationError("worker dlq: --include-no-id goes with --resubmit")
    match = DeadLetterFilter(
        types=frozenset(args.type),
        reason=args.reason or None,
        since=args.since,
        ids=frozenset(args.id),
        with_id=args.resubmit and not args.include_no_id,
    )
    return await _dlq(
        settings,
        args.limit,
        resubmit=args.resubmit,
        match=match,
        group_by=args.group_by,
        as_json=args.json or not sys.stdout.isatty(),
        dry_run=args.dry_run,
        scan=args.scan,
    )


async def _dlq(
    settings: Settings,
    limit: int,
    *,
    resubmit: bool,
    match: DeadLetterFilter | None = None,
    group_by: str | None = None,
    as_json: bool = True,
    dry_run: bool = False,
    scan: int = DEFAULT_SCAN,
) -> int:
    admin = open_admin(settings)
    selected = "" if match is None or match.everything else "matching "
    left_out = 0
    try:
        if resubmit and match is not None and match.with_id:
            # dead letters without a message id stay: re-submitted, each would be applied
            # under an id the broker invented for it, and again after every re-submission
            without = replace(match, with_id=False)
            left_out = sum(
                letter.message_id is None
                for letter in await admin.dead_letters(scan, without, scan=scan)
            )
        if resubmit and not dry_run:
            moved = await admin.resubmit(limit, match, scan=scan)
            more = f" (--limit {limit} reached: run again for more)" if moved >= limit else ""
            print(f"re-submitted {moved} {selected}dead letters{more}", file=sys.stderr)
            _say_left_out(left_out)
            return 0
        # a group and a dry run count every match the scan finds; the rest show ``limit``
        wanted = scan if group_by or dry_run else limit
        letters = await admin.dead_letters(wanted, match, scan=scan)
    finally:
        await admin.close()
    matched = len(letters)
    if dry_run:
        letters = letters[:limit]
    if group_by:
        _print_groups(letters, group_by, as_json=as_json)
    else:
        _print_letters(letters, as_json=as_json)
    if dry_run:
        cut = (
            f" of {matched} {selected}dead letters found (--limit {limit} cut the rest: "
            "raise it, or run again after this one)"
            if matched > len(letters)
            else f" {selected}dead letters"
        )
        scanned = f" in the first {scan} looked at (--scan)" if matched >= scan else ""
        print(f"would re-submit {len(letters)}{cut}{scanned}", file=sys.stderr)
        _say_left_out(left_out)
    elif not as_json and not letters:
        print(f"no {selected}dead letters", file=sys.stderr)
    return 0


def _say_left_out(count: int) -> None:
    if count:
        print(
            f"left out {count} dead letters without a message id (--include-no-id moves them; "
            "each would be applied under an id the broker invented)",
            file=sys.stderr,
        )


def _letter_json(letter: DeadLetterInfo) -> dict[str, Any]:
    at = letter.dead_lettered_at
    return {
        "id": letter.message_id,
        "type": letter.type,
        "reason": logs.scrub(letter.reason),
        "dead_lettered_at": at.isoformat() if at else None,
        "body": letter.body.decode("utf-8", "replace"),
    }


def reason_group(reason: str) -> str:
    """What ``--group-by reason`` groups on: the reason's first line, at most 100 characters."""
    first = " ".join((reason.strip().splitlines() or [""])[0].split())
    return (first[:99] + "…" if len(first) > 100 else first) or "(none)"


def _print_letters(letters: list[DeadLetterInfo], *, as_json: bool) -> None:
    if as_json:
        for letter in letters:
            print(json.dumps(_letter_json(letter)))
        return
    if not letters:
        return  # the caller says so in words
    rows = [
        (
            _when(letter.dead_lettered_at),
            letter.message_id or "(no id)",
            letter.type or "-",
            reason_group(logs.scrub(letter.reason)),
        )
        for letter in letters
    ]
    _print_table(("DEAD-LETTERED", "ID", "TYPE", "REASON"), rows)


def _print_groups(letters: list[DeadLetterInfo], by: str, *, as_json: bool) -> None:
    groups: dict[str, list[DeadLetterInfo]] = {}
    for letter in letters:
        key = reason_group(logs.scrub(letter.reason)) if by == "reason" else letter.type or "-"
        groups.setdefault(key, []).append(letter)
    other = "type" if by == "reason" else "reason"
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    if as_json:
        for key, members in ordered:
            counts = Counter(_other(letter, other) for letter in members)
            times = [m.dead_lettered_at for m in members if m.dead_lettered_at]
            print(
                json.dumps(
                    {
                        by: key,
                        "count": len(members),
                        f"{other}s": dict(counts.most_common()),
                        "oldest": min(times).isoformat() if times else None,
                        "newest": max(times).isoformat() if times else None,
                    }
                )
            )
        return
    rows = []
    for key, members in ordered:
        counts = Counter(_other(letter, other) for letter in members)
        spread = ", ".join(f"{name} ({n})" for name, n in counts.most_common(3))
        if len(counts) > 3:
            spread += f", +{len(counts) - 3} more"
        times = [m.dead_lettered_at for m in members if m.dead_lettered_at]
        rows.append((str(len(members)), key, spread, _when(min(times) if times else None)))
    _print_table(("COUNT", by.upper(), f"{other.upper()}S", "OLDEST"), rows)
    print(f"{len(letters)} dead letters in {len(groups)} groups", file=sys.stderr)


def _other(letter: DeadLetterInfo, what: str) -> str:
    if what == "type":
        return letter.type or "-"
    return reason_group(logs.scrub(letter.reason))


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if moment else "-"


def _print_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    """Plain columns; the last one is cut to the terminal's width."""
    widths = [max([len(header[i]), *(len(row[i]) for row in rows)]) for i in range(len(header))]
    width = shutil.get_terminal_size((120, 24)).columns
    lead = sum(widths[:-1]) + 2 * (len(widths) - 1)
    room = max(20, width - lead)
    for row in (header, *rows):
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        last = row[-1] if len(row[-1]) <= room else row[-1][: room - 1] + "…"
        print("  ".join([*cells, last]).rstrip())


# -- worker sweep ----------------------------------------------------------------


async def sweep_command(
    settings: Settings, *, redrive_claims: bool, limit: int, abandoned: bool = False
) -> int:
    """``worker sweep``: print stale claims as JSON lines; with --redrive, finish them.

    ``abandoned``: print the abandoned claims instead (and re-drive nothing).
    """
    from worker.context import session_factory
    from worker.db import create_engine
    from worker.registry import import_handlers, registry
    from worker.sweeper import abandoned_claims, redrive, stale_claims

    import_handlers(settings.handler_modules)
    engine = create_engine(settings.database_url, pool_size=2)
    log = logs.get_logger(command="sweep")
    try:
        sessions = session_factory(engine)
        if abandoned:
            for claim in await abandoned_claims(sessions, limit):
                print(json.dumps(claim))
            return 0
        for stale in await stale_claims(sessions, limit):
            print(json.dumps(stale.as_dict()))
        if redrive_claims:
            results = await redrive(sessions, registry, settings, log, limit=limit)
            log.info("sweep done", **dict(results))
    finally:
        await engine.dispose()
    return 0


# -- one line for every failure ----------------------------------------------------

_DATABASE_COMMANDS = frozenset(
    {"run", "migrate", "revision", "sweep", "purge-inbox", "outbox", "relay"}
)
_ASYNCPG_PREFIX = re.compile(r"^<class '[\w.]+'>: ")


@dataclass(frozen=True)
class Failure:
    """What a command prints for a database that cannot serve it, and its exit code."""

    line: str
    code: int


def database_failure(exc: BaseException, command: str) -> Failure | None:
    """One line for a database that cannot serve the command, or None for any other error.

    Names the (redacted) database and what went wrong: not reachable or no schema
    (``worker migrate`` never ran): exit 1, as a broker that cannot be reached; a refused
    login or no such database: exit 2, configuration no retry fixes, as a broker's refused
    login or unknown virtual host.
    """
    from sqlalchemy.exc import DBAPIError

    from worker.db import Failure as Meaning
    from worker.db import classify, sqlstate

    code: str | None
    if isinstance(exc, DBAPIError):
        code, text = sqlstate(exc), str(exc.orig)
    elif isinstance(getattr(exc, "sqlstate", None), str):  # asyncpg's own, raised unwrapped
        code, text = getattr(exc, "sqlstate", None), str(exc)
    elif command in _DATABASE_COMMANDS and isinstance(exc, OSError | TimeoutError):
        code, text = None, f"{type(exc).__name__}: {exc}".rstrip(": ")
    else:
        return None
    text = logs.scrub(_ASYNCPG_PREFIX.sub("", (text.strip().splitlines() or ["?"])[0]))
    where = _database_named()
    if code == "42P01" or "no such table" in text:
        return Failure(f"worker: database not migrated: {where}: {text} (run: worker migrate)", 1)
    if code is not None and code.startswith("28"):
        return Failure(_configuration(f"WORKER_DATABASE_URL={where}: login refused ({text})"), 2)
    if code == "3D000":
        return Failure(_configuration(f"WORKER_DATABASE_URL={where}: no such database ({text})"), 2)
    if classify(exc) is Meaning.CONNECTION or code is None:
        return Failure(f"worker: database unavailable: {where}: {text}", 1)
    return Failure(f"worker: database error: {where}: {text}", 1)


def _configuration(problem: str) -> str:
    return f"worker: configuration error: {problem}"


def _database_named() -> str:
    """WORKER_DATABASE_URL as a line may show it (its password masked)."""
    from worker.db import redact

    return redact(os.environ.get("WORKER_DATABASE_URL") or _default_database_url())


def _default_database_url() -> str:
    default = Settings.model_fields["database_url"].default
    return default if isinstance(default, str) else ""


def _quiet_libraries(settings: Settings) -> None:
    """One-shot commands say what failed in one line: the libraries' own error lines
    (aiormq, aiokafka retrying a connection) would only repeat it, so they stay quiet
    unless WORKER_LOG_LEVEL=DEBUG."""
    if settings.log_level != "DEBUG":
        logging.getLogger().setLevel(logging.CRITICAL)


_NETWORK_BROKERS = ("rabbitmq", "kafka", "servicebus")


def refuse_transaction_pooling(settings: Settings, why: str) -> None:
    """A session advisory lock behind a transaction-pooling proxy is released on whichever
    server connection the unlock reaches: the lock stays held, and the next taker waits
    or skips for good. Such work needs a direct (or session-pooled) URL."""
    from sqlalchemy.engine import make_url

    from worker.db import POOLER

    if make_url(settings.database_url).query.get(POOLER) == "transaction":
        raise ConfigurationError(
            f"WORKER_DATABASE_URL has {POOLER}=transaction, but {why} across transactions: "
            "give it a direct or session-pooled URL (docs/operations.md, PgBouncer)"
        )


def refuse_pod_local_database(settings: Settings) -> None:
    """An SQLite file with a networked broker: every replica would keep its own inbox.

    Replicas on several hosts (pods: each has its own /tmp) would then each record
    their own effects in a file that dies with them, and no two would deduplicate.
    """
    if (
        settings.broker not in _NETWORK_BROKERS
        or not settings.database_url.startswith("sqlite")
        or settings.allow_sqlite_with_network_broker
    ):
        return
    source = "set" if "WORKER_DATABASE_URL" in os.environ else "not set: the default"
    raise ConfigurationError(
        f"WORKER_DATABASE_URL is an SQLite file ({source}) but WORKER_BROKER={settings.broker}: "
        "each replica would keep its own inbox. Use a postgresql+asyncpg:// URL, or set "
        "WORKER_ALLOW_SQLITE_WITH_NETWORK_BROKER=true when every replica shares this one file"
    )


class _Signals:
    """SIGTERM/SIGINT honoured from the first moment of ``worker run``.

    Until the pump has started, a signal cancels the start-up: a pod stopped while
    it imports, connects or waits for a silent database must not sit out its grace
    period (as PID 1 an unhandled SIGTERM is not even delivered). Once the pump
    runs, a signal asks it for its graceful stop.
    """

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._pump: Any = None
        self.cancelled = False
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._received)

    def hand_over(self, pump: Any) -> None:
        self._pump = pump
        if self.cancelled:  # a signal came first, and its cancel was swallowed on the way here
            pump.stop()

    def _received(self) -> None:
        pump = self._pump
        if pump is not None:
            # Asked before the cancel below: a library that swallows the CancelledError
            # (seen inside a broker's connect) must not lose the signal; the pump then
            # stops at once, gracefully, as soon as its start returns.
            pump.stop()
            if pump.started.is_set():
                return
        if not self.cancelled:
            self.cancelled = True
            self._task.cancel()


async def _serve(settings: Settings) -> int:
    refuse_pod_local_database(settings)
    if settings.purge_interval > 0:
        refuse_transaction_pooling(
            settings, "the inbox purge (WORKER_PURGE_INTERVAL=0 turns it off here) holds a lock"
        )
    signals = _Signals()
    try:
        return await _run(settings, signals)
    except asyncio.CancelledError:
        if not signals.cancelled:
            raise
        logs.get_logger().info("stopped during start-up")
        return 0


def assemble(settings: Settings, broker: Broker, engine: AsyncEngine, handlers: Registry) -> Pump:
    """The pump with its optional features wired in as middleware: handler timing, tracing
    (WORKER_TRACING), and the Prometheus export of its tallies. The pump knows none of them."""
    from worker import metrics
    from worker.middleware import StageMiddleware, Timing, WorkMiddleware
    from worker.pump import Pump

    around_work: list[WorkMiddleware] = []
    around_stage: list[StageMiddleware] = [Timing()]
    if settings.tracing:
        from worker.tracing import Tracing

        tracing = Tracing(broker, engine)
        around_work.append(tracing)
        around_stage.append(tracing.stages)
    pump = Pump(
        broker,
        engine,
        handlers,
        settings,
        name="worker",
        middleware=around_work,
        stage_middleware=around_stage,
    )
    metrics.track(pump)
    return pump


class SchemaBehind(Exception):
    """The database's schema is behind this code (:meth:`Status.behind` says where)."""

    def __init__(self, status: Status) -> None:
        super().__init__(status.behind())
        self.status = status

    @property
    def remedy(self) -> str:
        """The command that brings the database up to this code."""
        from worker.migrate import State

        found = self.status
        if (
            found.missing
            and not found.layout
            and all(s.state is not State.BEHIND for s in found.standings)
        ):
            return (
                "no revision creates them: worker revision -m '...' --autogenerate, then "
                "worker migrate (or your own Alembic's upgrade)"
            )
        return "run: worker migrate"


async def refuse_schema_behind(settings: Settings, engine: AsyncEngine) -> None:
    """Refuse to start on a schema behind this code, as ``worker migrate --check`` would.

    Started anyway, the pump took every delivery and gave it back as schema-behind, and
    the outbox relay logged its failing SQL once a second, while nothing said to run
    ``worker migrate``. Refused rather than waited for: in a deployment the migration gate
    (``worker migrate --wait`` in the init container) is what waits, so a ``worker run``
    that meets a schema behind has no gate before it, and only a person can fix that.
    """
    from worker.histories import application_histories, model_tables
    from worker.migrate import schema_status

    found = await schema_status(
        engine,
        application_histories(settings.handler_modules),
        tables=sorted(model_tables()),
        inbox_layout=settings.inbox_layout,
    )
    if not found.usable:
        raise SchemaBehind(found)


async def _run(settings: Settings, signals: _Signals | None = None) -> int:
    from worker import retention
    from worker.brokers import open_broker
    from worker.context import session_factory
    from worker.db import create_engine, ping, redact
    from worker.ops import start_ops
    from worker.outbox import relay as outbox_relay
    from worker.registry import import_handlers, registry
    from worker.startup import database_refuses, until_up

    import_handlers(settings.handler_modules)
    from sqlalchemy.engine import make_url

    from worker.concurrency import prepare_models

    # the code's own faults first, before anything connects: an unusable version token...
    prepare_models(make_url(settings.database_url).get_backend_name())
    if not any(True for _ in registry):  # ...and nothing that could ever be consumed
        named = f"={settings.handlers!r}" if settings.handlers.strip() else " is empty"
        raise ConfigurationError(
            f"WORKER_HANDLERS{named}: no handler is registered, so nothing could be consumed "
            "(name the modules that register yours: README, Your own handlers)"
        )
    shutdown_tracing = None
    if settings.tracing:  # OpenTelemetry is imported only when tracing is on
        from worker.tracing import configure as configure_tracing

        shutdown_tracing = configure_tracing(settings)
    broker = open_broker(settings)
    engine = create_engine(
        settings.database_url,
        pool_size=settings.pool_size,
        max_overflow=settings.db_max_overflow,
    )
    log = logs.get_logger()
    try:
        pump = assemble(settings, broker, engine, registry)
        ops = await start_ops(settings, pump)  # alive from here on; ready once consuming
        try:
            await until_up(
                "database",
                lambda: ping(engine),
                within=settings.start_timeout,
                log=log.bind(database=redact(settings.database_url)),
                fatal=database_refuses,
            )
            await refuse_schema_behind(settings, engine)
            relay = outbox_relay.start(settings, engine, broker)  # beside the pump
            chores = retention.start(engine, session_factory(engine), registry, settings, log)
            try:
                if signals is None:
                    await pump.run(
                        install_signal_handlers=True, start_timeout=settings.start_timeout
                    )
                else:
                    signals.hand_over(pump)
                    await pump.run(start_timeout=settings.start_timeout)
            finally:  # purge and sweep: beside the ops server, not in the pump
                if chores is not None:
                    chores.cancel()
                    await asyncio.gather(chores, return_exceptions=True)
                await outbox_relay.stop(relay)
        finally:  # probes answer (not ready) until the pump has settled its last delivery
            if ops is not None:
                await ops.stop()
    finally:
        await engine.dispose()
        if shutdown_tracing is not None:
            shutdown_tracing()  # flushes the spans still queued for export
    return 0


if __name__ == "__main__":
    sys.exit(main())
