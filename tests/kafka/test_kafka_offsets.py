"""The adapter against Tansu, in process: contiguous commits, ordering, rebalance safety."""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition  # type: ignore[import-untyped]
from aiokafka.errors import KafkaConnectionError  # type: ignore[import-untyped]

from tests.kafka.kafka_helpers import (
    MakeTopic,
    committed,
    committed_is,
    consuming,
    header,
    produce,
    receive,
    topic_records,
    transport_settings,
    worker_env,
)
from tests.support.processes import arun_cli
from tests.support.waiting import wait_for
from worker.brokers.kafka import KafkaConsumer, KafkaSettings
from worker.delivery import ack_many
from worker.errors import BrokerUnavailable, ConfigurationError, SettlementLost

pytestmark = pytest.mark.kafka


async def nothing_within(broker: KafkaConsumer, seconds: float) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(seconds):
            delivery = await broker.receive()
            pytest.fail(f"unexpected delivery {delivery!r}")


def spy_commits(broker: KafkaConsumer, log: list[tuple[float, dict[int, int]]]) -> None:
    """Record every offset commit the adapter sends (partition -> offset)."""
    consumer = broker._consumer
    real = consumer.commit

    async def commit(offsets: dict[Any, int]) -> None:
        log.append((time.monotonic(), {tp.partition: o for tp, o in offsets.items()}))
        await real(offsets)

    consumer.commit = commit


