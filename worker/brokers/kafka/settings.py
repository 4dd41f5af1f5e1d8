"""``WORKER_KAFKA_*``: the settings, their cross-checks, and starting a client with them.

Everything that talks to Kafka (the consumer, ``worker publish`` and ``worker dlq``, the
outbox relay's publisher) connects with these options, so a bad value, a refused login
or a broker that refuses the producer mode fails once, here, with one line that names
the setting. A failed start is :class:`~worker.errors.BrokerUnavailable` when trying
again may succeed (the brokers are away) and :class:`~worker.errors.ConfigurationError`
when it cannot (credentials or a certificate refused, the idempotent producer refused).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, Literal

from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped]
from aiokafka.conn import collect_hosts, create_conn  # type: ignore[import-untyped]
from aiokafka.errors import (  # type: ignore[import-untyped]
    AuthenticationFailedError,
    AuthenticationMethodNotSupported,
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    UnsupportedSaslMechanismError,
)
from aiokafka.helpers import create_ssl_context  # type: ignore[import-untyped]
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.errors import BrokerUnavailable, ConfigurationError
from worker.settings import load

FETCH_WAIT_MS = 200
"""How long one fetch waits for records (the consumer's loop, the dead-letter reader)."""


class KafkaSettings(BaseSettings):
    """``WORKER_KAFKA_*``: where to consume from and how the records are read."""

    model_config = SettingsConfigDict(env_prefix="WORKER_KAFKA_", extra="ignore")

    bootstrap_servers: str = Field("localhost:9092", description="Comma-separated host:port.")

    @field_validator("bootstrap_servers")
    @classmethod
    def _servers_named(cls, value: str) -> str:
        """An empty list or an empty entry would be retried as an outage for the whole
        WORKER_START_TIMEOUT ("Unable to bootstrap from [('', 9092...)]")."""
        servers = [server.strip() for server in value.split(",")]
        for server in servers:
            host, colon, port = server.rpartition(":")
            bracketed = server.endswith("]")  # an IPv6 address without a port
            if not server or (colon and not bracketed and (not host or not port.isdigit())):
                raise ValueError("takes host:port, comma-separated (kafka-1:9092,kafka-2:9092)")
        return ",".join(servers)

    topics: str = Field("work", description="Comma-separated; `worker publish` uses the first.")
    group_id: str = Field("worker", min_length=1, description="The consumer group of the replicas.")
    client_id: str = "worker"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = Field(None, description="CA bundle of the brokers' certificates.")
    ssl_certfile: str | None = Field(None, description="Client certificate (mutual TLS).")
    ssl_keyfile: str | None = Field(None, description="Client private key (mutual TLS).")
    ssl_password: SecretStr | None = Field(None, description="Password of the client key.")
    message_id_header: str = Field("message-id", min_length=1, description="Dedup key header.")
    type_header: str = Field("type", min_length=1, description="Message type header.")
    topic_types: dict[str, str] = Field(
        default_factory=dict, description='JSON {"topic": "MessageType"} for records without one.'
    )
    dead_letter_suffix: str = Field(".DLT", min_length=1, description="Dead-letter topic suffix.")
    commit_interval: float = Field(1.0, gt=0, description="Seconds between offset commits.")
    commit_timeout: float = Field(
        10.0, gt=0, description="Seconds a commit or a client stop may take (broker away)."
    )
    session_timeout_ms: int = Field(45_000, ge=1000)
    heartbeat_interval_ms: int = Field(3_000, ge=100)
    max_poll_interval_ms: int = Field(300_000, ge=1000)
    rebalance_grace: float = Field(
        10.0, ge=0, description="Seconds in-flight records of revoked partitions get to settle."
    )
    redelivery_delay: float = Field(1.0, ge=0, description="First backoff of a nacked record.")
    redelivery_delay_max: float = Field(30.0, ge=0, description="Cap of that doubling backoff.")
    auto_offset_reset: Literal["earliest", "latest"] = Field(
        "earliest", description="Where a group without a committed offset starts."
    )
    max_buffered: int = Field(500, ge=1, description="Fetched records buffered per partition.")
    max_buffered_bytes: int = Field(
        8 * 1024 * 1024, ge=1, description="Bytes of fetched records buffered per partition."
    )
    max_partition_fetch_bytes: int = Field(
        1024 * 1024, ge=1024, description="Bytes one fetch asks for per partition."
    )
    fetch_max_bytes: int = Field(
        50 * 1024 * 1024, ge=1024, description="Bytes one fetch asks for in all."
    )
    idempotent_producer: bool = Field(True, description="Idempotent dead-letter producer.")
    offsets: Literal["broker", "database"] = Field(
        "broker",
        description="broker: offsets committed to Kafka; database: stored in the handler's "
        "transaction (consumer_offsets), Kafka commits only for lag monitoring.",
    )
    ordering: Literal["partition", "key"] = Field(
        "partition",
        description="partition: one record per partition at a time; key: one per key.",
    )
    max_request_size: int = Field(
        1_048_576, ge=1024, description="Largest request the dead-letter producer sends, bytes."
    )
    watchdog_margin: float = Field(
        30.0,
        ge=0,
        description="Seconds past WORKER_HANDLER_TIMEOUT + WORKER_RETRY_BUDGET before a "
        "record in a handler counts as hung.",
    )

    @property
    def topic_list(self) -> list[str]:
        return [name.strip() for name in self.topics.split(",") if name.strip()]

    def dead_letter_topic(self, topic: str) -> str:
        return f"{topic}{self.dead_letter_suffix}"

    def client_options(self) -> dict[str, Any]:
        """Connection and security options shared by consumers and producers."""
        options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.security_protocol.startswith("SASL"):
            options["sasl_mechanism"] = self.sasl_mechanism
            options["sasl_plain_username"] = self.sasl_username
            options["sasl_plain_password"] = (
                self.sasl_password.get_secret_value() if self.sasl_password else None
            )
        if self.security_protocol.endswith("SSL"):
            options["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile,
                certfile=self.ssl_certfile,
                keyfile=self.ssl_keyfile,
                password=self.ssl_password.get_secret_value() if self.ssl_password else None,
            )
        return options


def load_kafka_settings() -> KafkaSettings:
    """Load and cross-check ``WORKER_KAFKA_*``; every problem is one line."""
    kafka = load(KafkaSettings)
    topics = kafka.topic_list
    if not topics:
        raise ConfigurationError("WORKER_KAFKA_TOPICS: name at least one topic")
    if any(topic.endswith(kafka.dead_letter_suffix) for topic in topics):
        raise ConfigurationError("WORKER_KAFKA_TOPICS: a dead-letter topic cannot be consumed")
    if kafka.security_protocol.startswith("SASL") and not (
        kafka.sasl_username and kafka.sasl_password
    ):
        raise ConfigurationError(
            "WORKER_KAFKA_SASL_USERNAME and WORKER_KAFKA_SASL_PASSWORD are required with "
            f"WORKER_KAFKA_SECURITY_PROTOCOL={kafka.security_protocol}"
        )
    if bool(kafka.ssl_certfile) != bool(kafka.ssl_keyfile):
        raise ConfigurationError(
            "WORKER_KAFKA_SSL_CERTFILE and WORKER_KAFKA_SSL_KEYFILE go together"
        )
    if kafka.heartbeat_interval_ms * 3 > kafka.session_timeout_ms:
        raise ConfigurationError(
            "WORKER_KAFKA_HEARTBEAT_INTERVAL_MS must be at most a third of "
            "WORKER_KAFKA_SESSION_TIMEOUT_MS"
        )
    try:
        kafka.client_options()  # opens the certificate files: fail at start, not at connect
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"WORKER_KAFKA_SSL_*: {exc}") from None
    return kafka


