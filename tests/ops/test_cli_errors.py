"""Every command turns a database or broker it cannot use into one line.

Real processes against the real local services: nothing listening, a refused
login, no such database, a schema never migrated. The line names what failed,
and no password appears anywhere in the output. The exit code says which kind it
is, the same for the database and the brokers: 1 for what may pass (nothing
listening, a schema not migrated yet), 2 for configuration no retry fixes (a refused
login, a database or virtual host that does not exist).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import POSTGRES_ADMIN_URL, _admin
from tests.servicebus.fake import FakeServiceBus
from tests.servicebus.sb_settings import SECRET as SB_SECRET
from tests.servicebus.sb_settings import sb_settings
from tests.support.processes import clean_env, free_port, run_cli
from tests.support.rabbitmq import guest_url
from tests.support.services import require_service
from worker import cli, logs
from worker.brokers.servicebus import ServiceBusAdmin

SECRET = f"S3cr3t-{uuid.uuid4().hex[:8]}"
PG_HOST = "127.0.0.1:5432"
DATABASE_COMMANDS = [("migrate",), ("sweep",), ("purge-inbox",)]
BROKER_COMMANDS = [("dlq",), ("dlq", "--resubmit"), ("publish", "-")]


def one_line(result: object, *expected: str, code: int = 1) -> str:
    """Exit ``code``, one line on stderr (stdout empty) that contains every ``expected``."""
    exit_code, out, err = (getattr(result, name) for name in ("returncode", "stdout", "stderr"))
    assert exit_code == code, (out, err)
    assert out == "", out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert SECRET not in err and SB_SECRET not in err
    for text in expected:
        assert text in lines[0], lines[0]
    return str(lines[0])


def database_env(url: str, tmp_path: Path) -> dict[str, str]:
    return {**clean_env(), "WORKER_DATABASE_URL": url, "WORKER_LOG_FORMAT": "json"}


@pytest.fixture
def empty_postgres() -> Iterator[str]:
    """A PostgreSQL database that exists but was never migrated."""
    require_service("127.0.0.1", 5432, "PostgreSQL")
    name = f"worker_unmigrated_{uuid.uuid4().hex[:8]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.parametrize("command", DATABASE_COMMANDS)
def test_database_down(command: tuple[str, ...], tmp_path: Path) -> None:
    url = f"postgresql+asyncpg://ledger:{SECRET}@127.0.0.1:{free_port()}/ledger"
    result = run_cli(database_env(url, tmp_path), *command)
    line = one_line(result, "worker: database unavailable: ", "ledger:***@127.0.0.1")
    assert "Connect call failed" in line or "refused" in line.lower()


@pytest.mark.postgres
@pytest.mark.parametrize("command", DATABASE_COMMANDS)
def test_database_refuses_the_login(command: tuple[str, ...], tmp_path: Path) -> None:
    require_service("127.0.0.1", 5432, "PostgreSQL")
    role = f"nobody_{uuid.uuid4().hex[:6]}"  # trust auth here: a wrong role is the refusal
    url = f"postgresql+asyncpg://{role}:{SECRET}@{PG_HOST}/postgres"
    result = run_cli(database_env(url, tmp_path), *command)
    one_line(
        result,
        f"worker: configuration error: WORKER_DATABASE_URL=postgresql+asyncpg://{role}:***@",
        f'login refused (role "{role}" does not exist)',
        code=2,
    )


@pytest.mark.postgres
def test_no_such_database(tmp_path: Path) -> None:
    require_service("127.0.0.1", 5432, "PostgreSQL")
    url = f"postgresql+asyncpg://postgres:{SECRET}@{PG_HOST}/no_such_{uuid.uuid4().hex[:6]}"
    one_line(
        run_cli(database_env(url, tmp_path), "migrate"),
        "worker: configuration error: WORKER_DATABASE_URL=postgresql+asyncpg://postgres:***@",
        "no such database",
        code=2,
    )


@pytest.mark.postgres
@pytest.mark.parametrize("command", [("sweep",), ("sweep", "--abandoned"), ("purge-inbox",)])
def test_no_schema_on_postgresql(
    command: tuple[str, ...], empty_postgres: str, tmp_path: Path
) -> None:
    url = empty_postgres.replace("postgres@", f"postgres:{SECRET}@")
    result = run_cli(database_env(url, tmp_path), *command)
    one_line(result, "worker: database not migrated: ", '"inbox"', "(run: worker migrate)")


@pytest.mark.parametrize("command", [("sweep",), ("purge-inbox",)])
def test_no_schema_on_sqlite(command: tuple[str, ...], tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'never-migrated.db'}"
    result = run_cli(database_env(url, tmp_path), *command)
    one_line(result, "worker: database not migrated: ", "no such table: inbox")


def rabbit_env(url: str) -> dict[str, str]:
    return {**clean_env(), "WORKER_BROKER": "rabbitmq", "WORKER_RABBITMQ_URL": url}


PUBLISH_INPUT = json.dumps({"id": "m1", "type": "CreditRequested", "body": {}}) + "\n"


@pytest.mark.parametrize("command", BROKER_COMMANDS)
def test_rabbitmq_down(command: tuple[str, ...]) -> None:
    url = f"amqp://worker:{SECRET}@127.0.0.1:{free_port()}/"
    result = run_cli(rabbit_env(url), *command, stdin=PUBLISH_INPUT)
    one_line(result, "worker: broker unavailable: amqp://worker:***@127.0.0.1")


@pytest.mark.rabbitmq
@pytest.mark.parametrize("command", BROKER_COMMANDS)
def test_rabbitmq_refuses_the_login(command: tuple[str, ...], rabbitmq_vhost: str) -> None:
    url = guest_url(rabbitmq_vhost).replace("guest:guest@", f"guest:{SECRET}@")
    result = run_cli(rabbit_env(url), *command, stdin=PUBLISH_INPUT)
    # configuration no retry fixes: exit 2, as a bad setting
    one_line(
        result,
        "worker: configuration error: WORKER_RABBITMQ_URL=amqp://guest:***@",
        "login refused (ACCESS_REFUSED",
        code=2,
    )


@pytest.mark.parametrize("command", BROKER_COMMANDS)
def test_kafka_down(command: tuple[str, ...]) -> None:
    env = {
        **clean_env(),
        "WORKER_BROKER": "kafka",
        "WORKER_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
        "WORKER_KAFKA_TOPICS": "orders",
        "WORKER_KAFKA_GROUP_ID": "g",
        "WORKER_KAFKA_SASL_PASSWORD": SECRET,
    }
    result = run_cli(env, *command, stdin=PUBLISH_INPUT)
    one_line(result, "worker: broker unavailable: ")


@pytest.mark.parametrize("command", [["dlq"], ["dlq", "--resubmit"], ["publish", "-"]])
def test_servicebus_down(
    command: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bus = FakeServiceBus()
    bus.create_queue("work")
    for operation in ("open", "peek", "receive", "send"):
        bus.fail(operation, times=5)
    monkeypatch.setenv("WORKER_BROKER", "servicebus")
    monkeypatch.setattr(cli, "open_admin", lambda _s: ServiceBusAdmin(sb_settings(), bus.client))
    monkeypatch.setattr("sys.stdin", io.StringIO(PUBLISH_INPUT))
    # In process: keep this test's captured stderr out of the global log setup (later
    # tests' pumps would write to it once closed), and give the root level back.
    monkeypatch.setattr(logs, "configure", lambda *_args: None)
    root = logging.getLogger()
    level = root.level
    try:
        assert cli.main(command) == 1
    finally:
        root.setLevel(level)
    out, err = capsys.readouterr()
    one_line(
        type("R", (), {"returncode": 1, "stdout": out, "stderr": err})(),
        "worker: broker unavailable: service bus 'work'",
        "ServiceBusConnectionError",
    )


def test_a_missing_publish_file_is_one_line(tmp_path: Path) -> None:
    result = run_cli(clean_env(), "publish", str(tmp_path / "nope.jsonl"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "publish input" in result.stderr and "No such file" in result.stderr


def test_help_lists_every_command_in_plain_text() -> None:
    result = run_cli({**clean_env(), "COLUMNS": "80"}, "--help")
    assert result.returncode == 0
    assert "``" not in result.stdout
    described = {
        line.split()[0]: " ".join(line.split()[1:])
        for line in result.stdout.split("commands:")[1].splitlines()
        if line.startswith("    ") and not line.startswith("     ")
    }
    for command in ("run", "migrate", "demo", "publish", "dlq", "sweep", "purge-inbox"):
        assert described.get(command), f"{command}: no one-line description in --help"
    dlq = run_cli(clean_env(), "dlq", "--help")
    for option in ("--group-by", "--type", "--reason", "--since", "--id", "--dry-run", "--json"):
        assert option in dlq.stdout


# -- settings and arguments that cannot work: one line, exit 2, no traceback ---------------


@pytest.mark.parametrize(
    "command", [("migrate",), ("migrate", "--check"), ("run",), ("sweep",), ("outbox",)]
)
def test_a_database_port_that_is_not_a_number_is_one_line(command: tuple[str, ...]) -> None:
    """It was a traceback from SQLAlchemy's URL parser, at connect time."""
    for port in ("5432x", "99999"):
        url = f"postgresql+asyncpg://ledger:{SECRET}@127.0.0.1:{port}/ledger"
        result = run_cli(database_env(url, Path(".")), *command)
        one_line(result, "worker: configuration error: WORKER_DATABASE_URL", "port", code=2)


