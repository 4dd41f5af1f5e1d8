"""Kafka (aiokafka): a consumer-group member that commits offsets instead of acking.

The adapter, one module per role:

- :mod:`~worker.brokers.kafka.settings`: ``WORKER_KAFKA_*``, their cross-checks, and
  starting a client (with the error that says whether a retry can help, and names the
  setting a broker refuses);
- :mod:`~worker.brokers.kafka.records`: reading a record (header text, the dedup key,
  CloudEvents) and the names of the dead-letter headers;
- :mod:`~worker.brokers.kafka.consumer`: :class:`KafkaConsumer`, the transport the pump
  consumes from (fetching, flow control, hand-out) and how the settlement verbs map
  onto offsets;
- :mod:`~worker.brokers.kafka.partitions`: its bookkeeping per owned partition, per
  record handed out, and the in-memory delivery counts; rebalances (assignments with
  their claims, revocations, fences);
- :mod:`~worker.brokers.kafka.store`: the offset store: commits to Kafka, or the
  ``consumer_offsets`` rows when offsets or delivery counts live in the database;
- :mod:`~worker.brokers.kafka.offsets`: those rows' statements and their epoch fence;
- :mod:`~worker.brokers.kafka.watchdog`: a member holding a hung record leaves the group;
- :mod:`~worker.brokers.kafka.deadletters`: producing dead letters, reduced if need be;
- :mod:`~worker.brokers.kafka.membership`: the one place that reads aiokafka's private
  group coordinator (the generation, the coordinator, a rejoin);
- :mod:`~worker.brokers.kafka.admin`: :class:`KafkaAdmin`, ``worker publish`` and
  ``worker dlq``;
- :mod:`~worker.brokers.kafka.publisher`: :class:`KafkaPublisher`, the outbox relay's.

:mod:`worker.brokers` loads this package only for ``WORKER_BROKER=kafka`` and calls
:func:`open_broker` / :func:`open_admin`; :func:`worker.brokers.publishers.open_publisher`
calls :func:`open_publisher`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.brokers.kafka.admin import KafkaAdmin
from worker.brokers.kafka.consumer import KafkaConsumer
from worker.brokers.kafka.publisher import KafkaPublisher
from worker.brokers.kafka.records import (
    DLT_DELIVERY_COUNT,
    DLT_DROPPED,
    DLT_MESSAGE_ID,
    DLT_OFFSET,
    DLT_ORIGINAL_SIZE,
    DLT_PARTITION,
    DLT_REASON,
    DLT_TOPIC,
    cloud_event_key,
    header_message_id,
)
from worker.brokers.kafka.settings import KafkaSettings, load_kafka_settings, start_producer

if TYPE_CHECKING:
    from worker.settings import Settings

__all__ = [
    "DLT_DELIVERY_COUNT",
    "DLT_DROPPED",
    "DLT_MESSAGE_ID",
    "DLT_OFFSET",
    "DLT_ORIGINAL_SIZE",
    "DLT_PARTITION",
    "DLT_REASON",
    "DLT_TOPIC",
    "KafkaAdmin",
    "KafkaConsumer",
    "KafkaPublisher",
    "KafkaSettings",
    "cloud_event_key",
    "header_message_id",
    "load_kafka_settings",
    "open_admin",
    "open_broker",
    "open_publisher",
    "start_producer",
]


def open_broker(settings: Settings) -> KafkaConsumer:
    return KafkaConsumer(settings, load_kafka_settings())


def open_admin(settings: Settings) -> KafkaAdmin:
    return KafkaAdmin(load_kafka_settings())


def open_publisher(settings: Settings, timeout: float) -> KafkaPublisher:
    return KafkaPublisher(load_kafka_settings(), timeout)
