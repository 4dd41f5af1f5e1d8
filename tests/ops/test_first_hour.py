"""The first hour without a traceback: what a newcomer gives the documented commands and
variables, answered in one line with the exit code README names (issue 32's table).

Real ``worker`` processes: a handler module that does not compile or raises at import, an
empty WORKER_HANDLERS, a database never migrated, a refused login on either side, the
version, the help of every command.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import POSTGRES_ADMIN_URL, _admin
from tests.support.processes import json_env, json_lines, run_cli
from tests.support.services import require_service

SECRET = f"S3cr3t-{uuid.uuid4().hex[:8]}"

# -- rows 1-2: a handler module that cannot be imported ---------------------------------------

BROKEN = {
    "syntax.py": "from worker import handler\n\ndef broken(:\n    pass\n",
    "raises.py": "import json\n\nSETTINGS = json.loads('{not json')\n",
    "halfway.py": (
        "from pydantic import BaseModel\n"
        "from worker import handler\n\n\n"
        "class Ping(BaseModel):\n    n: int\n\n\n"
        "@handler('Ping', Ping, consumer='halfway')\n"
        "async def ping(ctx, message):\n    pass\n\n\n"
        "raise RuntimeError('the mail server is not configured')\n"
    ),
}
# (module, the complaint, the line of the module that failed)
FAILURES = [
    ("syntax", "SyntaxError: invalid syntax", 3),
    ("raises", "JSONDecodeError: Expecting property name", 3),
    ("halfway", "RuntimeError: the mail server is not configured", 14),
]


@pytest.fixture
def broken_package(tmp_path: Path) -> Path:
    package = tmp_path / "project" / "shop"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, source in BROKEN.items():
        (package / name).write_text(source)
    (tmp_path / "samples.jsonl").write_text('{"type": "Ping", "body": {"n": 1}}\n')
    return tmp_path


@pytest.mark.parametrize(("module", "complaint", "line"), FAILURES, ids=[f[0] for f in FAILURES])
@pytest.mark.parametrize("command", ["run", "migrate", "migrate --check", "check"])
def test_a_handler_module_that_fails_to_import_is_one_line(
    broken_package: Path, module: str, complaint: str, line: int, command: str
) -> None:
    project = broken_package / "project"
    env = json_env(
        {
            "WORKER_HANDLERS": f"shop.{module}",
            "WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{broken_package / 'w.db'}",
            "WORKER_CONCURENCY": "4",  # a typo: the unknown-variable check imports them too
            "PYTHONPATH": os.pathsep.join([str(project), os.environ.get("PYTHONPATH", "")]),
        }
    )
    args = command.split() + ([str(broken_package / "samples.jsonl")] if command == "check" else [])
    result = run_cli(env, *args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [said] = [x for x in result.stderr.splitlines() if x.startswith("worker: ")]
    assert said.startswith(
        f"worker: configuration error: WORKER_HANDLERS: cannot import 'shop.{module}'"
    )
    assert complaint in said
    assert f"({project / 'shop' / (module + '.py')}, line {line})" in said
    assert "registered twice" not in said


def one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The exit code, and the one ``worker:`` line the command ended with (no traceback)."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    said = [x for x in result.stderr.splitlines() if x.startswith("worker: ")]
    assert len(said) == 1, result.stderr
    return said[0]


def sqlite_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    return json_env(
        {"WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'w.db'}", **variables}
    )


# -- row 3: JSON-typed settings given as plain text ------------------------------------------


@pytest.mark.parametrize(
    ("variables", "line"),
    [
        (
            {"WORKER_BROKER": "kafka", "WORKER_KAFKA_TOPIC_TYPES": "work=OrderPlaced"},
            "WORKER_KAFKA_TOPIC_TYPES='work=OrderPlaced': not JSON; it takes a JSON object",
        ),
        (
            {"WORKER_BROKER": "rabbitmq", "WORKER_RABBITMQ_BINDING_KEYS": "#"},
            "WORKER_RABBITMQ_BINDING_KEYS='#': not JSON; it takes a JSON list of strings",
        ),
    ],
    ids=["kafka topic types", "rabbitmq binding keys"],
)
def test_a_json_setting_given_as_plain_text_is_one_line(
    variables: dict[str, str], line: str, tmp_path: Path
) -> None:
    env = sqlite_env(tmp_path, WORKER_ALLOW_SQLITE_WITH_NETWORK_BROKER="true", **variables)
    said = one_line(run_cli(env, "run"), 2)
    assert said.startswith(f"worker: configuration error: {line}")


# -- row 4: what no retry can fix is refused at once, not retried as an outage --------------

SERVICE_BUS = {"WORKER_BROKER": "servicebus", "WORKER_SERVICEBUS_QUEUE": "work"}
NO_RETRY = [
    ("run", {"WORKER_BROKER": "kafka", "WORKER_KAFKA_BOOTSTRAP_SERVERS": ""}),
    (
        "run",
        {**SERVICE_BUS, "WORKER_SERVICEBUS_CONNECTION_STRING": "Endpoint=x;SharedAccessKey=S3CRET"},
    ),
    ("run", {"WORKER_DATABASE_URL": "sqlite+aiosqlite:///no/such/folder/w.db"}),
    ("migrate", {"WORKER_DATABASE_URL": "sqlite+aiosqlite:///no/such/folder/w.db"}),
]


@pytest.mark.parametrize(
    ("command", "variables"),
    NO_RETRY,
    ids=["empty kafka servers", "malformed service bus string", "sqlite folder", "migrate"],
)
def test_configuration_no_retry_fixes_is_refused_at_once(
    command: str, variables: dict[str, str], tmp_path: Path
) -> None:
    """They were retried as outages for WORKER_START_TIMEOUT (300 s), then exit 1."""
    env = sqlite_env(tmp_path, WORKER_ALLOW_SQLITE_WITH_NETWORK_BROKER="true")
    env.update(WORKER_START_TIMEOUT="300", **variables)
    started = time.monotonic()
    said = one_line(run_cli(env, command, timeout=60), 2)
    assert time.monotonic() - started < 30
    culprit = list(variables)[-1]  # the variable that cannot work
    assert said.startswith(f"worker: configuration error: {culprit}")
    assert "S3CRET" not in said


# -- row 5: `worker run` on a database never migrated ----------------------------------------


@pytest.fixture
def fresh_postgres() -> Iterator[str]:
    """A PostgreSQL database of this test's own, empty, dropped afterwards."""
    require_service("127.0.0.1", 5432, "PostgreSQL")
    name = f"worker_first_hour_{uuid.uuid4().hex[:8]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_run_on_a_database_never_migrated_refuses_naming_what_is_behind(
    database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """It consumed, nacked every message as schema-behind, and the outbox relay logged its
    failing SQL once a second; nothing said to run `worker migrate`."""
    url = (
        f"sqlite+aiosqlite:///{tmp_path / 'w.db'}"
        if database == "sqlite"
        else request.getfixturevalue("fresh_postgres")
    )
    started = time.monotonic()
    result = run_cli(json_env({"WORKER_DATABASE_URL": url, "WORKER_START_TIMEOUT": "300"}), "run")
    said = one_line(result, 1)
    assert time.monotonic() - started < 30
    assert said.startswith("worker: database not migrated: ")
    assert "worker: database at none, code at " in said
    assert said.endswith("(run: worker migrate)")
    assert "pump started" not in result.stderr and "outbox" not in result.stderr


