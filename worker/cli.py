"""The ``worker`` command: run, migrate, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from worker import logs
from worker.brokers import OutgoingMessage, open_admin
from worker.errors import BrokerUnavailable, ConfigurationError
from worker.settings import Settings, load


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="worker", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("run", help="consume from WORKER_BROKER until SIGTERM/SIGINT")
    migrate = commands.add_parser(
        "migrate", help="upgrade WORKER_DATABASE_URL to the newest schema, or wait for it"
    )
    gate = migrate.add_mutually_exclusive_group()
    gate.add_argument("--check", action="store_true", help="exit 0 if at head, 1 if not")
    gate.add_argument("--wait", action="store_true", help="wait until at head (exit 0)")
    migrate.add_argument("--timeout", type=float, default=600.0, help="--wait: give up after")
    migrate.add_argument(
        "--lock-timeout", type=float, default=5.0, help="seconds a DDL waits for its lock"
    )
    demo = commands.add_parser(
        "demo", help="the race and its cure, on SQLite and the memory broker"
    )
    demo.add_argument("--messages", type=int, default=400, help="credit messages to send")
    publish = commands.add_parser(
        "publish", help='send JSON lines {"id", "type", "body", "headers"?} to the work queue'
    )
    publish.add_argument("file", nargs="?", default="-", help="JSON lines file; - for stdin")
    dlq = commands.add_parser("dlq", help="list dead letters with their reasons, or re-submit them")
    dlq.add_argument("--resubmit", action="store_true", help="move them back to the work queue")
    dlq.add_argument("--limit", type=int, default=100, help="at most this many")
    sweep = commands.add_parser("sweep", help="list side-effect claims left past their lease")
    sweep.add_argument("--redrive", action="store_true", help="finish them from the stored body")
    sweep.add_argument("--limit", type=int, default=100, help="at most this many")
    sweep.add_argument("--abandoned", action="store_true", help="list abandoned claims instead")
    commands.add_parser("purge-inbox", help="delete finished markers older than the retention")
    relay = commands.add_parser("relay", help="send committed outbox rows to WORKER_BROKER")
    relay.add_argument("--once", action="store_true", help="send what is due, then exit")
    outbox = commands.add_parser("outbox", help="list pending and parked outbox rows")
    outbox.add_argument("--retry", action="store_true", help="re-queue the parked rows")
    outbox.add_argument("--limit", type=int, default=100, help="at most this many")
    args = parser.parse_args(argv)

    try:
        settings = load(Settings)
        logs.configure(settings.log_level, settings.log_format)
        if args.command == "run":
            return asyncio.run(_serve(settings))
        if args.command == "migrate":
            return _migrate(settings, args)
        if args.command == "publish":
            return asyncio.run(_publish(settings, _read_input(args.file)))
        if args.command == "dlq":
            return asyncio.run(_dlq(settings, args.limit, resubmit=args.resubmit))
        if args.command == "sweep":
            from worker.claims import sweep_command

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

            return asyncio.run(purge_command(settings))
        if args.command in ("relay", "outbox"):
            from worker import outbox as outbox_tools

            if args.command == "relay":
                return asyncio.run(outbox_tools.relay_command(settings, once=args.once))
            return asyncio.run(
                outbox_tools.outbox_command(settings, retry=args.retry, limit=args.limit)
            )
        from worker.demo import demo as run_demo

        logs.configure("ERROR", settings.log_format)  # the demo's output is its table
        return asyncio.run(run_demo(messages=args.messages))
    except ConfigurationError as exc:
        print(f"worker: configuration error: {exc}", file=sys.stderr)
        return 2
    except BrokerUnavailable as exc:
        print(f"worker: broker unavailable: {logs.scrub(str(exc))}", file=sys.stderr)
        return 1


def _migrate(settings: Settings, args: argparse.Namespace) -> int:
    from worker.migrate import migrate_command

    return migrate_command(
        settings.database_url,
        check=args.check,
        wait=args.wait,
        timeout=args.timeout,
        lock_timeout=args.lock_timeout,
    )


def read_messages(lines: Iterable[str]) -> list[OutgoingMessage]:
    """Parse ``worker publish`` input; a bad line stops everything before anything is sent."""
    messages = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            body = item["body"]
            raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            messages.append(
                OutgoingMessage(item.get("id"), item["type"], raw, item.get("headers") or {})
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigurationError(
                f"publish input line {number}: {type(exc).__name__}: {exc}"
            ) from None
    return messages


def _read_input(path: str) -> list[OutgoingMessage]:
    if path == "-":
        return read_messages(sys.stdin)
    with open(path, encoding="utf-8") as handle:
        return read_messages(handle)


async def _publish(settings: Settings, messages: list[OutgoingMessage]) -> int:
    admin = open_admin(settings)
    try:
        sent = await admin.publish(messages)
    finally:
        await admin.close()
    print(f"published {sent} messages", file=sys.stderr)
    return 0


async def _dlq(settings: Settings, limit: int, *, resubmit: bool) -> int:
    admin = open_admin(settings)
    try:
        if resubmit:
            moved = await admin.resubmit(limit)
            print(f"re-submitted {moved} dead letters", file=sys.stderr)
            return 0
        for letter in await admin.dead_letters(limit):
            print(
                json.dumps(
                    {
                        "id": letter.message_id,
                        "type": letter.type,
                        "reason": letter.reason,
                        "body": letter.body.decode("utf-8", "replace"),
                    }
                )
            )
    finally:
        await admin.close()
    return 0


_NETWORK_BROKERS = ("rabbitmq", "kafka", "servicebus")


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

    def _received(self) -> None:
        if self._pump is not None and self._pump.started.is_set():
            self._pump.stop()
        elif not self.cancelled:
            self.cancelled = True
            self._task.cancel()


async def _serve(settings: Settings) -> int:
    refuse_pod_local_database(settings)
    signals = _Signals()
    try:
        return await _run(settings, signals)
    except asyncio.CancelledError:
        if not signals.cancelled:
            raise
        logs.get_logger().info("stopped during start-up")
        return 0


async def _run(settings: Settings, signals: _Signals | None = None) -> int:
    from worker import outbox
    from worker.brokers import open_broker
    from worker.db import create_engine, ping, redact
    from worker.ops import start_ops
    from worker.pump import Pump
    from worker.registry import import_handlers, registry
    from worker.tracing import configure as configure_tracing

    import_handlers(settings.handler_modules)
    shutdown_tracing = configure_tracing(settings)
    broker = open_broker(settings)
    engine = create_engine(
        settings.database_url,
        pool_size=settings.pool_size,
        max_overflow=settings.db_max_overflow,
    )
    log = logs.get_logger()
    try:
        try:
            await ping(engine)
        except Exception as exc:
            log.error(
                "database unreachable at start", database=redact(settings.database_url), error=exc
            )
            return 1
        pump = Pump(broker, engine, registry, settings, name="worker")
        relay = outbox.start(settings, engine, broker)  # beside the pump, never in its way
        ops = await start_ops(settings, pump)
        try:
            if signals is None:
                await pump.run(install_signal_handlers=True)
            else:
                signals.hand_over(pump)
                await pump.run()
        finally:  # probes answer (not ready) until the pump has settled its last delivery
            await outbox.stop(relay)
            if ops is not None:
                await ops.stop()
    finally:
        await engine.dispose()
        if shutdown_tracing is not None:
            shutdown_tracing()  # flushes the spans still queued for export
    return 0


if __name__ == "__main__":
    sys.exit(main())
