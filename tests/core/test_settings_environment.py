"""Unknown WORKER_* variables: a typo is reported with the closest known name, or refused."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings
from structlog.testing import capture_logs

from handlers.notify import MailSettings
from tests.support.processes import REPO, clean_env, json_lines, run_cli
from worker.brokers.kafka import KafkaSettings
from worker.brokers.rabbitmq import RabbitMQSettings
from worker.brokers.servicebus import ServiceBusSettings
from worker.errors import ConfigurationError
from worker.outbox.model import OutboxSettings
from worker.settings import Settings, check_environment, load, unknown_variables

SETTINGS_CLASSES: list[type[BaseSettings]] = [
    Settings,
    RabbitMQSettings,
    KafkaSettings,
    ServiceBusSettings,
    OutboxSettings,
    MailSettings,  # a shipped handler's (WORKER_MAIL_*), declared with handler_settings
]


def known_names(cls: type[BaseSettings]) -> set[str]:
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    return {prefix + name.upper() for name in cls.model_fields}


def test_a_typo_is_reported_with_the_closest_known_name() -> None:
    environ = {
        "WORKER_CONCURENCY": "64",
        "WORKER_MAX_DELIVERY": "3",
        "WORKER_DATABASE_URL": "sqlite+aiosqlite:///w.db",  # known: not reported
        "worker_log_level": "DEBUG",  # known, in another case: pydantic reads it too
        "HOME": "/root",
        "WORKERS": "4",  # not a WORKER_ variable
    }
    assert unknown_variables(Settings, environ) == [
        "WORKER_CONCURENCY (did you mean WORKER_CONCURRENCY?)",
        "WORKER_MAX_DELIVERY (did you mean WORKER_MAX_DELIVERIES?)",
    ]


def test_a_name_from_nowhere_is_reported_without_a_hint() -> None:
    newer = {"WORKER_FEATURE_FLAGS_V9": "1"}  # from a newer version, say
    assert unknown_variables(Settings, newer) == ["WORKER_FEATURE_FLAGS_V9"]
    assert unknown_variables(Settings, {}) == []


def test_adapter_prefixes_are_left_to_their_own_classes() -> None:
    environ = {
        "WORKER_RABBITMQ_QUEUEE": "credits",
        "WORKER_RABBITMQ_QUEUE": "credits",
        "WORKER_KAFKA_TOPICSS": "credits",
        "WORKER_SERVICEBUS_QUEUE_NAMEE": "credits",
        "WORKER_OUTBOX_BATCHH": "10",
        "WORKER_TEST_POSTGRES_URL": "postgresql+asyncpg://postgres@127.0.0.1/postgres",
        "WORKER_CONCURENCY": "64",
    }
    # the core reports its own typo and nothing under an adapter's prefix
    assert unknown_variables(Settings, environ) == [
        "WORKER_CONCURENCY (did you mean WORKER_CONCURRENCY?)"
    ]
    # each adapter reports its own typo, and nothing of the core's or another adapter's
    rabbit = unknown_variables(RabbitMQSettings, environ)
    assert rabbit == ["WORKER_RABBITMQ_QUEUEE (did you mean WORKER_RABBITMQ_QUEUE?)"]
    [kafka] = unknown_variables(KafkaSettings, environ)
    assert kafka.startswith("WORKER_KAFKA_TOPICSS (did you mean WORKER_KAFKA_TOPICS")
    [servicebus] = unknown_variables(ServiceBusSettings, environ)
    assert servicebus.startswith("WORKER_SERVICEBUS_QUEUE_NAMEE")
    [outbox] = unknown_variables(OutboxSettings, environ)
    assert outbox.startswith("WORKER_OUTBOX_BATCHH")


def test_an_adapter_refuses_its_own_typo_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
    monkeypatch.setenv("WORKER_RABBITMQ_QUEUEE", "credits")
    monkeypatch.setenv("WORKER_REFUSE_UNKNOWN_VARIABLES", "true")
    with pytest.raises(ConfigurationError, match="WORKER_RABBITMQ_QUEUEE") as raised:
        load(RabbitMQSettings)
    assert "did you mean WORKER_RABBITMQ_QUEUE?" in str(raised.value)
    assert "\n" not in str(raised.value)


def test_unknown_variables_are_warned_about_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.upper().startswith("WORKER_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("WORKER_CONCURENCY", "64")
    with capture_logs() as logs:
        check_environment(Settings)  # no exception: a warning only
    assert logs == [
        {
            "event": "unknown WORKER_ variables ignored",
            "log_level": "warning",
            "variables": ["WORKER_CONCURENCY (did you mean WORKER_CONCURRENCY?)"],
        }
    ]


@pytest.mark.parametrize("value", ["true", "1", "yes", "on", "TRUE", "True", "y", "t"])
def test_refusal_is_switched_on_by_every_spelling_of_true(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("WORKER_CONCURENCY", "64")
    monkeypatch.setenv("WORKER_REFUSE_UNKNOWN_VARIABLES", value)
    assert load(Settings, check=False).refuse_unknown_variables  # what the setting says...
    with pytest.raises(ConfigurationError, match="WORKER_CONCURENCY"):
        check_environment(Settings)  # ...is what the check does


@pytest.mark.parametrize("value", ["false", "0", "no", "off"])
def test_refusal_stays_off_when_switched_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("WORKER_CONCURENCY", "64")
    monkeypatch.setenv("WORKER_REFUSE_UNKNOWN_VARIABLES", value)
    with capture_logs() as logs:
        check_environment(Settings)
    assert [line["event"] for line in logs] == ["unknown WORKER_ variables ignored"]


def test_every_variable_the_deployment_sets_is_known(tmp_path: Path) -> None:
    """With refusal on, a deployment file naming a variable no settings class knows
    would stop every pod at start."""
    known = set().union(*(known_names(cls) for cls in SETTINGS_CLASSES))
    files = [*(REPO / "deploy").rglob("*.y*ml"), *(REPO / "deploy").rglob("*.env")]
    files += [
        REPO / name for name in ("docker-compose.yml", "Dockerfile") if (REPO / name).exists()
    ]
    # a name as a variable (NAME=, NAME:, name: NAME), not inside a longer word or a prefix
    pattern = re.compile(r"(?<![A-Z0-9_])WORKER_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_])")
    used = {
        (path.relative_to(REPO).as_posix(), name)
        for path in files
        for name in pattern.findall(path.read_text(errors="replace"))
    }
    assert used, "the deployment files name no WORKER_ variables: the scan is broken"
    assert sorted((where, name) for where, name in used if name not in known) == []


# -- a real `worker` process ----------------------------------------------------------------


def worker_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        **clean_env(),
        "WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/worker.db",
        "WORKER_LOG_FORMAT": "json",
        **extra,
    }


def test_worker_refuses_an_unknown_variable_with_one_line_and_exit_2(tmp_path: Path) -> None:
    env = worker_env(tmp_path, WORKER_REFUSE_UNKNOWN_VARIABLES="true", WORKER_CONCURENCY="64")
    result = run_cli(env, "run", timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "worker: configuration error: unknown variables (WORKER_REFUSE_UNKNOWN_VARIABLES is "
        "set): WORKER_CONCURENCY (did you mean WORKER_CONCURRENCY?)"
    ]
    assert not (tmp_path / "worker.db").exists()  # refused before touching the database


def test_worker_refuses_an_adapters_unknown_variable(tmp_path: Path) -> None:
    env = worker_env(
        tmp_path,
        WORKER_REFUSE_UNKNOWN_VARIABLES="true",
        WORKER_BROKER="rabbitmq",
        WORKER_ALLOW_SQLITE_WITH_NETWORK_BROKER="true",
        WORKER_RABBITMQ_URL="amqp://guest:guest@127.0.0.1:1/",  # refused before it connects
        WORKER_RABBITMQ_QUEUEE="credits",
    )
    result = run_cli(env, "run", timeout=60)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("worker: configuration error: unknown variables")
    assert "WORKER_RABBITMQ_QUEUEE (did you mean WORKER_RABBITMQ_QUEUE?)" in line


def test_worker_warns_and_carries_on_without_refusal(tmp_path: Path) -> None:
    result = run_cli(worker_env(tmp_path, WORKER_CONCURENCY="64"), "migrate", timeout=120)
    assert result.returncode == 0, result.stderr
    [warning] = [
        line
        for line in json_lines(result.stderr)
        if line.get("event") == "unknown WORKER_ variables ignored"
    ]
    assert warning["variables"] == ["WORKER_CONCURENCY (did you mean WORKER_CONCURRENCY?)"]
    assert warning["level"] == "warning"