def test_run_names_the_one_history_that_is_behind(tmp_path: Path) -> None:
    env = sqlite_env(tmp_path)
    assert run_cli(env, "migrate", "--worker-only").returncode == 0
    said = one_line(run_cli(env, "run"), 1)
    assert "handlers: database at none" in said and "tables missing: accounts" in said
    assert "worker: database at" not in said  # the worker's own history is at its head
    assert run_cli(env, "migrate").returncode == 0
    assert run_cli(env, "migrate", "--check").returncode == 0


# -- row 6: WORKER_HANDLERS that registers nothing -----------------------------------------


@pytest.mark.parametrize(("handlers", "named"), [("", " is empty"), ("json", "='json'")])
def test_run_refuses_when_nothing_could_ever_be_consumed(
    handlers: str, named: str, tmp_path: Path
) -> None:
    """It started and logged `pump started types=[]`."""
    said = one_line(run_cli(sqlite_env(tmp_path, WORKER_HANDLERS=handlers), "run"), 2)
    assert said.startswith(f"worker: configuration error: WORKER_HANDLERS{named}: no handler")


# -- row 7: the same kind of error, the same exit code, database or broker -----------------


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.parametrize("side", ["database", "broker"])
def test_a_refused_login_is_configuration_on_either_side(
    side: str, tmp_path: Path, amqp_url: str
) -> None:
    """PostgreSQL's exited 1, RabbitMQ's 2: both are credentials no retry fixes."""
    require_service("127.0.0.1", 5432, "PostgreSQL")
    env = sqlite_env(
        tmp_path,
        WORKER_BROKER="rabbitmq",
        WORKER_ALLOW_SQLITE_WITH_NETWORK_BROKER="true",
        WORKER_RABBITMQ_URL=amqp_url,
        WORKER_RABBITMQ_QUEUE=f"first-hour-{uuid.uuid4().hex[:8]}",
        WORKER_START_TIMEOUT="300",
    )
    assert run_cli(env, "migrate").returncode == 0
    if side == "database":
        role = f"nobody_{uuid.uuid4().hex[:6]}"
        env["WORKER_DATABASE_URL"] = f"postgresql+asyncpg://{role}:{SECRET}@127.0.0.1:5432/postgres"
    else:
        env["WORKER_RABBITMQ_URL"] = amqp_url.replace("guest:guest@", f"guest:{SECRET}@")
    said = one_line(run_cli(env, "run"), 2)
    variable = "WORKER_DATABASE_URL" if side == "database" else "WORKER_RABBITMQ_URL"
    assert said.startswith(f"worker: configuration error: {variable}=")
    assert "login refused" in said and SECRET not in said


