"""``worker publish`` and ``worker dlq`` on Kafka: the operator's tools, not the consumer.

They run as a one-off command beside the replicas: publishing produces to the first topic,
and the dead-letter tools read the dead-letter topics with their own consumer group, so
listing dead letters changes nothing and re-submitting them is a copy, then a commit.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, TopicPartition  # type: ignore[import-untyped]
from aiokafka.errors import KafkaError  # type: ignore[import-untyped]

from worker.brokers import DEFAULT_SCAN, DeadLetterFilter, DeadLetterInfo, OutgoingMessage
from worker.brokers.kafka.records import (
    DLT_MESSAGE_ID,
    DLT_PREFIX,
    DLT_REASON,
    DLT_TOPIC,
    header_text,
    record_contents,
    record_headers,
)
from worker.brokers.kafka.settings import FETCH_WAIT_MS, start_producer
from worker.errors import BrokerUnavailable

if TYPE_CHECKING:
    from worker.brokers.kafka.settings import KafkaSettings


def _encode_header(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    return (value if isinstance(value, str) else json.dumps(value)).encode()


class KafkaAdmin:
    """``worker publish`` and ``worker dlq`` for Kafka.

    Dead letters count as pending from the offsets committed by the group
    ``<group_id><dead_letter_suffix>`` onward; ``resubmit`` moves them back to
    their original topic and then commits that group past them. A crash between
    the two re-submits them again, under the same message id, so the inbox
    absorbs it.
    """

    def __init__(self, kafka: KafkaSettings, timeout: float = 30.0) -> None:
        self.kafka = kafka
        self.timeout = timeout
        self._producer: Any = None

    async def _producer_started(self) -> Any:
        if self._producer is None:
            self._producer = await start_producer(self.kafka)
        return self._producer

    async def publish(self, messages: list[OutgoingMessage]) -> int:
        """Send to the first topic, keyed by message id (a retry lands on the same partition)."""
        kafka = self.kafka
        topic = kafka.topic_list[0]
        producer = await self._producer_started()
        try:
            pending = []
            for message in messages:
                headers = [(k, _encode_header(v)) for k, v in message.headers.items()]
                headers.append((kafka.type_header, message.type.encode()))
                key = None
                if message.message_id is not None:
                    key = message.message_id.encode()
                    headers.append((kafka.message_id_header, key))
                pending.append(await producer.send(topic, message.body, key=key, headers=headers))
            await asyncio.gather(*pending)
        except KafkaError as exc:
            raise BrokerUnavailable(f"publishing to {topic!r}: {exc}") from None
        return len(messages)

    async def dead_letters(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> list[DeadLetterInfo]:
        """Read the pending dead letters without committing: listing changes nothing."""
        consumer = await self._dead_letter_consumer()
        try:
            records = await self._pending(consumer, scan)
        except KafkaError as exc:
            raise BrokerUnavailable(f"reading dead letters: {exc}") from None
        finally:
            await consumer.stop()
        letters = [self._info(record) for record in records]
        return [letter for letter in letters if match is None or match(letter)][:limit]

    async def resubmit(
        self, limit: int, match: DeadLetterFilter | None = None, *, scan: int = DEFAULT_SCAN
    ) -> int:
        """Send matching dead letters back to their topic, then commit the group past them.

        The commit point of a partition can only move over a contiguous prefix: a
        dead letter that does not match but lies before a moved one is appended to
        the dead-letter topic again (same partition, key, headers and timestamp)
        before the commit, so it stays pending, now at the end of its partition.
        Every send is acknowledged before the commit; a crash in between re-sends
        under the same message id, and the inbox absorbs it.
        """
        consumer = await self._dead_letter_consumer()
        try:
            records = await self._pending(consumer, scan)
            chosen: set[tuple[str, int, int]] = set()
            for record in records:  # offset order within each partition
                if len(chosen) >= limit:
                    break
                if match is None or match(self._info(record)):
                    chosen.add((record.topic, record.partition, record.offset))
            if not chosen:
                return 0
            last: dict[Any, int] = {}
            for topic, partition, offset in chosen:
                tp = TopicPartition(topic, partition)
                last[tp] = max(last.get(tp, -1), offset)
            producer = await self._producer_started()
            sent = []
            for record in records:
                tp = TopicPartition(record.topic, record.partition)
                if record.offset > last.get(tp, -1):
                    continue  # after the last moved one: left alone
                if (record.topic, record.partition, record.offset) in chosen:
                    sent.append(await self._send_back(producer, record))
                else:
                    sent.append(
                        await producer.send(
                            record.topic,
                            record.value,
                            key=record.key,
                            headers=list(record.headers or ()),
                            partition=record.partition,
                            timestamp_ms=record.timestamp,
                        )
                    )
            await asyncio.gather(*sent)
            await consumer.commit({tp: offset + 1 for tp, offset in last.items()})
        except KafkaError as exc:
            raise BrokerUnavailable(f"re-submitting dead letters: {exc}") from None
        finally:
            await consumer.stop()
        return len(chosen)

    async def _send_back(self, producer: Any, record: Any) -> Any:
        """Produce the dead letter to its original topic without the ``dlt-*`` headers."""
        kafka = self.kafka
        headers = record_headers(record)
        suffix = kafka.dead_letter_suffix
        topic = header_text(headers.get(DLT_TOPIC)) or record.topic.removesuffix(suffix)
        out = [(k, v) for k, v in record.headers or () if not k.startswith(DLT_PREFIX)]
        if kafka.message_id_header not in headers and DLT_MESSAGE_ID in headers:
            # The id came from a fallback (CloudEvents, offset): keep it as the header,
            # or the record's new offset would make it a new message.
            out.append((kafka.message_id_header, headers[DLT_MESSAGE_ID]))
        return await producer.send(topic, record.value, key=record.key, headers=out)

    def _info(self, record: Any) -> DeadLetterInfo:
        headers = {k: v.decode("utf-8", "replace") for k, v in record_headers(record).items()}
        at = record.timestamp
        return DeadLetterInfo(
            message_id=headers.get(DLT_MESSAGE_ID),
            type=record_contents(record, headers, self.kafka.type_header, {}).type,
            reason=headers.get(DLT_REASON, ""),
            body=record.value or b"",
            headers=headers,
            dead_lettered_at=datetime.fromtimestamp(at / 1000, UTC) if at and at > 0 else None,
        )

    async def _dead_letter_consumer(self) -> Any:
        kafka = self.kafka
        consumer = AIOKafkaConsumer(
            group_id=kafka.dead_letter_topic(kafka.group_id),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **kafka.client_options(),
        )
        try:
            await consumer.start()
        except KafkaError as exc:
            await consumer.stop()
            raise BrokerUnavailable(f"kafka at {kafka.bootstrap_servers}: {exc}") from None
        return consumer

    async def _pending(self, consumer: Any, limit: int) -> list[Any]:
        """Dead letters from the group's committed offsets on, in order per partition.

        A partition is read up to the high watermark its fetch responses report,
        bounded by ``limit`` records and ``timeout`` seconds.
        """
        kafka = self.kafka
        await consumer.topics()  # loads the metadata partitions_for_topic reads
        tps = [
            TopicPartition(topic, number)
            for topic in map(kafka.dead_letter_topic, kafka.topic_list)
            for number in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        if not tps or limit <= 0:
            return []
        consumer.assign(tps)
        for tp in tps:
            committed = await consumer.committed(tp)
            if committed is None:
                await consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, committed)
        remaining, records = set(tps), list[Any]()
        deadline = time.monotonic() + self.timeout
        while remaining and len(records) < limit and time.monotonic() < deadline:
            batches = await consumer.getmany(
                *remaining, timeout_ms=FETCH_WAIT_MS, max_records=limit - len(records)
            )
            for batch in batches.values():
                records.extend(batch)
            for tp in list(remaining):
                highwater = consumer.highwater(tp)
                if highwater is not None and await consumer.position(tp) >= highwater:
                    remaining.discard(tp)
        return records

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
