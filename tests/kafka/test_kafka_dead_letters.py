"""Poison and exhausted records go to ``<topic>.DLT`` with their origin; the partition moves on."""

from __future__ import annotations

import json
import shutil
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path

import pytest

from handlers.credit import CreditRequested, apply_credit
from tests.kafka.kafka_helpers import committed_is, credit, header, produce, read_all, worker_env
from tests.support.database import balances, fetch
from tests.support.processes import arun_cli
from tests.support.pumps import MakeSettings, engine_for, running_pump
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaAdmin, KafkaConsumer, KafkaSettings
from worker.pump import Pump
from worker.registry import Context, Registry
from worker.settings import Settings

pytestmark = pytest.mark.kafka


def registry() -> Registry:
    """The real credit handler, except that account "boom" always fails."""
    reg = Registry()

    @reg.handler("CreditRequested", CreditRequested, consumer="credit")
    async def credit_or_fail(ctx: Context, message: CreditRequested) -> None:
        if message.account_id == "boom":
            raise RuntimeError("the account service is down")
        await apply_credit(ctx, message)

    return reg


async def test_poison_and_exhausted_records_reach_the_dead_letter_topic(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    bootstrap: str,
    sqlite_template: Path,
    tmp_path: Path,
    make_settings: MakeSettings,
) -> None:
    topic = await new_topic(1)
    dlt = f"{topic}.DLT"
    good, good_body = "m0", credit("m0", "acct-1", "1.50")
    bad = b"poison"  # one key: the dead letters share a partition of the DLT
    records = [
        (b"k0", good_body[0], good_body[1], 0),
        (bad, b"not json", {"message-id": "m1", "type": "CreditRequested"}, 0),
        (bad, b"{}", {"message-id": "m2", "type": "Nope"}, 0),
        (bad, credit(None, "acct-1", "1")[0], {"message-id": "", "type": "CreditRequested"}, 0),
        (bad, *credit("m4", "boom", "1"), 0),
        # a CloudEvents record, and one identified by its offset and typed by the topic
        (None, credit(None, "acct-1", "2")[0], {"ce_id": "e5", "ce_source": "/src", "ce_type":
         "CreditRequested"}, 0),
        (None, credit(None, "acct-1", "4")[0], {}, 0),
    ]  # fmt: skip
    await produce(bootstrap, topic, records)

    database = tmp_path / "worker.db"
    shutil.copy(sqlite_template, database)
    url = f"sqlite+aiosqlite:///{database}"
    kafka = kafka_settings(topic, topic_types={topic: "CreditRequested"})
    settings = make_settings(database_url=url, max_deliveries=2)
    async with (
        engine_for(url) as engine,
        running_pump(KafkaConsumer(settings, kafka), engine, registry(), settings) as pump,
    ):
        # the partition moves past every dead letter: all seven are committed
        await wait_for(
            lambda: committed_is(bootstrap, kafka.group_id, topic, 7), 30, "offset 7", step=0.3
        )
    assert pump.stats["dead-letter"] == 4
    assert await balances(url) == {"acct-1": Decimal("7.50")}
    ids = {row[0] for row in await fetch(url, "SELECT message_id FROM inbox")}
    assert ids == {good, '["/src","e5"]', f"{topic}/0/6"}

    letters, _ = await read_all(bootstrap, dlt, 4)  # Tansu auto-creates topics with 4 partitions
    letters.sort(key=lambda r: int(header(r, "dlt-original-offset") or -1))
    assert [header(r, "dlt-original-offset") for r in letters] == ["1", "2", "3", "4"]
    assert {header(r, "dlt-original-topic") for r in letters} == {topic}
    assert {header(r, "dlt-original-partition") for r in letters} == {"0"}
    assert [r.key for r in letters] == [b"poison"] * 4
    assert len({r.partition for r in letters}) == 1
    assert [header(r, "dlt-message-id") for r in letters] == ["m1", "m2", None, "m4"]
    assert [header(r, "dlt-delivery-count") for r in letters] == ["1", "1", "1", "2"]
    reasons = [header(r, "dlt-reason") or "" for r in letters]
    assert "invalid body for CreditRequested" in reasons[0]
    assert "no handler for message type 'Nope'" in reasons[1]
    assert reasons[2] == "no message id"
    assert "failed 2 deliveries" in reasons[3] and "the account service is down" in reasons[3]
    assert header(letters[1], "message-id") == "m2"  # the original headers travel along
    assert letters[0].value == b"not json"

    # `worker dlq` lists them; `worker dlq --resubmit` moves them back, ids intact
    env = worker_env(kafka, url)
    listing = await arun_cli(env, "dlq")
    assert listing.returncode == 0, listing.stderr
    listed = [json.loads(line) for line in listing.stdout.splitlines()]
    assert sorted(item["id"] or "-" for item in listed) == ["-", "m1", "m2", "m4"]
    assert all(item["reason"] for item in listed)
    moved = await arun_cli(env, "dlq", "--resubmit")  # the id-less one stays by default
    assert moved.returncode == 0 and "re-submitted 3" in moved.stderr, moved.stderr
    assert "left out 1 dead letters without a message id" in moved.stderr
    left = await KafkaAdmin(kafka).dead_letters(100)
    assert [(letter.message_id, letter.reason) for letter in left] == [(None, "no message id")]
    moved = await arun_cli(env, "dlq", "--resubmit", "--include-no-id")
    assert moved.returncode == 0 and "re-submitted 1" in moved.stderr, moved.stderr
    assert await KafkaAdmin(kafka).dead_letters(100) == []
    again, _ = await read_all(bootstrap, topic, 1)
    back = again[7:]
    assert sorted(header(r, "message-id") or "-" for r in back) == ["-", "m1", "m2", "m4"]
    assert not any(k.startswith("dlt-") for r in back for k, _ in r.headers)


