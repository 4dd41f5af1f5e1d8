"""A handler's settings are its own: declared under a prefix, known to the unknown-variable
check, and not in the core Settings (handlers.notify's WORKER_MAIL_API_URL)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from structlog.testing import capture_logs

from handlers import notify
from handlers.notify import MailSettings
from tests.support.processes import clean_env, run_cli
from worker import settings as settings_module
from worker.errors import ConfigurationError
from worker.settings import (
    Settings,
    check_environment,
    declared_handler_settings,
    handler_settings,
    load,
    unknown_variables,
)


@pytest.fixture(autouse=True)
def declarations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The declarations a test makes are undone after it."""
    monkeypatch.setattr(
        settings_module, "_HANDLER_SETTINGS", dict(settings_module._HANDLER_SETTINGS)
    )


def test_the_mail_setting_is_the_handlers_not_the_cores() -> None:
    assert "mail_api_url" not in Settings.model_fields
    assert MailSettings in declared_handler_settings()
    variables = {"WORKER_MAIL_API_URL": "https://mail.example/send"}
    assert unknown_variables(Settings, variables) == []
    assert unknown_variables(MailSettings, variables) == []


def test_a_typo_under_the_handlers_prefix_is_the_handlers_to_report() -> None:
    environ = {"WORKER_MAIL_API_UR": "https://mail.example/send", "WORKER_CONCURENCY": "8"}
    assert unknown_variables(Settings, environ) == [
        "WORKER_CONCURENCY (did you mean WORKER_CONCURRENCY?)"
    ]
    assert unknown_variables(MailSettings, environ) == [
        "WORKER_MAIL_API_UR (did you mean WORKER_MAIL_API_URL?)"
    ]


def test_the_handler_reads_its_setting_when_it_first_needs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKER_MAIL_API_URL", "https://mail.example/send")
    notify.configure(None)
    try:
        assert notify.mail_settings().api_url == "https://mail.example/send"
        monkeypatch.setenv("WORKER_MAIL_API_URL", "https://elsewhere.example/send")
        assert notify.mail_settings().api_url == "https://mail.example/send"  # read once
        notify.configure(MailSettings(api_url="http://127.0.0.1:1/send"))
        assert notify.mail_settings().api_url == "http://127.0.0.1:1/send"
    finally:
        notify.configure(None)


def test_the_handlers_bad_value_is_one_line_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @handler_settings
    class Strict(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="WORKER_STRICTTEST_", extra="ignore")
        retries: int = Field(3, ge=0)

    monkeypatch.setenv("WORKER_STRICTTEST_RETRIES", "-1")
    with pytest.raises(ConfigurationError, match="WORKER_STRICTTEST_RETRIES='-1'"):
        load(Strict)


@pytest.mark.parametrize(
    ("prefix", "complaint"),
    [
        ("WORKER_", "must be WORKER_<NAME>_"),  # the core's own prefix: it would own everything
        ("MAIL_", "must be WORKER_<NAME>_"),
        ("WORKER_MAIL", "must be WORKER_<NAME>_"),
        ("WORKER_MAX_", "would take core variables"),  # hides WORKER_MAX_DELIVERY, a typo
        ("WORKER_CLAIM_", "would take core variables"),
        ("WORKER_KAFKA_EXTRA_", "overlaps 'WORKER_KAFKA_' of the worker"),  # an adapter's
        (
            "WORKER_MAIL_API_",
            "overlaps 'WORKER_MAIL_' of handlers.notify.MailSettings",
        ),  # another handler's
    ],
)
def test_a_prefix_that_would_hide_someone_elses_variables_is_refused(
    prefix: str, complaint: str
) -> None:
    class Greedy(BaseSettings):
        model_config = SettingsConfigDict(env_prefix=prefix, extra="ignore")
        value: str = ""

    with pytest.raises(ValueError, match=complaint):
        handler_settings(Greedy)
    assert Greedy not in declared_handler_settings()


LATE = "tests.core.late_handler_settings"


def test_the_start_up_check_knows_the_variables_of_modules_not_imported_yet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``worker`` checks the core's variables before it imports the handler modules: the
    check imports WORKER_HANDLERS itself before it calls a variable unknown."""
    for name in [n for n in os.environ if n.upper().startswith("WORKER_")]:
        monkeypatch.delenv(name)
    monkeypatch.delitem(sys.modules, LATE, raising=False)  # imported by no test before
    monkeypatch.setenv("WORKER_HANDLERS", LATE)
    monkeypatch.setenv("WORKER_LATETEST_GREETING", "hello")
    monkeypatch.setenv("WORKER_REFUSE_UNKNOWN_VARIABLES", "true")
    [unknown] = unknown_variables(Settings)  # not imported yet
    assert unknown.startswith("WORKER_LATETEST_GREETING")
    check_environment(Settings)  # imported by the check: known, no refusal
    assert unknown_variables(Settings) == []
    monkeypatch.setenv("WORKER_LATETEST_GRETING", "hello")  # a typo under its prefix
    with capture_logs() as logs:
        check_environment(Settings)  # ... is not the core's to report
    assert logs == []


# -- a real `worker` process ----------------------------------------------------------------


def worker_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        **clean_env(),
        "WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/worker.db",
        "WORKER_LOG_FORMAT": "json",
        "WORKER_REFUSE_UNKNOWN_VARIABLES": "true",
        "WORKER_MAIL_API_URL": "http://127.0.0.1:1/send",
        **extra,
    }


def test_worker_accepts_the_handlers_variable_with_refusal_on(tmp_path: Path) -> None:
    result = run_cli(worker_env(tmp_path), "migrate", timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_variable_is_unknown_without_the_handler_that_declares_it(tmp_path: Path) -> None:
    # a handler module that declares other settings (the handlers package imports notify)
    env = worker_env(tmp_path, WORKER_HANDLERS=LATE)
    result = run_cli(env, "migrate", timeout=120)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(
        "worker: configuration error: unknown variables (WORKER_REFUSE_UNKNOWN_VARIABLES is "
        "set): WORKER_MAIL_API_URL"
    )