# Refusals that come back the same however often the start is tried: the login, the
# certificate or the principal's rights are wrong, not the network.
_REFUSED: tuple[type[BaseException], ...] = (
    SaslAuthenticationFailed,
    AuthenticationFailedError,
    AuthenticationMethodNotSupported,
    UnsupportedSaslMechanismError,
    IllegalSaslStateError,
    GroupAuthorizationFailedError,
    TopicAuthorizationFailedError,
    ClusterAuthorizationFailedError,
    ssl.SSLCertVerificationError,
)


def describe(exc: BaseException) -> str:
    """An error's type and text, never empty (KafkaError's text already names its type)."""
    text = str(exc)
    if isinstance(exc, KafkaError) or not text:
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


async def start_client(kafka: KafkaSettings, client: Any, *, producer: bool = False) -> None:
    """``client.start()``, or the one-line error that says what its failure means."""
    try:
        await client.start()
    except Exception as exc:  # aiokafka lets a failed SASL exchange escape as KeyError & co
        raise await start_error(kafka, exc, producer=producer) from None


async def start_producer(kafka: KafkaSettings, *, request_timeout: float | None = None) -> Any:
    """A started ``acks=all`` producer (idempotent unless switched off), or a one-line error.

    ``request_timeout`` bounds a send's wait for metadata and for its ack (aiokafka's
    40 s when None).
    """
    options = kafka.client_options()
    if request_timeout is not None:
        options["request_timeout_ms"] = max(1, int(request_timeout * 1000))
    producer = AIOKafkaProducer(acks="all", enable_idempotence=kafka.idempotent_producer, **options)
    try:
        await start_client(kafka, producer, producer=True)
    except (BrokerUnavailable, ConfigurationError):
        await producer.stop()
        raise
    return producer