async def run_until_committed(
    kafka: KafkaSettings,
    url: str,
    settings: Settings,
    bootstrap: str,
    offset: int,
    seconds: float,
) -> Pump:
    """Run a pump on ``kafka`` until the group committed ``offset`` on partition 0."""
    topic = kafka.topic_list[0]
    async with (
        engine_for(url) as engine,
        running_pump(KafkaConsumer(settings, kafka), engine, registry(), settings) as pump,
    ):
        await wait_for(
            lambda: committed_is(bootstrap, kafka.group_id, topic, offset),
            seconds,
            f"offset {offset}",
            step=0.3,
        )
    return pump


BIG = 1024 * 1024 - 250  # fits the topic (and a 1 MiB producer), not once dlt-* headers are added


@pytest.mark.parametrize("max_request_size", [None, 2 * 1024 * 1024], ids=["default", "raised"])
async def test_a_dead_letter_too_large_for_the_producer_is_sent_reduced(
    new_topic: Callable[[int], Awaitable[str]],
    kafka_settings: Callable[..., KafkaSettings],
    bootstrap: str,
    sqlite_template: Path,
    tmp_path: Path,
    make_settings: MakeSettings,
    max_request_size: int | None,
) -> None:
    """Issue 15 item 3: a deterministic refusal of the dead letter must not rewind forever."""
    topic = await new_topic(1)
    big = b"[" + b" " * (BIG - 2) + b"]"  # valid JSON, not a CreditRequested: poison
    records = [
        (b"k", big, {"message-id": "big", "type": "CreditRequested"}, 0),
        (b"k", *credit("after", "acct-1", "2.50"), 0),
    ]
    await produce(bootstrap, topic, records)
    database = tmp_path / "worker.db"
    shutil.copy(sqlite_template, database)
    url = f"sqlite+aiosqlite:///{database}"
    overrides = {} if max_request_size is None else {"max_request_size": max_request_size}
    kafka = kafka_settings(topic, **overrides)
    settings = make_settings(database_url=url, max_deliveries=2)

    pump = await run_until_committed(kafka, url, settings, bootstrap, 2, 30)

    # the record behind it ran, nothing was rewound, one dead letter
    assert await balances(url) == {"acct-1": Decimal("2.50")}
    assert pump.stats["dead-letter"] == 1 and pump.stats["settlement-lost"] == 0, pump.stats
    letters, _ = await read_all(bootstrap, f"{topic}.DLT", 4)
    assert len(letters) == 1, [r.headers for r in letters]
    letter = letters[0]
    assert header(letter, "dlt-original-topic") == topic
    assert (header(letter, "dlt-original-partition"), header(letter, "dlt-original-offset")) == (
        "0",
        "0",
    )
    assert header(letter, "dlt-message-id") == "big"
    assert "invalid body for CreditRequested" in (header(letter, "dlt-reason") or "")
    if max_request_size is None:  # reduced: the value stays in the source topic only
        assert letter.value == b""
        assert header(letter, "dlt-dropped") == "value"
        assert header(letter, "dlt-original-size") == str(BIG)
        assert header(letter, "type") == "CreditRequested"  # small headers travel along
        assert letter.key == b"k"
    else:  # WORKER_KAFKA_MAX_REQUEST_SIZE raised: the whole record fits
        assert letter.value == big
        assert header(letter, "dlt-dropped") is None
