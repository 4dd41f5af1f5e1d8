"""``worker publish``, ``worker dlq`` and ``worker run`` against the real RabbitMQ."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from tests.rabbitmq.rabbit_helpers import (
    all_depths,
    credit_registry,
    declare,
    depths,
    rabbit_env,
    running,
)
from tests.support.database import fetch
from tests.support.processes import WorkerProcess, arun_cli
from tests.support.rabbitmq import MakeRabbitSettings, arabbitmqctl
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import REASON_HEADER, RabbitMQAdmin, RabbitMQSettings, make_identity

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


async def test_publish_then_dlq_list_and_resubmit(
    rabbit_settings: MakeRabbitSettings, pg: str, tmp_path: Path
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings()
    env = rabbit_env(rabbit, pg)
    lines: list[dict[str, Any]] = [
        {"id": "c1", "type": "CreditRequested", "body": {"account_id": "a", "amount": "7"}},
        {"id": "u1", "type": "RefundRequested", "body": {"account_id": "a", "amount": "7"}},
        {"id": "b1", "type": "CreditRequested", "body": "{not json"},
    ]
    source = tmp_path / "messages.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    await declare(rabbit)  # a worker's start declares; `worker publish` declares nothing
    published = await arun_cli(env, "publish", str(source))
    assert published.returncode == 0, published.stderr
    assert "published 3 messages" in published.stderr

    registry, _ = credit_registry()
    async with running(rabbit, pg, registry) as pump:
        await wait_for(lambda: pump.stats["ack"] + pump.stats["dead-letter"] == 3, 10, "3 settled")
    assert (pump.stats["ack"], pump.stats["dead-letter"]) == (1, 2)

    listed = await arun_cli(env, "dlq")
    assert listed.returncode == 0, listed.stderr
    letters = {item["id"]: item for item in map(json.loads, listed.stdout.splitlines())}
    assert set(letters) == {"u1", "b1"}
    assert "no handler for message type 'RefundRequested'" in letters["u1"]["reason"]
    assert "invalid body" in letters["b1"]["reason"]
    assert (await depths(rabbit, rabbit.dead_letter_queue))[rabbit.dead_letter_queue] == 2  # a peek

    # A message that was in fact processed, dead-lettered anyway (say, a second
    # handler failed for good): re-submitting it must not credit it twice.
    connection = await aio_pika.connect(rabbit.url)
    async with connection:
        channel = await connection.channel()
        dlx = await channel.get_exchange(rabbit.dead_letter_exchange)
        copy = aio_pika.Message(
            json.dumps(lines[0]["body"]).encode(), message_id="c1", type="CreditRequested",
            headers={REASON_HEADER: "audit: RuntimeError: mailer down"},
        )  # fmt: skip
        await dlx.publish(copy, routing_key="")

    moved = await arun_cli(env, "dlq", "--resubmit")
    assert moved.returncode == 0, moved.stderr
    assert "re-submitted 3 dead letters" in moved.stderr
    async with running(rabbit, pg, registry) as pump:
        await wait_for(lambda: pump.stats["ack"] + pump.stats["dead-letter"] == 3, 10, "3 settled")
    assert (pump.stats["duplicate"], pump.stats["dead-letter"]) == (1, 2)
    assert [tuple(r) for r in await fetch(pg, "SELECT id, balance FROM accounts")] == [
        ("a", Decimal(7))
    ]
    assert (await all_depths(rabbit))[rabbit.queue] == 0


async def test_publish_rejects_a_bad_line_before_sending_anything(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings()
    good = json.dumps({"id": "1", "type": "CreditRequested", "body": {}})
    result = await arun_cli(rabbit_env(rabbit, pg), "publish", "-", stdin=f"{good}\n{{broken\n")
    assert result.returncode == 2 and "line 2" in result.stderr


async def test_the_password_never_reaches_a_log(
    rabbit_settings: MakeRabbitSettings, pg: str, rabbitmq_vhost: str, tmp_path: Path
) -> None:
    user, secret = f"wt_{uuid.uuid4().hex[:8]}", f"pw-{uuid.uuid4().hex}"
    await arabbitmqctl("add_user", user, secret)
    try:
        await arabbitmqctl("set_permissions", "-p", rabbitmq_vhost, user, ".*", ".*", ".*")
        good: RabbitMQSettings = rabbit_settings(
            url=f"amqp://{user}:{secret}@127.0.0.1:5672/{rabbitmq_vhost}"
        )
        env = rabbit_env(good, pg, WORKER_LOG_LEVEL="DEBUG")
        worker = WorkerProcess(env, tmp_path / "run.log")
        try:
            await wait_for(lambda: worker.logged("pump started"), 30, "the worker to start")
            worker.signal(signal.SIGTERM)
            assert await asyncio.to_thread(worker.wait, 30) == 0
        finally:
            worker.kill()
        output = worker.log_path.read_text()
        assert f"{user}:***@" in output  # the URL is logged, redacted
        failures = [  # (URL, exit code, the line's words)
            (good.url.replace(secret, secret + "-wrong"), 2, "login refused"),  # at once
            (good.url.replace(":5672/", ":1/"), 1, "broker unavailable"),  # nothing listens
        ]
        for url, code, words in failures:
            failing = {**env, "WORKER_RABBITMQ_URL": url, "WORKER_START_TIMEOUT": "1"}
            result = await arun_cli(failing, "run")
            assert result.returncode == code, result.stderr
            assert words in result.stderr
            output += result.stdout + result.stderr
        assert secret not in output
    finally:
        await arabbitmqctl("delete_user", user)


async def test_bad_rabbitmq_setting_stops_the_worker_with_one_line(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    env = rabbit_env(rabbit_settings(), pg, WORKER_RABBITMQ_QUEUE_TYPE="stream")
    result = await arun_cli(env, "run")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "WORKER_RABBITMQ_QUEUE_TYPE" in result.stderr


# -- worker dlq: triage (issue 16) ----------------------------------------------------------------

_TRIAGE = [  # id, type, reason, hours ago
    ("b1", "CreditRequested", "invalid body for CreditRequested: 1 validation error", 1),
    ("u1", "RefundRequested", "no handler for message type 'RefundRequested'", 1),
    ("b2", "CreditRequested", "invalid body for CreditRequested: 1 validation error", 1),
    ("e1", "CreditRequested", "failed 5 deliveries: credit: RuntimeError: ledger down", 1),
    ("u2", "RefundRequested", "no handler for message type 'RefundRequested'", 1),
    ("b3", "CreditRequested", "invalid body for CreditRequested: 1 validation error", 72),
]


async def _dead_letter_all(rabbit: RabbitMQSettings) -> None:
    """Put the triage set into the dead-letter queue the way the worker does: through the DLX."""
    await declare(rabbit)  # what a worker declares at its start
    connection = await aio_pika.connect(rabbit.url)
    async with connection:
        channel = await connection.channel()
        dlx = await channel.get_exchange(rabbit.dead_letter_exchange)
        for message_id, kind, reason, hours in _TRIAGE:
            at = datetime.now(UTC) - timedelta(hours=hours)
            await dlx.publish(
                aio_pika.Message(
                    b"{}", message_id=message_id, type=kind,
                    headers={REASON_HEADER: reason, "x-worker-dead-lettered-at": at.isoformat()},
                ),
                routing_key="",
            )  # fmt: skip


async def _ids(env: dict[str, str], *args: str) -> list[str]:
    result = await arun_cli(env, "dlq", *args)
    assert result.returncode == 0, result.stderr
    return [item["id"] for item in map(json.loads, result.stdout.splitlines())]


async def test_dlq_groups_filters_and_resubmits_one_group(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings()
    env = rabbit_env(rabbit, pg)
    await _dead_letter_all(rabbit)
    order = [row[0] for row in _TRIAGE]

    grouped = await arun_cli(env, "dlq", "--group-by", "reason")
    assert grouped.returncode == 0, grouped.stderr
    groups = [json.loads(line) for line in grouped.stdout.splitlines()]
    assert [(g["reason"], g["count"]) for g in groups] == [
        ("invalid body for CreditRequested: 1 validation error", 3),
        ("no handler for message type 'RefundRequested'", 2),
        ("failed 5 deliveries: credit: RuntimeError: ledger down", 1),
    ]
    assert groups[0]["types"] == {"CreditRequested": 3}
    by_type = await arun_cli(env, "dlq", "--group-by", "type", "--json")
    assert [(g["type"], g["count"]) for g in map(json.loads, by_type.stdout.splitlines())] == [
        ("CreditRequested", 4),
        ("RefundRequested", 2),
    ]

    assert await _ids(env, "--type", "RefundRequested") == ["u1", "u2"]
    assert await _ids(env, "--reason", "INVALID BODY") == ["b1", "b2", "b3"]
    assert await _ids(env, "--reason", "invalid body", "--since", "1d") == ["b1", "b2"]
    assert await _ids(env, "--id", "e1", "--id", "b3") == ["e1", "b3"]
    assert await _ids(env, "--limit", "2") == order[:2]

    # Peeking changed nothing: same letters, same order, no delivery count grown.
    admin = RabbitMQAdmin(rabbit, make_identity(rabbit))
    try:
        before = await admin.dead_letters(100)
        after = await admin.dead_letters(100)
    finally:
        await admin.close()
    assert [letter.message_id for letter in after] == order
    assert [letter.headers.get("x-delivery-count") for letter in after] == [
        letter.headers.get("x-delivery-count") for letter in before
    ]
    assert (await depths(rabbit, rabbit.dead_letter_queue))[rabbit.dead_letter_queue] == 6

    dry = await arun_cli(env, "dlq", "--reason", "no handler", "--resubmit", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert [json.loads(line)["id"] for line in dry.stdout.splitlines()] == ["u1", "u2"]
    assert "would re-submit 2 matching dead letters" in dry.stderr
    assert (await all_depths(rabbit))[rabbit.queue] == 0

    moved = await arun_cli(env, "dlq", "--reason", "no handler", "--resubmit")
    assert moved.returncode == 0, moved.stderr
    assert "re-submitted 2 matching dead letters" in moved.stderr
    assert await _ids(env) == ["b1", "b2", "e1", "b3"]  # the rest, in their order
    queues = await all_depths(rabbit)
    assert (queues[rabbit.queue], queues[rabbit.dead_letter_queue]) == (2, 4)


async def test_dlq_prints_a_table_on_a_terminal(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit: RabbitMQSettings = rabbit_settings()
    await _dead_letter_all(rabbit)
    output = await asyncio.to_thread(on_a_terminal, rabbit_env(rabbit, pg), "--group-by", "reason")
    lines = output.splitlines()
    assert lines[0].split() == ["COUNT", "REASON", "TYPES", "OLDEST"]
    assert lines[1].startswith("3 ") and "invalid body for CreditRequested" in lines[1]
    assert "CreditRequested (3)" in lines[1]
    assert "6 dead letters in 3 groups" in output
    listing = await asyncio.to_thread(on_a_terminal, rabbit_env(rabbit, pg), "--type", "Refund")
    assert listing.strip() == "no matching dead letters"  # a type matches exactly


def on_a_terminal(env: dict[str, str], *args: str) -> str:
    """``worker dlq <args>`` with stdout and stderr on a pseudo-terminal; its whole output."""
    import os
    import pty
    import subprocess

    from tests.support.processes import REPO, worker_cli

    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen(
            worker_cli("dlq", *args), env={**env, "COLUMNS": "150"}, cwd=REPO,
            stdout=follower, stderr=follower, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert process.wait(60) == 0, b"".join(chunks)
        return b"".join(chunks).decode().replace("\r\n", "\n")
    finally:
        os.close(leader)
