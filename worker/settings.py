"""Configuration from ``WORKER_*`` environment variables (pydantic-settings).

Broker adapters keep their own settings class next to their code (for example
``WORKER_RABBITMQ_*`` in :mod:`worker.brokers.rabbitmq`) and load it through
:func:`load`, so every bad value anywhere is reported the same way: one line
naming the variable.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.errors import ConfigurationError

S = TypeVar("S", bound=BaseSettings)

_SECRET_HINTS = ("url", "password", "connection", "secret", "key")


class Settings(BaseSettings):
    """Everything the pump itself needs. Field ``x`` is the variable ``WORKER_X``."""

    model_config = SettingsConfigDict(env_prefix="WORKER_", extra="ignore")

    database_url: str = Field(
        "sqlite+aiosqlite:///worker.db",
        description="SQLAlchemy async URL; SQLite (aiosqlite, WAL) or PostgreSQL (asyncpg).",
    )
    broker: Literal["memory", "rabbitmq", "kafka", "servicebus"] = "memory"
    handlers: str = Field("handlers", description="Comma-separated modules that register handlers.")
    concurrency: int = Field(16, ge=1, le=1024, description="Deliveries processed at once.")
    max_attempts: int = Field(5, ge=1, le=100, description="In-process attempts per delivery.")
    max_deliveries: int = Field(5, ge=1, le=1000, description="Deliveries before dead-lettering.")
    retry_backoff: float = Field(0.02, ge=0, description="Base of the jittered backoff, seconds.")
    retry_backoff_max: float = Field(1.0, ge=0, description="Cap of the jittered backoff, seconds.")
    grace_period: float = Field(25.0, ge=0, description="Seconds in-flight work gets at shutdown.")
    fast_path: bool = Field(True, description="Check the inbox before running a redelivery.")
    message_id_func: str | None = Field(
        None, description="'module:function' that extracts the dedup key from a raw message."
    )
    db_pool_size: int | None = Field(None, ge=1, description="Default: concurrency + 2.")
    db_probe_backoff_max: float = Field(5.0, gt=0, description="Cap between database probes.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["auto", "json", "console"] = "auto"

    @field_validator("database_url")
    @classmethod
    def _supported_database(cls, value: str) -> str:
        if not value.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError("must start with sqlite+aiosqlite:// or postgresql+asyncpg://")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @property
    def handler_modules(self) -> list[str]:
        return [name.strip() for name in self.handlers.split(",") if name.strip()]

    @property
    def pool_size(self) -> int:
        return self.db_pool_size or self.concurrency + 2


def load(cls: type[S]) -> S:
    """Instantiate a settings class from the environment, or raise a one-line error."""
    try:
        return cls()
    except ValidationError as exc:
        raise ConfigurationError(describe(exc, cls)) from None


def describe(exc: ValidationError, cls: type[BaseSettings]) -> str:
    prefix = cls.model_config.get("env_prefix", "")
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        name = f"{prefix}{field}".upper()
        shown = "" if any(h in field for h in _SECRET_HINTS) else f"={error.get('input')!r}"
        problems.append(f"{name}{shown}: {error['msg']}")
    return "; ".join(problems)
