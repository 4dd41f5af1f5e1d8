"""``worker dlq`` for triage on the Kafka stand-in (Tansu) and the Service Bus fake.

The same six dead letters on each broker: grouped by reason and by type, filtered
by type, reason, time and id, peeked without changing them, and one group moved
back by a filtered resubmit while the rest stay. RabbitMQ's run against the real
server is in tests/rabbitmq/test_rabbitmq_cli.py.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped]

from tests.kafka.kafka_helpers import create_topic, header, read_all, settings_for, unique
from tests.kafka.kafka_helpers import worker_env as kafka_env
from tests.servicebus.fake import FakeServiceBus
from tests.servicebus.sb_settings import sb_settings
from tests.support.processes import arun_cli
from tests.support.tansu import Tansu
from worker import cli
from worker.brokers import DeadLetterFilter, DeadLetterInfo, OutgoingMessage
from worker.brokers.kafka import KafkaAdmin
from worker.brokers.servicebus import ServiceBusAdmin
from worker.settings import Settings

INVALID = "invalid body for CreditRequested: 1 validation error"
UNKNOWN = "no handler for message type 'RefundRequested'"
EXHAUSTED = "failed 5 deliveries: credit: RuntimeError: ledger down"
TRIAGE = [  # id, type, reason, hours ago
    ("b1", "CreditRequested", INVALID, 1),
    ("u1", "RefundRequested", UNKNOWN, 1),
    ("b2", "CreditRequested", INVALID, 1),
    ("e1", "CreditRequested", EXHAUSTED, 1),
    ("u2", "RefundRequested", UNKNOWN, 1),
    ("b3", "CreditRequested", INVALID, 72),
]
ORDER = [row[0] for row in TRIAGE]


def ids(letters: list[DeadLetterInfo]) -> list[str | None]:
    return [letter.message_id for letter in letters]


# -- the filter and the grouping, without a broker ----------------------------------------------


def test_a_filter_matches_every_criterion_given_and_nothing_else() -> None:
    now = datetime.now(UTC)
    letter = DeadLetterInfo("m1", "CreditRequested", "Poison: Bad Amount", b"", {}, now)
    assert DeadLetterFilter()(letter)
    assert DeadLetterFilter(types=frozenset({"CreditRequested", "X"}), reason="bad amount")(letter)
    assert not DeadLetterFilter(types=frozenset({"Credit"}))(letter)  # exact, not a substring
    assert not DeadLetterFilter(reason="timeout")(letter)
    assert DeadLetterFilter(since=now - timedelta(minutes=1), ids=frozenset({"m1"}))(letter)
    assert not DeadLetterFilter(since=now + timedelta(minutes=1))(letter)
    assert not DeadLetterFilter(ids=frozenset({"m2"}))(letter)
    undated = DeadLetterInfo("m1", None, "x", b"")
    assert not DeadLetterFilter(since=now)(undated)  # an unknown time never matches --since


def test_since_takes_an_age_or_an_iso_time() -> None:
    assert abs((datetime.now(UTC) - cli._since("2h")).total_seconds() - 7200) < 5
    assert cli._since("2026-12-01T08:00:00") == datetime(2026, 12, 1, 8, tzinfo=UTC)
    with pytest.raises(Exception, match="not an ISO time or an age"):
        cli._since("yesterday")


def test_group_by_reason_uses_the_first_line_of_a_reason() -> None:
    assert cli.reason_group("poison: bad\n  details   here") == "poison: bad"
    assert len(cli.reason_group("x" * 500)) == 100
    assert cli.reason_group("") == "(none)"


# -- Kafka (the Tansu stand-in) -------------------------------------------------------------------


async def _kafka_dead_letters(tansu: Tansu) -> tuple[str, Any]:
    topic = unique("t")
    await create_topic(tansu.bootstrap, topic, 1)
    await create_topic(tansu.bootstrap, f"{topic}.DLT", 1)
    producer = AIOKafkaProducer(bootstrap_servers=tansu.bootstrap, acks="all")
    await producer.start()
    try:
        for message_id, kind, reason, hours in TRIAGE:
            headers = {
                "message-id": message_id, "type": kind, "dlt-message-id": message_id,
                "dlt-reason": reason, "dlt-original-topic": topic,
            }  # fmt: skip
            stamp = int((time.time() - hours * 3600) * 1000)
            await producer.send_and_wait(
                f"{topic}.DLT",
                b"{}",
                key=b"k",
                headers=[(k, v.encode()) for k, v in headers.items()],
                timestamp_ms=stamp,
            )
    finally:
        await producer.stop()
    return topic, settings_for(tansu.bootstrap, topic)


@pytest.mark.kafka
async def test_kafka_dlq_groups_filters_and_resubmits_one_group(
    tansu: Tansu, sqlite_template: Path, tmp_path: Path
) -> None:
    topic, kafka = await _kafka_dead_letters(tansu)
    database = tmp_path / "worker.db"
    shutil.copy(sqlite_template, database)
    env = kafka_env(kafka, f"sqlite+aiosqlite:///{database}")

    grouped = await arun_cli(env, "dlq", "--group-by", "reason")
    assert grouped.returncode == 0, grouped.stderr
    groups = [json.loads(line) for line in grouped.stdout.splitlines()]
    assert [(g["reason"], g["count"]) for g in groups] == [
        (INVALID, 3),
        (UNKNOWN, 2),
        (EXHAUSTED, 1),
    ]
    by_type = await arun_cli(env, "dlq", "--group-by", "type")
    assert [(g["type"], g["count"]) for g in map(json.loads, by_type.stdout.splitlines())] == [
        ("CreditRequested", 4),
        ("RefundRequested", 2),
    ]
    since = await arun_cli(env, "dlq", "--reason", "invalid BODY", "--since", "1d")
    assert [json.loads(line)["id"] for line in since.stdout.splitlines()] == ["b1", "b2"]

    admin = KafkaAdmin(kafka)
    try:
        assert ids(await admin.dead_letters(100)) == ORDER
        assert ids(
            await admin.dead_letters(100, DeadLetterFilter(types=frozenset({"RefundRequested"})))
        ) == ["u1", "u2"]
        assert ids(
            await admin.dead_letters(100, DeadLetterFilter(ids=frozenset({"e1", "b3"})))
        ) == ["e1", "b3"]
        assert ids(await admin.dead_letters(2)) == ORDER[:2]
        assert ids(await admin.dead_letters(100)) == ORDER  # listing committed nothing
    finally:
        await admin.close()

    dry = await arun_cli(env, "dlq", "--reason", "no handler", "--resubmit", "--dry-run")
    assert dry.returncode == 0 and "would re-submit 2 matching" in dry.stderr, dry.stderr
    moved = await arun_cli(env, "dlq", "--reason", "no handler", "--resubmit")
    assert moved.returncode == 0 and "re-submitted 2 matching" in moved.stderr, moved.stderr

    back, _ = await read_all(tansu.bootstrap, topic, 1)
    assert [header(r, "message-id") for r in back] == ["u1", "u2"]  # dry run moved nothing
    assert not any(k.startswith("dlt-") for r in back for k, _ in r.headers)
    admin = KafkaAdmin(kafka)
    try:
        left = await admin.dead_letters(100)
    finally:
        await admin.close()
    # the ones before a moved letter were appended again: still pending, now at the end
    assert ids(left) == ["b3", "b1", "b2", "e1"]
    assert [letter.reason for letter in left] == [INVALID, INVALID, INVALID, EXHAUSTED]
    old = datetime.now(UTC) - timedelta(hours=71)
    assert [
        letter.dead_lettered_at is not None and letter.dead_lettered_at < old for letter in left
    ] == [True, False, False, False]


# -- Service Bus (the fake namespace) -------------------------------------------------------------


async def _servicebus_dead_letters(bus: FakeServiceBus) -> ServiceBusAdmin:
    bus.create_queue("work", lock_duration=30.0)
    admin = ServiceBusAdmin(sb_settings(), bus.client)
    await admin.publish([OutgoingMessage(m, kind, b"{}") for m, kind, _, _ in TRIAGE])
    receiver = bus.client().get_queue_receiver("work")
    async with receiver:
        taken = await receiver.receive_messages(len(TRIAGE), max_wait_time=1)
        assert [m.message_id for m in taken] == ORDER
        for message, (_, _, reason, _) in zip(taken, TRIAGE, strict=True):
            head, _, detail = reason.partition(": ")
            await receiver.dead_letter_message(message, reason=head, error_description=detail)
    return admin


def _in_process(bus: FakeServiceBus, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    monkeypatch.setattr(
        cli, "open_admin", lambda _settings: ServiceBusAdmin(sb_settings(), bus.client)
    )

    async def dlq(capsys: pytest.CaptureFixture[str], **options: Any) -> tuple[list[Any], str]:
        code = await cli._dlq(Settings(broker="servicebus"), options.pop("limit", 100), **options)
        assert code == 0
        out, err = capsys.readouterr()
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")], err

    return dlq


async def test_servicebus_dlq_groups_filters_and_resubmits_one_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bus = FakeServiceBus()
    admin = await _servicebus_dead_letters(bus)
    dead = bus.entity("work/$DeadLetterQueue")
    dlq = _in_process(bus, monkeypatch)
    deliveries = [stored.deliveries for stored in dead.messages()]

    groups, _ = await dlq(capsys, resubmit=False, group_by="reason")
    assert [(g["reason"], g["count"]) for g in groups] == [
        (INVALID, 3),
        (UNKNOWN, 2),
        (EXHAUSTED, 1),
    ]
    assert groups[1]["types"] == {"RefundRequested": 2}
    by_type, _ = await dlq(capsys, resubmit=False, group_by="type")
    assert [(g["type"], g["count"]) for g in by_type] == [
        ("CreditRequested", 4),
        ("RefundRequested", 2),
    ]
    listed, _ = await dlq(capsys, resubmit=False, match=DeadLetterFilter(reason="LEDGER"))
    assert [item["id"] for item in listed] == ["e1"]
    listed, _ = await dlq(
        capsys, resubmit=False, match=DeadLetterFilter(ids=frozenset({"u2", "b1"}))
    )
    assert [item["id"] for item in listed] == ["b1", "u2"]
    # Service Bus keeps no dead-letter time: --since compares when the message was enqueued
    recent = DeadLetterFilter(since=datetime.now(UTC) - timedelta(minutes=5))
    assert ids(await admin.dead_letters(100, recent)) == ORDER
    assert (
        ids(
            await admin.dead_letters(
                100, DeadLetterFilter(since=datetime.now(UTC) + timedelta(minutes=5))
            )
        )
        == []
    )

    # peeking changed nothing: same order, no delivery spent, nothing locked
    assert [s.message_id for s in dead.messages()] == ORDER
    assert [stored.deliveries for stored in dead.messages()] == deliveries
    assert dead.locked == 0

    listed, err = await dlq(
        capsys, resubmit=True, dry_run=True, match=DeadLetterFilter(reason="no handler")
    )
    assert [item["id"] for item in listed] == ["u1", "u2"] and "would re-submit 2" in err
    assert dead.count == 6 and bus.entity("work").count == 0

    _, err = await dlq(capsys, resubmit=True, match=DeadLetterFilter(reason="no handler"))
    assert "re-submitted 2 matching dead letters" in err
    work = bus.entity("work")
    assert [s.message_id for s in work.messages()] == ["u1", "u2"]
    assert [s.message_id for s in dead.messages()] == ["b1", "b2", "e1", "b3"]  # in their order
    assert dead.locked == 0
    await admin.close()
