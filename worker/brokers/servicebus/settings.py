"""``WORKER_SERVICEBUS_*``: where to connect, what to read, how to hold locks.

One settings class shared by the consumer, the operator tools and the outbox
publisher, with the cross-field rules checked once, in :func:`load_settings`.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.errors import ConfigurationError
from worker.settings import load


class ServiceBusSettings(BaseSettings):
    """``WORKER_SERVICEBUS_*``: where to connect, what to read, how to hold locks."""

    model_config = SettingsConfigDict(env_prefix="WORKER_SERVICEBUS_", extra="ignore")

    connection_string: SecretStr | None = Field(
        None, description="A SAS connection string (or the emulator's). Or set NAMESPACE."
    )
    namespace: str | None = Field(
        None,
        description="Fully qualified namespace (x.servicebus.windows.net), authenticated with "
        "azure-identity's DefaultAzureCredential (pip install idempotent-worker[azure]).",
    )
    queue: str | None = Field(None, description="The queue to consume; or TOPIC + SUBSCRIPTION.")
    topic: str | None = None
    subscription: str | None = None
    prefetch: int | None = Field(
        None, ge=0, description="The SDK's prefetch_count; default: the pump's concurrency."
    )
    receive_batch: int | None = Field(
        None, ge=1, description="Most messages per receive call; default: every free slot."
    )
    receive_wait: float = Field(5.0, gt=0, description="max_wait_time of one receive call, s.")
    max_lock_renewal: float = Field(
        300.0, ge=0, description="Keep renewing a message's lock this long, s; 0 turns renewal off."
    )
    try_timeout: float = Field(
        30.0, gt=0, description="Bounds each SDK attempt, including the link open, s."
    )
    retry_total: int = Field(3, ge=0, description="The SDK's own retries before it raises.")
    reconnect_backoff: float = Field(0.5, gt=0, description="Base of the reconnect backoff, s.")
    reconnect_backoff_max: float = Field(30.0, gt=0, description="Cap of the reconnect backoff, s.")
    type_property: str = Field("type", description="Application property naming the type.")
    type_mapping: dict[str, str] = Field(
        default_factory=dict,
        description='Entity -> type for messages that name none: {"orders": "OrderPlaced"}.',
    )
    entity_max_delivery_count: int = Field(
        10, ge=1, description="The entity's MaxDeliveryCount: warn unless the pump's is below."
    )
    clock_skew_tolerance: float = Field(
        30.0,
        gt=0,
        description="Local clock vs the broker's: warn beyond this; a carried count is "
        "honoured only when its copy was enqueued within the send's bound plus this, s.",
    )
    give_back_timeout: float = Field(
        10.0, gt=0, description="Bounds the give-back of fetched, untaken messages at stop, s."
    )

    @property
    def entity(self) -> str:
        """The entity path, as it appears in logs and in ``type_mapping`` keys."""
        if self.queue:
            return self.queue
        return f"{self.topic}/{self.subscription}"

    @property
    def operation_bound(self) -> float:
        """Outer bound of one SDK call: every attempt timed out, plus the SDK's retry sleeps.

        The SDK sleeps 0.8 s * 2^n (at most 120 s) between its attempts by default.
        """
        sleeps = sum(min(0.8 * 2.0**n, 120.0) for n in range(self.retry_total))
        return self.try_timeout * (self.retry_total + 1) + sleeps + 1.0

    def check(self) -> Self:
        """Cross-field rules, raised as one line that never echoes the connection string."""
        if (self.connection_string is None) == (self.namespace is None):
            raise ConfigurationError(
                "set exactly one of WORKER_SERVICEBUS_CONNECTION_STRING "
                "and WORKER_SERVICEBUS_NAMESPACE"
            )
        if self.connection_string is not None:
            # the SDK's own parser, here and not at connect: a malformed string is no outage
            from azure.servicebus import parse_connection_string

            try:
                parse_connection_string(self.connection_string.get_secret_value())
            except ValueError as exc:  # its messages name the part, never the value
                raise ConfigurationError(f"WORKER_SERVICEBUS_CONNECTION_STRING: {exc}") from None
        if bool(self.queue) == bool(self.topic):
            raise ConfigurationError(
                "set exactly one of WORKER_SERVICEBUS_QUEUE and WORKER_SERVICEBUS_TOPIC"
            )
        if self.topic and not self.subscription:
            raise ConfigurationError("WORKER_SERVICEBUS_TOPIC needs WORKER_SERVICEBUS_SUBSCRIPTION")
        return self


def load_settings() -> ServiceBusSettings:
    return load(ServiceBusSettings).check()


__all__ = ["ServiceBusSettings", "load_settings"]
