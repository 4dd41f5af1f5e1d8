"""Values as people write them: one line naming the variable and the form it takes.

JSON-typed settings given as plain text were 60-line tracebacks from pydantic-settings;
``WORKER_INBOX_RETENTION=60`` was "day identifier in duration not correctly formatted";
``WORKER_MESSAGE_ID_FUNC=json`` was "module 'json' has no attribute ''"; an SQLite file in a
folder that does not exist, an empty Kafka server list and a malformed Service Bus
connection string were retried as outages for WORKER_START_TIMEOUT (issue 32, rows 3, 4, 8
and 11).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from worker.errors import ConfigurationError
from worker.settings import DURATION_FORMS, Settings, json_form, load

SETTINGS_MODULES = (
    "worker.settings",
    "worker.outbox.model",
    "worker.brokers.rabbitmq.settings",
    "worker.brokers.kafka.settings",
    "worker.brokers.servicebus.settings",
)


def settings_classes() -> Iterator[type[BaseSettings]]:
    for name in SETTINGS_MODULES:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseSettings)
                and value.__module__ == name
            ):
                yield value


def json_typed() -> list[tuple[type[BaseSettings], str]]:
    """Every (settings class, field) of the worker whose variable takes JSON."""
    return [
        (cls, field)
        for cls in settings_classes()
        for field in cls.model_fields
        if json_form(cls, field)
    ]


def variable(cls: type[BaseSettings], field: str) -> str:
    return f"{cls.model_config.get('env_prefix', '')}{field}".upper()


def test_the_json_typed_variables_are_found() -> None:
    found = {variable(cls, field) for cls, field in json_typed()}
    assert {
        "WORKER_KAFKA_TOPIC_TYPES",
        "WORKER_RABBITMQ_BINDING_KEYS",
        "WORKER_RABBITMQ_RETRY_DELAYS",
        "WORKER_SERVICEBUS_TYPE_MAPPING",
        "WORKER_OUTBOX_DESTINATIONS",
    } <= found


@pytest.mark.parametrize(
    ("cls", "field"), json_typed(), ids=[variable(c, f) for c, f in json_typed()]
)
@pytest.mark.parametrize("text", ["work=OrderPlaced", "#", "1s,2s", "{broken"])
def test_plain_text_in_a_json_variable_is_one_line_naming_its_form(
    cls: type[BaseSettings], field: str, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = variable(cls, field)
    monkeypatch.setenv(name, text)
    with pytest.raises(ConfigurationError) as refused:
        load(cls, check=False)
    line = str(refused.value)
    assert line.startswith(f"{name}={text!r}: not JSON; it takes a JSON "), line
    assert "such as " in line and "\n" not in line and "Traceback" not in line


@pytest.mark.parametrize(
    ("name", "text", "written"),
    [
        ("WORKER_KAFKA_TOPIC_TYPES", "work=OrderPlaced", '{"work": "OrderPlaced"}'),
        ("WORKER_KAFKA_TOPIC_TYPES", "a:A, b=B", '{"a": "A", "b": "B"}'),
        ("WORKER_RABBITMQ_BINDING_KEYS", "#", '["#"]'),
        ("WORKER_RABBITMQ_BINDING_KEYS", "orders.*,billing.#", '["orders.*", "billing.#"]'),
        ("WORKER_RABBITMQ_RETRY_DELAYS", "1,5,30", "[1, 5, 30]"),
    ],
)
def test_the_line_writes_the_value_as_json_where_its_meaning_is_plain(
    name: str, text: str, written: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    [(cls, field)] = [(c, f) for c, f in json_typed() if variable(c, f) == name]
    monkeypatch.setenv(name, text)
    with pytest.raises(ConfigurationError) as refused:
        load(cls, check=False)
    assert str(refused.value).endswith(f"; write {name}='{written}'")
    monkeypatch.setenv(name, written)  # and what it says to write is taken
    assert getattr(load(cls, check=False), field)


def test_json_of_the_wrong_shape_names_the_form_too(monkeypatch: pytest.MonkeyPatch) -> None:
    [(cls, _)] = [(c, f) for c, f in json_typed() if variable(c, f) == "WORKER_KAFKA_TOPIC_TYPES"]
    monkeypatch.setenv("WORKER_KAFKA_TOPIC_TYPES", '["work"]')
    with pytest.raises(ConfigurationError, match=r"a JSON object, such as \{"):
        load(cls, check=False)


# -- row 11: durations ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("60", 60),
        ("1.5", 1.5),
        ("90s", 90),
        ("30m", 1800),
        ("12h", 43200),
        ("14d", 14 * 86400),
        ("14 D", 14 * 86400),
        ("PT30M", 1800),
        ("P14D", 14 * 86400),
        ("01:00:00", 3600),
    ],
)
def test_a_duration_takes_seconds_units_and_iso_8601(
    text: str, seconds: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKER_BROKER_LOCK_TIMEOUT", text)
    assert load(Settings, check=False).broker_lock_timeout == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    "name",
    [
        "WORKER_BROKER_LOCK_TIMEOUT",
        "WORKER_MESSAGE_TTL",
        "WORKER_DEAD_LETTER_MARGIN",
        "WORKER_INBOX_RETENTION",
        "WORKER_INBOX_PARTITION_PERIOD",
    ],
)
def test_a_duration_it_cannot_read_names_the_forms(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, "ten minutes")
    with pytest.raises(ConfigurationError) as refused:
        load(Settings, check=False)
    assert str(refused.value) == f"{name}='ten minutes': Value error, takes {DURATION_FORMS}"


def test_a_retention_in_seconds_is_read_and_then_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_INBOX_RETENTION", "60")
    with pytest.raises(ConfigurationError) as refused:
        load(Settings, check=False)
    assert "shorter than the redelivery window" in str(refused.value)
    assert "day identifier" not in str(refused.value)
    monkeypatch.setenv("WORKER_INBOX_RETENTION", str(30 * 86400))
    assert load(Settings, check=False).inbox_retention == timedelta(days=30)


# -- row 8: WORKER_MESSAGE_ID_FUNC -----------------------------------------------------------


@pytest.mark.parametrize("text", ["json", "json:", ":loads", "my-app:ids", "a:b:c", "a.:f"])
def test_a_message_id_func_without_module_and_function_says_so(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKER_MESSAGE_ID_FUNC", text)
    with pytest.raises(ConfigurationError) as refused:
        load(Settings, check=False)
    assert str(refused.value).startswith(f"WORKER_MESSAGE_ID_FUNC={text!r}: ")
    assert "'module:function'" in str(refused.value)


@pytest.mark.parametrize("text", ["json:loads", "myapp.ids:message_id", ""])
def test_a_message_id_func_in_that_form_is_taken(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKER_MESSAGE_ID_FUNC", text)
    assert load(Settings, check=False).message_id_func == (text or None)


# -- row 4: values no retry can fix ----------------------------------------------------------


def test_an_sqlite_file_in_a_folder_that_does_not_exist_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKER_DATABASE_URL", f"sqlite+aiosqlite:///{tmp_path / 'no' / 'w.db'}")
    with pytest.raises(ConfigurationError, match=r"folder .* does not exist"):
        load(Settings, check=False)
    for fine in (f"{tmp_path / 'w.db'}", "worker.db", ":memory:", ""):
        monkeypatch.setenv("WORKER_DATABASE_URL", f"sqlite+aiosqlite:///{fine}")
        load(Settings, check=False)


@pytest.mark.parametrize("servers", ["", " ", "kafka-1:9092,", ":9092", "kafka-1:port"])
def test_a_kafka_server_list_that_names_no_server_is_refused(
    servers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.brokers.kafka.settings import KafkaSettings

    monkeypatch.setenv("WORKER_KAFKA_BOOTSTRAP_SERVERS", servers)
    with pytest.raises(ConfigurationError, match=r"WORKER_KAFKA_BOOTSTRAP_SERVERS=.*host:port"):
        load(KafkaSettings, check=False)


@pytest.mark.parametrize("servers", ["kafka-1:9092", "kafka-1:9092, kafka-2", "[::1]:9092"])
def test_a_kafka_server_list_is_taken(servers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.brokers.kafka.settings import KafkaSettings

    monkeypatch.setenv("WORKER_KAFKA_BOOTSTRAP_SERVERS", servers)
    assert load(KafkaSettings, check=False).bootstrap_servers == servers.replace(" ", "")


@pytest.mark.parametrize(
    "connection", ["garbage", "Endpoint=nonsense;SharedAccessKeyName=a;SharedAccessKey=S3CRET"]
)
def test_a_malformed_service_bus_connection_string_is_refused_without_echoing_it(
    connection: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.brokers.servicebus.settings import load_settings

    monkeypatch.setenv("WORKER_SERVICEBUS_CONNECTION_STRING", connection)
    monkeypatch.setenv("WORKER_SERVICEBUS_QUEUE", "work")
    with pytest.raises(ConfigurationError) as refused:
        load_settings()
    line = str(refused.value)
    assert line.startswith("WORKER_SERVICEBUS_CONNECTION_STRING: ")
    assert "S3CRET" not in line and "nonsense" not in line and "garbage" not in line