@pytest.mark.parametrize("command", BROKER_COMMANDS)
def test_a_broker_port_that_is_not_a_number_is_one_line(command: tuple[str, ...]) -> None:
    result = run_cli(
        rabbit_env(f"amqp://worker:{SECRET}@127.0.0.1:56x72/"), *command, stdin=PUBLISH_INPUT
    )
    one_line(result, "worker: configuration error: WORKER_RABBITMQ_URL", "port", code=2)


@pytest.mark.postgres
def test_migrate_check_calls_a_refused_login_refused_in_one_line(tmp_path: Path) -> None:
    """It logged "database unavailable" with SQLAlchemy's background link after a \\n."""
    require_service("127.0.0.1", 5432, "PostgreSQL")
    role = f"nobody_{uuid.uuid4().hex[:6]}"
    url = f"postgresql+asyncpg://{role}:{SECRET}@{PG_HOST}/postgres"
    result = run_cli(database_env(url, tmp_path), "migrate", "--check")
    line = one_line(
        result, "worker: configuration error: ", f'role "{role}" does not exist', code=2
    )
    assert "unavailable" not in line and "sqlalche.me" not in line and "\\n" not in line


@pytest.mark.parametrize(
    ("command", "complaint"),
    [
        (("sweep", "--limit", "-5"), "must be at least 1"),
        (("sweep", "--redrive", "--limit", "0"), "must be at least 1"),
        (("outbox", "--limit", "-1"), "must be at least 1"),
        (("dlq", "--limit", "ten"), "not a whole number"),
        (("migrate", "--lock-timeout", "0"), "must be more than 0 seconds"),  # 0 turned it off
        (("migrate", "--lock-timeout", "-2"), "must be more than 0 seconds"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, tuple) else "",
)
def test_an_argument_that_makes_no_sense_is_refused_before_anything_runs(
    command: tuple[str, ...], complaint: str, tmp_path: Path
) -> None:
    """``sweep --limit -5`` was reported as a database error; ``migrate --lock-timeout 0``
    turned the lock timeout off. The parser refuses both, naming the argument."""
    database = tmp_path / "untouched.db"
    result = run_cli(database_env(f"sqlite+aiosqlite:///{database}", tmp_path), *command)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    option = next(arg for arg in reversed(command) if arg.startswith("--"))
    assert f"argument {option}" in result.stderr and complaint in result.stderr
    assert not database.exists()  # nothing ran
