"""Settings the Service Bus tests share: a fake namespace's connection string, short timeouts."""

from __future__ import annotations

from typing import Any

from pydantic import SecretStr

from worker.brokers.servicebus import ServiceBusSettings

SECRET = "s3cr3t-key"
CONNECTION_STRING = (
    f"Endpoint=sb://fake.servicebus.windows.net/;SharedAccessKeyName=test;SharedAccessKey={SECRET}"
)


def sb_settings(**overrides: Any) -> ServiceBusSettings:
    values: dict[str, Any] = {
        "connection_string": SecretStr(CONNECTION_STRING),
        "queue": "work",
        "receive_wait": 0.2,
        "reconnect_backoff": 0.05,
        "reconnect_backoff_max": 0.2,
        "try_timeout": 1.0,
        "retry_total": 0,
    }
    values.update(overrides)
    return ServiceBusSettings(**values).check()
