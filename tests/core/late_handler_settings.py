"""A handler module that only declares settings (WORKER_LATETEST_*), for
test_handler_settings.py: it is imported by the unknown-variable check, not by the test."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.settings import handler_settings


@handler_settings
class LateSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WORKER_LATETEST_", extra="ignore")

    greeting: str = "hi"