async def test_commit_stops_below_a_nacked_record_until_it_is_settled(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(1)
    await produce(bootstrap, topic, [(None, b"{}", {"message-id": f"m{n}"}, 0) for n in range(10)])
    kafka = kafka_settings(topic, commit_interval=0.05, redelivery_delay=0.5)
    commits: list[tuple[float, dict[int, int]]] = []
    acked: list[tuple[str | None, int]] = []
    acked_3_at = 0.0

    async with consuming(kafka) as broker:
        spy_commits(broker, commits)

        async def consume() -> None:  # four of these, like the pump's workers
            nonlocal acked_3_at
            while len(acked) < 10:
                delivery = await broker.receive()
                if delivery.message_id == "m3" and delivery.delivery_count == 1:
                    await delivery.nack()
                    continue
                if delivery.message_id == "m3":
                    acked_3_at = time.monotonic()
                acked.append((delivery.message_id, delivery.delivery_count))
                await delivery.ack()

        workers = [asyncio.create_task(consume()) for _ in range(4)]
        try:
            await wait_for(lambda: len(acked) == 10, 30, "ten acks")
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        await wait_for(lambda: commits and commits[-1][1] == {0: 10}, 5, "the commit of 10")

    # in order, nothing skipped, 3 delivered twice (4..9 waited for it)
    assert acked == [(f"m{n}", 2 if n == 3 else 1) for n in range(10)]
    before = [offsets[0] for at, offsets in commits if at < acked_3_at]
    assert before and max(before) == 3, commits  # the prefix 0..2 was committed, never past 3
    assert await committed(bootstrap, kafka.group_id, topic, 1) == {0: 10}


async def test_partitions_run_in_parallel_and_each_in_order(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(2)
    await produce(bootstrap, topic, [(None, b"{}", {"message-id": f"p{p}-0"}, p) for p in (0, 1)])

    async with consuming(kafka_settings(topic)) as broker:
        first = await receive(broker)
        held_partition = first.message_id.split("-")[0]  # type: ignore[union-attr]
        other = "p1" if held_partition == "p0" else "p0"
        # more records arrive (in new fetches) while the first one is in flight
        more = [(None, b"{}", {"message-id": f"p{p}-{n}"}, p) for p in (0, 1) for n in range(1, 5)]
        await produce(bootstrap, topic, more)
        # the other partition drains while the first record of this one stays unsettled
        drained = []
        for _ in range(5):
            delivery = await receive(broker)
            drained.append(delivery.message_id)
            await delivery.ack()
        assert drained == [f"{other}-{n}" for n in range(5)]
        await nothing_within(broker, 0.5)  # held_partition-1 waits for held_partition-0
        await first.ack()
        rest = []
        for _ in range(4):
            delivery = await receive(broker)
            rest.append(delivery.message_id)
            await delivery.ack()
        assert rest == [f"{held_partition}-{n}" for n in range(1, 5)]


async def test_revoke_commits_what_settled_in_time_and_loses_the_rest(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(2)
    records = [(None, b"{}", {"message-id": f"p{p}-{n}"}, p) for p in (0, 1) for n in range(3)]
    await produce(bootstrap, topic, records)
    kafka = kafka_settings(topic, rebalance_grace=1.5, commit_interval=60)

    async with consuming(kafka) as first:
        await wait_for(lambda: len(first.assignment) == 2, 15, "the first member's assignment")
        one, two = await receive(first), await receive(first)
        slow, late = sorted([one, two], key=lambda d: d.message_id or "")  # p0-0, p1-0

        second = KafkaConsumer(transport_settings(), kafka)
        joining = asyncio.create_task(second.start(prefetch=4))  # returns once it has joined
        try:
            # the join revokes both partitions from `first`, which stops handing out
            # their records and waits: p0-0 settles within the grace period, p1-0 not
            await wait_for(lambda: not first.assignment, 15, "the revocation")
            await asyncio.sleep(0.3)
            await slow.ack()
            await asyncio.wait_for(joining, 20)
            await wait_for(lambda: first.assignment and second.assignment, 10, "the rebalance")
            with pytest.raises(SettlementLost):
                await late.ack()
            assert await committed(bootstrap, kafka.group_id, topic, 2) == {0: 1, 1: -1}

            # p1-0 comes again, to whichever member owns p1 now; p0 goes on at p0-1
            seen: dict[str, int] = {}

            async def drain(broker: KafkaConsumer) -> None:
                while True:
                    delivery = await broker.receive()
                    seen[delivery.message_id or ""] = seen.get(delivery.message_id or "", 0) + 1
                    await delivery.ack()

            tasks = [asyncio.create_task(drain(b)) for b in (first, second)]
            try:
                await wait_for(lambda: len(seen) == 5, 15, "the remaining records")
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            assert seen == {"p0-1": 1, "p0-2": 1, "p1-0": 1, "p1-1": 1, "p1-2": 1}
        finally:
            joining.cancel()
            await asyncio.gather(joining, return_exceptions=True)
            await second.stop_receiving()
            await second.close()


async def test_a_failed_dead_letter_send_settles_nothing(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    topic = await new_topic(1)
    await produce(bootstrap, topic, [(None, b"{}", {"message-id": f"m{n}"}, 0) for n in range(2)])
    kafka = kafka_settings(topic, commit_interval=0.05)
    async with consuming(kafka) as broker:
        producer = broker.dead_letters.producer
        real_send = producer.send_and_wait

        async def broken(*args: Any, **kwargs: Any) -> None:
            raise KafkaConnectionError("the dead-letter topic's leader is gone")

        producer.send_and_wait = broken
        first = await receive(broker)
        with pytest.raises(SettlementLost, match="refused the record"):
            await first.dead_letter("poison")
        producer.send_and_wait = real_send
        again = await receive(broker)  # the same record, not the next one
        assert (again.message_id, again.delivery_count) == ("m0", 2)
        assert await committed(bootstrap, kafka.group_id, topic, 1) == {0: -1}
        await again.dead_letter("poison")
        after = await receive(broker)
        assert after.message_id == "m1"
        await wait_for(
            lambda: committed_is(bootstrap, kafka.group_id, topic, 1), 5, "commit of 1", step=0.1
        )


async def test_ack_many_settles_each_record_and_returns_only_the_lost_ones(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    """A batch's ack: each record settles on its own, the commit follows the prefix, and a
    record whose partition is gone (here: the consumer closed before the batch ended) is
    handed back as lost, not taken as acked."""
    topic = await new_topic(1)
    await produce(bootstrap, topic, [(None, b"{}", {"message-id": f"m{n}"}, 0) for n in range(3)])
    kafka = kafka_settings(topic, commit_interval=0.05)
    broker = KafkaConsumer(transport_settings(batch_size=3), kafka)
    await broker.start(prefetch=3)
    try:
        batch = [await receive(broker) for _ in range(3)]  # the whole batch out at once
        assert await ack_many(batch[:2]) == []
        await wait_for(lambda: committed_is(bootstrap, kafka.group_id, topic, 2), 10, "commit 2")
    finally:
        await broker.stop_receiving()
        await broker.close()
    assert await ack_many(batch[2:]) == [batch[2]]
    assert await committed(bootstrap, kafka.group_id, topic, 1) == {0: 2}


async def test_an_unreachable_broker_is_broker_unavailable(
    kafka_settings: Callable[..., KafkaSettings],
) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    kafka = kafka_settings("t", bootstrap_servers=f"127.0.0.1:{port}")
    broker = KafkaConsumer(transport_settings(), kafka)
    with pytest.raises(BrokerUnavailable) as caught:  # the start-up retry tries again
        await broker.start(prefetch=1)
    where, _, reason = str(caught.value).partition(f"127.0.0.1:{port}: ")
    assert where == "kafka at " and reason.strip(), str(caught.value)
    assert not broker.ready
    await broker.close()


@pytest.mark.parametrize("ordering", ["partition", "key"])
async def test_an_uncounted_nack_does_not_spend_a_delivery_and_counts_a_give_back(
    new_topic: MakeTopic,
    kafka_settings: Callable[..., KafkaSettings],
    bootstrap: str,
    ordering: str,
) -> None:
    """A delivery count is spent only by the message's own failure: a give-back the
    record is not to blame for keeps its delivery count, and is counted as a give-back
    (the bound for the paths that spend no count), whichever way the record comes back."""
    topic = await new_topic(1)
    await produce(bootstrap, topic, [(None, b"{}", {"message-id": "m0"}, 0)])
    async with consuming(kafka_settings(topic, ordering=ordering)) as broker:
        seen = []
        for counted in (False, False, True, False, True):
            delivery = await receive(broker)
            seen.append((delivery.delivery_count, delivery.give_backs))
            await delivery.nack(0.01, counted=counted)
        last = await receive(broker)
        seen.append((last.delivery_count, last.give_backs))
    assert seen == [(1, 0), (1, 1), (1, 2), (2, 2), (2, 3), (3, 3)]


async def test_the_buffer_is_bounded_in_bytes_not_only_in_records(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    """Issue 15 (suspected, confirmed): 500 buffered 1 MiB records would be 500 MiB."""
    topic = await new_topic(1)
    size, count = 100_000, 40
    await produce(
        bootstrap, topic, [(None, bytes(size), {"message-id": f"m{n}"}, 0) for n in range(count)]
    )
    room, fetch = 300_000, 200_000
    # Test-broker quirk: Tansu ignores the per-partition fetch size, not the request's.
    kafka = kafka_settings(
        topic, max_buffered_bytes=room, max_partition_fetch_bytes=fetch, fetch_max_bytes=fetch
    )
    async with consuming(kafka) as broker:
        first = await receive(broker)  # held: everything behind it stays buffered
        await asyncio.sleep(2.0)  # plenty of fetch rounds
        (partition,) = broker._partitions.values()
        held = partition.bytes
        ids, peak = [first.message_id], held
        await first.ack()
        for _ in range(count - 1):
            delivery = await receive(broker)
            peak = max(peak, partition.bytes)
            ids.append(delivery.message_id)
            await delivery.ack()
    # at most the bound plus one fetch response (a record is never split)
    assert 0 < held <= room + fetch + size, held
    assert peak <= room + fetch + size, peak
    assert ids == [f"m{n}" for n in range(count)]  # pausing lost and reordered nothing


async def test_a_broker_refusing_the_idempotent_producer_names_the_setting(
    kafka_settings: Callable[..., KafkaSettings],
    sqlite_template: Path,
    tmp_path: Path,
) -> None:
    """Issue 14 item 5. Test-broker quirk put to use: Tansu refuses InitProducerId."""
    kafka = kafka_settings("t", idempotent_producer=True)
    broker = KafkaConsumer(transport_settings(), kafka)
    with pytest.raises(ConfigurationError, match="WORKER_KAFKA_IDEMPOTENT_PRODUCER=false"):
        await broker.start(prefetch=1)
    assert not broker.ready
    await broker.close()

    database = tmp_path / "worker.db"
    shutil.copy(sqlite_template, database)
    env = worker_env(
        kafka,
        f"sqlite+aiosqlite:///{database}",
        WORKER_KAFKA_IDEMPOTENT_PRODUCER="true",
        WORKER_ALLOW_SQLITE_WITH_NETWORK_BROKER="true",
    )
    result = await arun_cli(env, "run")
    assert result.returncode == 2, result.stderr
    assert "refused the idempotent producer" in result.stderr
    assert "WORKER_KAFKA_IDEMPOTENT_PRODUCER=false" in result.stderr


async def test_a_dead_letter_refused_even_reduced_is_rewound_not_released(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    """Every move of a message is at-least-once: no copy confirmed, no release, even
    when the refusal is for good."""
    topic = await new_topic(1)
    await produce(bootstrap, topic, [(None, b"{}", {"message-id": f"m{n}"}, 0) for n in range(2)])
    # the smallest request size: even the dlt-* headers of a long reason do not fit
    kafka = kafka_settings(topic, max_request_size=1024, commit_interval=0.05)
    async with consuming(kafka) as broker:
        first = await receive(broker)
        with pytest.raises(SettlementLost, match="refused the record"):
            await first.dead_letter("r" * 1500)
        again = await receive(broker)
        assert (again.message_id, again.delivery_count) == ("m0", 2)
        await again.dead_letter("short")  # a reduced-size reason fits: settled
        assert (await receive(broker)).message_id == "m1"
        await wait_for(
            lambda: committed_is(bootstrap, kafka.group_id, topic, 1), 5, "commit of 1", step=0.1
        )


async def test_a_keyless_tombstone_can_be_dead_lettered(
    new_topic: MakeTopic, kafka_settings: Callable[..., KafkaSettings], bootstrap: str
) -> None:
    """No key and no value: aiokafka refuses to send that as is; the letter carries b""."""
    topic = await new_topic(1)
    # Other clients write these; aiokafka's send() refuses, its accumulator does not.
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        sent = await producer._message_accumulator.add_message(
            TopicPartition(topic, 0), None, None, 10.0, headers=[("message-id", b"t0")]
        )
        await sent
    finally:
        await producer.stop()
    async with consuming(kafka_settings(topic, commit_interval=0.05)) as broker:
        delivery = await receive(broker)
        assert delivery.body == b""
        await delivery.dead_letter("invalid body")
        await wait_for(lambda: committed_is(bootstrap, broker.kafka.group_id, topic, 1), 5, "1")
    letters = await topic_records(bootstrap, f"{topic}.DLT")
    assert [(r.key, r.value, header(r, "dlt-message-id")) for r in letters] == [(None, b"", "t0")]
