"""The idempotent producer (``WORKER_KAFKA_IDEMPOTENT_PRODUCER``, on by default), on
librdkafka's mock cluster: Tansu refuses InitProducerId, the mock answers it.

Each test counts the InitProducerId requests the mock received while the worker's
code ran: a producer that quietly was not idempotent sends none, and fails the test.
What these tests cannot show: the mock checks sequence numbers only for a
transactional producer, so it neither refuses a gap nor drops a duplicate batch of
the worker's (non-transactional) idempotent producer. That and the rest it does not
implement: docs/kafka.md, "Testing against librdkafka's mock cluster".
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.kafka.kafka_helpers import (
    committed_is,
    credit,
    header,
    produce,
    read_all,
    settings_for,
    unique,
    worker_env,
)
from tests.outbox.outbox_helpers import fast_outbox, outbox_rows, publish_rows
from tests.support.credits import credit_registry
from tests.support.database import balances
from tests.support.kafka_mock import INIT_PRODUCER_ID, MockCluster, running_mock_cluster
from tests.support.processes import arun_cli
from tests.support.pumps import MakeSettings, engine_for, running_pump
from tests.support.services import unavailable
from tests.support.tansu import Tansu
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer, KafkaPublisher
from worker.brokers.publishers import Outgoing
from worker.errors import ConfigurationError
from worker.outbox.model import configure
from worker.outbox.relay import Relay


@pytest.fixture(scope="module")
def mock() -> Iterator[MockCluster]:
    """One mock cluster (one broker) for the module, in its own process, stopped by PID."""
    if importlib.util.find_spec("confluent_kafka") is None:
        unavailable("confluent-kafka is not installed: pip install -e '.[test]'")
    with running_mock_cluster(brokers=1) as cluster:
        yield cluster


def init_producer_ids(mock: MockCluster) -> int:
    return mock.request_counts().get(INIT_PRODUCER_ID, 0)


async def test_the_dead_letter_producer_is_idempotent_and_delivers_the_reason(
    mock: MockCluster,
    sqlite_template: Path,
    tmp_path: Path,
    make_settings: MakeSettings,
) -> None:
    """A poison record, consumed by the worker's Kafka adapter in a consumer group, ends
    on ``<topic>.DLT`` with its reason, sent by the idempotent producer; the partition
    moves on past it."""
    topic = unique("t")
    dlt = f"{topic}.DLT"
    mock.create_topic(topic, 1)
    mock.create_topic(dlt, 1)
    first, after = credit("m0", "acct-1", "1.50"), credit("m2", "acct-1", "2")
    records = [
        (b"k", first[0], first[1], 0),
        (b"k", b"not json", {"message-id": "m1", "type": "CreditRequested"}, 0),
        (b"k", after[0], after[1], 0),
    ]
    await produce(mock.bootstrap, topic, records)  # a plain producer: no InitProducerId

    database = tmp_path / "worker.db"
    shutil.copy(sqlite_template, database)
    url = f"sqlite+aiosqlite:///{database}"
    kafka = settings_for(mock.bootstrap, topic, idempotent_producer=True)
    settings = make_settings(database_url=url)
    before = init_producer_ids(mock)
    async with (
        engine_for(url) as engine,
        running_pump(KafkaConsumer(settings, kafka), engine, credit_registry(), settings) as pump,
    ):
        await wait_for(
            lambda: committed_is(mock.bootstrap, kafka.group_id, topic, 3), 20, "offset 3", 0.1
        )
    assert init_producer_ids(mock) - before == 1  # the dead-letter producer, idempotent
    assert (pump.stats["committed"], pump.stats["dead-letter"]) == (2, 1)
    assert await balances(url) == {"acct-1": Decimal("3.50")}

    letters, _ = await read_all(mock.bootstrap, dlt, 1)
    assert len(letters) == 1  # sent once
    (letter,) = letters
    assert letter.value == b"not json" and letter.key == b"k"
    assert header(letter, "dlt-message-id") == "m1"
    assert (header(letter, "dlt-original-topic"), header(letter, "dlt-original-offset")) == (
        topic,
        "1",
    )
    assert "invalid body for CreditRequested" in (header(letter, "dlt-reason") or "")


async def test_the_outbox_publisher_is_idempotent_and_publishes_each_row_once(
    mock: MockCluster, engine: AsyncEngine
) -> None:
    topic = unique("events")
    mock.create_topic(topic, 3)
    events = [("Seen", {"n": n}, f"key-{n % 4}", topic) for n in range(30)]
    configure(fast_outbox())
    try:
        ids = await publish_rows(engine, "in-1", events)
    finally:
        configure(None)
    kafka = settings_for(mock.bootstrap, topic, idempotent_producer=True)
    publisher = KafkaPublisher(kafka, timeout=10.0)
    relay = Relay(engine, publisher, fast_outbox(batch=8))
    before = init_producer_ids(mock)
    try:
        assert await relay.drain() == 30  # four batches through one producer
        assert await relay.drain() == 0
    finally:
        await publisher.close()
    assert init_producer_ids(mock) - before == 1
    assert all(row.sent_at is not None for row in await outbox_rows(engine))

    records, marks = await read_all(mock.bootstrap, topic, 3)
    assert sorted(header(r, "message-id") or "" for r in records) == sorted(ids)  # each once
    assert sum(marks.values()) == 30
    by_key: dict[bytes, list[str]] = {}
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_key.setdefault(record.key, []).append(header(record, "message-id") or "")
    for key, sent in by_key.items():  # a key's rows in the order of the outbox
        assert sent == [i for i, e in zip(ids, events, strict=True) if e[2] == key.decode()]


@pytest.mark.kafka
async def test_the_outbox_publisher_refused_the_idempotent_producer_names_the_setting(
    tansu: Tansu, sqlite_template: Path, tmp_path: Path
) -> None:
    """Issue 14 item 5 for the publishers (the consumer's producer: test_kafka_offsets.py).

    Tansu refuses InitProducerId; the outbox relay's publisher and ``worker publish``
    say which setting avoids that, not just the broker's ``UnknownError``.
    """
    topic = unique("t")
    kafka = settings_for(tansu.bootstrap, topic, idempotent_producer=True)
    publisher = KafkaPublisher(kafka, timeout=10.0)
    message = Outgoing(message_id="o1", type="Seen", body=b"{}", destination=topic)
    try:
        with pytest.raises(ConfigurationError, match="WORKER_KAFKA_IDEMPOTENT_PRODUCER=false"):
            await publisher.publish([message])
    finally:
        await publisher.close()

    database = tmp_path / "worker.db"
    shutil.copy(sqlite_template, database)
    env = worker_env(
        kafka,
        f"sqlite+aiosqlite:///{database}",
        WORKER_KAFKA_IDEMPOTENT_PRODUCER="true",
    )
    result = await arun_cli(env, "publish", stdin='{"id": "p1", "type": "Seen", "body": {}}\n')
    assert result.returncode == 2, result.stderr
    assert "refused the idempotent producer" in result.stderr
    assert "WORKER_KAFKA_IDEMPOTENT_PRODUCER=false" in result.stderr
