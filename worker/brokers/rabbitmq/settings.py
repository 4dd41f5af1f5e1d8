"""``WORKER_RABBITMQ_*`` and what connecting takes: TLS, the connection's arguments, start failures.

Shared by the consumer, the operator tools and the outbox publisher, so all three
connect the same way and report a refused start the same way.
"""

from __future__ import annotations

import os
import ssl
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from aiormq.exceptions import (
    AMQPError,
    ChannelPreconditionFailed,
    InvalidFrameError,
    ProbableAuthenticationError,
)
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.db import redact
from worker.errors import BrokerUnavailable, ConfigurationError, WorkerError
from worker.logs import scrub
from worker.startup import reason

_DEFAULT_RETRY_DELAYS = (1.0, 5.0, 30.0, 120.0)


# What aio-pika/aiormq raise when a settlement can no longer reach the broker
# (channel closed, connection lost, confirm refused); ChannelInvalidStateError
# is a RuntimeError, socket errors are OSErrors.
CONNECTION_LOST = (AMQPError, OSError, RuntimeError, TimeoutError)


class RabbitMQSettings(BaseSettings):
    """``WORKER_RABBITMQ_*``: where to connect and what to declare."""

    model_config = SettingsConfigDict(env_prefix="WORKER_RABBITMQ_", extra="ignore")

    url: str = Field("amqp://guest:guest@127.0.0.1:5672/", description="amqp:// or amqps://")
    queue: str = Field("worker", min_length=1, description="The work queue; names the rest.")
    exchange: str = Field("worker", description="Bound to the work queue; '' binds nothing.")
    exchange_type: Literal["topic", "direct", "fanout", "headers"] = "topic"
    binding_keys: list[str] = Field(["#"], description="JSON list of routing keys to bind.")
    queue_type: Literal["quorum", "classic"] = "quorum"
    retry_delays: list[float] = Field(
        list(_DEFAULT_RETRY_DELAYS), description="JSON list of seconds, one retry queue each."
    )
    content_hash_ids: bool = Field(False, description="No id at all: sha256(type+body). Risky.")
    reconnect_interval: float = Field(2.0, gt=0, description="Seconds between reconnects.")
    connect_timeout: float = Field(10.0, gt=0)
    settle_timeout: float = Field(15.0, gt=0, description="Bound on one ack/publish confirm.")
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True

    @field_validator("url")
    @classmethod
    def _amqp_url(cls, value: str) -> str:
        if not value.startswith(("amqp://", "amqps://")):
            raise ValueError("must start with amqp:// or amqps://")
        return value

    @field_validator("retry_delays")
    @classmethod
    def _ascending(cls, value: list[float]) -> list[float]:
        if any(d <= 0 for d in value) or value != sorted(set(value)):
            raise ValueError("must be positive seconds in ascending order, without repeats")
        return value

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.queue}.dlx"

    @property
    def dead_letter_queue(self) -> str:
        """A classic queue: a peek (get, then give back) keeps its place and counts nothing."""
        return f"{self.queue}.dlq"

    def retry_queue(self, delay: float) -> str:
        """Named by its TTL, so changing the delays declares new queues instead of failing."""
        return f"{self.queue}.delay.{round(delay * 1000)}ms"

    @property
    def legacy_queues(self) -> dict[str, str]:
        """Queues of earlier versions -> where their messages belong now (drained at start).

        ``Q.retry.<ms>ms`` were classic TTL queues, which dead-letter at most once (a
        copy whose TTL ran out while the broker stopped was dropped); ``Q.dead`` was a
        quorum queue, whose every peek raised the delivery count of its messages.
        """
        delays = sorted({*self.retry_delays, *_DEFAULT_RETRY_DELAYS})
        legacy = {f"{self.queue}.retry.{round(d * 1000)}ms": self.queue for d in delays}
        legacy[f"{self.queue}.dead"] = self.dead_letter_queue
        return legacy

    def retry_delay(self, delivery_count: int, requested: float | None) -> float | None:
        """The retry queue's delay for a nack; ``None``: requeue at once."""
        delays = self.retry_delays
        if not delays or (requested is not None and requested <= 0):
            return None
        if requested is None:  # back off further on every failed delivery
            return delays[min(max(delivery_count, 1), len(delays)) - 1]
        return next((d for d in delays if d >= requested), delays[-1])


def ssl_context(settings: RabbitMQSettings) -> ssl.SSLContext | None:
    """The TLS context for amqps:// URLs, from the WORKER_RABBITMQ_TLS_* settings."""
    if not settings.url.startswith("amqps://"):
        if settings.tls_ca_file or settings.tls_cert_file or settings.tls_key_file:
            raise ConfigurationError(
                "WORKER_RABBITMQ_TLS_*: set, but WORKER_RABBITMQ_URL is not amqps://"
            )
        return None
    try:
        context = ssl.create_default_context(cafile=settings.tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(f"WORKER_RABBITMQ_TLS_CA_FILE: {exc}") from None
    if settings.tls_cert_file:
        try:
            context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(f"WORKER_RABBITMQ_TLS_CERT_FILE/KEY_FILE: {exc}") from None
    elif settings.tls_key_file:
        raise ConfigurationError(
            "WORKER_RABBITMQ_TLS_KEY_FILE: set without WORKER_RABBITMQ_TLS_CERT_FILE"
        )
    if not settings.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def connect_args(settings: RabbitMQSettings) -> dict[str, Any]:
    return {
        "ssl_context": ssl_context(settings),
        "timeout": settings.connect_timeout,
        "client_properties": {"connection_name": f"worker {settings.queue} pid {os.getpid()}"},
    }


def start_failure(settings: RabbitMQSettings, exc: BaseException) -> WorkerError:
    """What a failed start means: configuration no retry can fix, or a broker not there yet."""
    url = redact(settings.url)
    if isinstance(exc, ChannelPreconditionFailed):  # a queue exists with other arguments
        return ConfigurationError(
            f"WORKER_RABBITMQ_QUEUE={settings.queue!r}: {exc}; the existing queues were declared "
            "with other settings (queue type, retry delays): pick a new queue name or delete them"
        )
    if isinstance(exc, ProbableAuthenticationError):
        return ConfigurationError(f"WORKER_RABBITMQ_URL={url}: login refused ({exc.args[0]})")
    if isinstance(exc, InvalidFrameError) and "Connection.Close" in str(exc):
        # The broker closed the connection in answer to connection.open: the only
        # argument there is the virtual host (aiormq keeps no more than the frame's name).
        vhost = unquote(urlsplit(settings.url).path[1:]) or "/"
        return ConfigurationError(
            f"WORKER_RABBITMQ_URL={url}: the broker refused virtual host {vhost!r} "
            "(it does not exist, or this user has no permission on it)"
        )
    return BrokerUnavailable(f"{url}: {scrub(reason(exc))}")