# -- row 10: the inbox's layout against WORKER_INBOX_LAYOUT --------------------------------


@pytest.mark.postgres
def test_migrate_check_and_run_say_the_inbox_layout_differs(fresh_postgres: str) -> None:
    """`migrate --check` said "schema at head", exit 0, on a plain inbox."""
    env = json_env({"WORKER_DATABASE_URL": fresh_postgres})
    assert run_cli(env, "migrate").returncode == 0
    assert run_cli(env, "migrate", "--check").returncode == 0
    partitioned = {**env, "WORKER_INBOX_LAYOUT": "partitioned"}
    check = run_cli(partitioned, "migrate", "--check")
    assert check.returncode == 1, check.stderr
    [gate] = [x for x in json_lines(check.stderr) if x["event"] == "schema not at head"]
    assert "inbox layout differs: a plain table, WORKER_INBOX_LAYOUT=partitioned" in gate["status"]
    said = one_line(run_cli(partitioned, "run"), 1)
    assert "inbox layout differs" in said and said.endswith("(run: worker migrate)")
    assert run_cli(partitioned, "migrate").returncode == 0  # converts it
    assert run_cli(partitioned, "migrate", "--check").returncode == 0


# -- every command's --help says what it does and which settings it reads ------------------

COMMANDS = [
    "run",
    "migrate",
    "revision",
    "demo",
    "publish",
    "dlq",
    "sweep",
    "purge-inbox",
    "relay",
    "outbox",
    "check",
]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_says_what_it_does_and_points_at_its_settings(command: str) -> None:
    """Only `dlq --help` had a description; `run --help` named no variable."""
    result = run_cli({**json_env(), "COLUMNS": "100"}, command, "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    description = text.split("\n\n")[1]  # after the usage, before the options
    assert not description.startswith(("options:", "positional")), text
    assert len(description.split()) >= 10, description
    settings = text[text.index("settings: ") :]
    assert "WORKER_" in settings or command == "demo", settings
    assert "README.md, Configuration" in settings


def test_the_demo_piped_into_head_ends_without_a_traceback(tmp_path: Path) -> None:
    """`worker demo | head -3`: the reader leaves after three lines; the demo ended with a
    BrokenPipeError traceback on its next print."""
    from tests.support.processes import REPO, worker_cli

    env = {**json_env(), "WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'demo.db'}"}
    demo = subprocess.Popen(
        worker_cli("demo", "--messages", "40"),
        env=env,
        cwd=REPO,  # the demo runs the repository's example application
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert demo.stdout is not None and demo.stderr is not None
    try:
        first = demo.stdout.readline()
        demo.stdout.close()  # what head does after its lines
        _, errors = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert first, errors
    assert "Traceback" not in errors, errors
    assert demo.returncode == 1, errors


# -- migrate --check compares revisions; revision --dry-run compares the models ------------

ORDERS = """\
from decimal import Decimal

from pydantic import BaseModel
from sqlalchemy import Integer, Numeric, String
from sqlalchemy.orm import Mapped, mapped_column

from worker import Base, Context, handler


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    total: Mapped[Decimal] = mapped_column(Numeric(18, 2))
    version: Mapped[int] = mapped_column(Integer, nullable=False)
    __mapper_args__ = {"version_id_col": version}


class OrderPlaced(BaseModel):
    order_id: str


@handler("OrderPlaced", OrderPlaced, consumer="orders")
async def place_order(ctx: Context, message: OrderPlaced) -> None:
    pass
"""


def test_a_column_without_a_revision_is_found_by_the_dry_run(tmp_path: Path) -> None:
    """`migrate --check` said "schema at head" after a model gained a column: it compares
    revisions and tables, and now says so, and names the command that compares columns."""
    shop = tmp_path / "shop"
    shop.mkdir()
    (shop / "__init__.py").write_text("")
    (shop / "orders.py").write_text(ORDERS)
    env = json_env(
        {
            "WORKER_HANDLERS": "shop.orders",
            "WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'app.db'}",
        }
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(env, *args, cwd=tmp_path)

    assert cli("migrate").returncode == 0
    first = cli("revision", "--dry-run")
    assert first.returncode == 1 and "op.create_table('orders'" in first.stdout, first.stderr
    assert not (shop / "migrations").exists()  # a dry run writes nothing, not even a folder
    assert cli("revision", "-m", "orders", "--autogenerate").returncode == 0
    assert cli("migrate").returncode == 0
    agree = cli("revision", "--dry-run")
    assert agree.returncode == 0 and "no revision needed" in agree.stdout, agree.stderr

    (shop / "orders.py").write_text(
        ORDERS.replace(
            "    version: Mapped[int]",
            "    note: Mapped[str | None] = mapped_column(String(200))\n    version: Mapped[int]",
        )
    )
    gate = cli("migrate", "--check")
    assert gate.returncode == 0, gate.stderr
    [usable] = [x for x in json_lines(gate.stderr) if x["event"] == "schema usable"]
    assert "not their columns" in usable["compares"]
    assert "worker revision --dry-run" in usable["compares"]
    behind = cli("revision", "--dry-run")
    assert behind.returncode == 1, behind.stderr
    assert "op.add_column('orders', sa.Column('note', sa.String(length=200)" in behind.stdout
    assert len(list((shop / "migrations" / "versions").glob("*.py"))) == 1  # nothing written