async def start_error(
    kafka: KafkaSettings, exc: Exception, *, producer: bool = False
) -> BrokerUnavailable | ConfigurationError:
    """What a failed start means: try again later, or fix the configuration.

    - A refused login or certificate (:data:`_REFUSED`), or, with SASL, the exchange
      failing inside aiokafka (its SCRAM code raises ``KeyError``/``ValueError`` when
      the server answers with an error): the configuration. aiokafka's bootstrap logs
      why each server refused and raises only "Unable to bootstrap", so with SASL or TLS
      one server is asked again (:func:`connect_once`) for the reason.
    - A producer start past the bootstrap fails only in InitProducerId, which the
      idempotent producer needs and some brokers (old ones, some Kafka-compatible ones,
      a principal without IDEMPOTENT_WRITE) refuse, with errors as vague as
      ``UnknownError``: name the setting that avoids it.
    - Anything else (unreachable, reset, timed out): the brokers are away.
    """
    where = f"kafka at {kafka.bootstrap_servers}"
    if isinstance(exc, KafkaConnectionError) and kafka.security_protocol != "PLAINTEXT":
        cause = await connect_once(kafka)
        exc = cause if cause is not None and _refusal(kafka, cause) else exc
    if _refusal(kafka, exc):
        return ConfigurationError(
            f"{where} refused the login ({describe(exc)}): check WORKER_KAFKA_SECURITY_PROTOCOL,"
            " WORKER_KAFKA_SASL_* and WORKER_KAFKA_SSL_*"
        )
    idempotent = producer and kafka.idempotent_producer
    if idempotent and isinstance(exc, KafkaError) and not isinstance(exc, KafkaConnectionError):
        return ConfigurationError(
            f"{where} refused the idempotent producer ({type(exc).__name__}: {exc}); the "
            "broker may not support it or not allow it (IDEMPOTENT_WRITE): set "
            "WORKER_KAFKA_IDEMPOTENT_PRODUCER=false to use a plain producer (acks=all)"
        )
    return BrokerUnavailable(f"{where}: {describe(exc)}")


def _refusal(kafka: KafkaSettings, exc: Exception) -> bool:
    sasl = kafka.security_protocol.startswith("SASL")
    return isinstance(exc, _REFUSED) or (sasl and isinstance(exc, KeyError | ValueError))


async def connect_once(kafka: KafkaSettings) -> Exception | None:
    """Open (and close) one connection to each bootstrap server in turn: the first
    failure, with its real cause, or None when one server let the connection in."""
    options = kafka.client_options()
    for host, port, _family in collect_hosts(kafka.bootstrap_servers, randomize=False):
        try:
            async with asyncio.timeout(kafka.commit_timeout):
                connection = await create_conn(
                    host,
                    port,
                    client_id=kafka.client_id,
                    ssl_context=options.get("ssl_context"),
                    security_protocol=kafka.security_protocol,
                    sasl_mechanism=options.get("sasl_mechanism"),
                    sasl_plain_username=options.get("sasl_plain_username"),
                    sasl_plain_password=options.get("sasl_plain_password"),
                )
        except Exception as exc:
            return exc
        connection.close()
    return None
