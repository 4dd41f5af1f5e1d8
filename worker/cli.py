"""The ``worker`` command: run, migrate, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterable, Sequence

from worker import logs
from worker.brokers import OutgoingMessage, open_admin
from worker.errors import BrokerUnavailable, ConfigurationError
from worker.settings import Settings, load


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="worker", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("run", help="consume from WORKER_BROKER until SIGTERM/SIGINT")
    commands.add_parser("migrate", help="upgrade WORKER_DATABASE_URL to the newest schema")
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
            return asyncio.run(_run(settings))
        if args.command == "migrate":
            return _migrate(settings)
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


def _migrate(settings: Settings) -> int:
    from worker.db import redact
    from worker.migrate import upgrade

    upgrade(settings.database_url)
    logs.get_logger().info("migrated", database=redact(settings.database_url))
    return 0


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


async def _run(settings: Settings) -> int:
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
    engine = create_engine(settings.database_url, pool_size=settings.pool_size)
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
            await pump.run(install_signal_handlers=True)
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
