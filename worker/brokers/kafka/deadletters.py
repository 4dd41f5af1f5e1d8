"""Producing a record to its dead-letter topic, and what to send when the whole record is refused.

The consumer settles a dead-lettered record only once :meth:`DeadLetters.send` says the
broker has the letter; any other answer rewinds the record (every move of a record is
at-least-once). A send refused for good (too large, malformed, not allowed) is tried
once more as a *reduced* letter: the ``dlt-*`` headers with the original coordinates,
the value (and, if large, the headers and key) dropped, which ``dlt-dropped`` names.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from aiokafka.errors import (  # type: ignore[import-untyped]
    ClusterAuthorizationFailedError,
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    PolicyViolationError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    UnsupportedForMessageFormatError,
)

from worker.brokers.kafka.records import (
    DLT_DELIVERY_COUNT,
    DLT_DROPPED,
    DLT_MESSAGE_ID,
    DLT_OFFSET,
    DLT_ORIGINAL_SIZE,
    DLT_PARTITION,
    DLT_PREFIX,
    DLT_REASON,
    DLT_TOPIC,
)

if TYPE_CHECKING:
    from worker.brokers.kafka.partitions import Handle
    from worker.brokers.kafka.settings import KafkaSettings

MAX_REASON = 2000  # characters of the reason (and of the message id) a letter carries
_REDUCED_KEY_MAX = 1024  # a reduced dead letter keeps the original key up to this size

# Produce errors that come back the same on every retry of the same record: the
# record (too large, malformed) or the permissions are at fault, not the network.
_UNSENDABLE: tuple[type[Exception], ...] = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    RecordListTooLargeError,
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
    UnsupportedForMessageFormatError,
    PolicyViolationError,
    InvalidTopicError,
    TopicAuthorizationFailedError,
    ClusterAuthorizationFailedError,
)


class DeadLetters:
    """The consumer's dead-letter producer (started and stopped by the consumer)."""

    def __init__(self, kafka: KafkaSettings, stats: Counter[str], log: Any) -> None:
        self.kafka = kafka
        self.producer: Any = None  # an AIOKafkaProducer, acks=all
        self._stats = stats
        self._log = log

    async def send(self, handle: Handle, reason: str) -> KafkaError | None:
        """Produce the record's dead letter; None once the broker has it, else why not."""
        record = handle.record
        topic = self.kafka.dead_letter_topic(record.topic)
        own = _headers(handle, reason)
        original = [(k, v) for k, v in record.headers or () if not k.startswith(DLT_PREFIX)]
        # aiokafka refuses a record with neither key nor value (a keyless tombstone)
        value = b"" if record.value is None and record.key is None else record.value
        try:
            await self.producer.send_and_wait(topic, value, key=record.key, headers=original + own)
        except _UNSENDABLE as exc:
            failure = await self._send_reduced(handle, topic, original, own, exc)
        except KafkaError as exc:
            failure = exc
        else:
            return None
        if failure is not None:
            self._stats["dead_letter_failures"] += 1
            self._log.warning(
                "dead-letter send failed, record rewound",
                message_id=handle.message_id,
                topic=topic,
                attempt=handle.attempt,
                outcome="rewound",
                error=failure,
            )
        return failure

    async def _send_reduced(
        self,
        handle: Handle,
        topic: str,
        original: list[tuple[str, bytes]],
        own: list[tuple[str, bytes]],
        refusal: Exception,
    ) -> KafkaError | None:
        """Send what identifies the record and why it failed; the value stays in its topic."""
        record = handle.record
        value = record.value or b""
        dropped, headers, key = ["value"], original, record.key
        if sum(len(k) + len(v) for k, v in original) > _REDUCED_KEY_MAX * 4:
            dropped.append("headers")
            headers = []
        if key is not None and len(key) > _REDUCED_KEY_MAX:
            dropped.append("key")
            key = None
        marks = [(DLT_DROPPED, ",".join(dropped).encode()), (DLT_ORIGINAL_SIZE, b"%d" % len(value))]
        self._stats["dead_letters_reduced"] += 1
        self._log.warning(
            "dead letter refused for good, sending it reduced",
            message_id=handle.message_id,
            topic=topic,
            partition=record.partition,
            offset=record.offset,
            dropped=",".join(dropped),
            size=len(value),
            error=refusal,
        )
        try:
            await self.producer.send_and_wait(topic, b"", key=key, headers=headers + own + marks)
        except KafkaError as exc:
            return exc
        return None


def _headers(handle: Handle, reason: str) -> list[tuple[str, bytes]]:
    record = handle.record
    headers = [
        (DLT_TOPIC, record.topic.encode()),
        (DLT_PARTITION, str(record.partition).encode()),
        (DLT_OFFSET, str(record.offset).encode()),
        (DLT_REASON, reason[:MAX_REASON].encode()),
        (DLT_DELIVERY_COUNT, str(handle.attempt).encode()),
    ]
    if handle.message_id is not None:
        headers.append((DLT_MESSAGE_ID, handle.message_id[:MAX_REASON].encode()))
    return headers
