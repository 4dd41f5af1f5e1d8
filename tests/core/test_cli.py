"""The command line as a newcomer and an operator meet it: real subprocesses."""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import REPO, clean_env, console_script, json_env, run_cli
from worker.logs import scrub

# The example application on the path, as a project of one's own would be: the package does
# not install it (a top-level `handlers` would shadow a user's own).
EXAMPLE = {"PYTHONPATH": str(REPO)}
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


@pytest.mark.parametrize(
    ("variable", "value", "complaint"),
    [
        (
            "WORKER_CONCURRENCY",
            "lots",
            "WORKER_CONCURRENCY='lots': Input should be a valid integer",
        ),
        (
            "WORKER_CONCURRENCY",
            "0",
            "WORKER_CONCURRENCY='0': Input should be greater than or equal to 1",
        ),
        ("WORKER_BROKER", "kafkaesque", "WORKER_BROKER='kafkaesque': Input should be"),
        ("WORKER_MAX_DELIVERIES", "-1", "WORKER_MAX_DELIVERIES"),
        ("WORKER_DATABASE_URL", "mysql://u:hunter2@db/x", "WORKER_DATABASE_URL: Value error"),
        ("WORKER_HANDLERS", "no_such_module", "WORKER_HANDLERS: cannot import 'no_such_module'"),
    ],
)
def test_bad_configuration_stops_at_start_with_one_line(
    variable: str, value: str, complaint: str, tmp_path: Path
) -> None:
    result = run_cli({**clean_env(), variable: value}, "run", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("worker: configuration error: ")
    assert complaint in lines[0]
    assert "hunter2" not in result.stderr
    assert "Traceback" not in result.stderr


def test_migrate_creates_the_schema(tmp_path: Path) -> None:
    result = run_cli(json_env(EXAMPLE), "migrate", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    tables = {
        row[0]
        for row in sqlite3.connect(tmp_path / "worker.db").execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'"
        )
    }
    # the worker's tables and the example application's (WORKER_HANDLERS=handlers), each
    # history with its own version table
    assert {"inbox", "worker_alembic_version", "accounts", "handlers_alembic_version"} <= tables
    assert '"event": "migrated"' in result.stderr


@pytest.mark.parametrize("flags", [(), ("--check",), ("--wait", "--timeout", "30")])
def test_migrate_refuses_handlers_it_cannot_import(flags: tuple[str, ...], tmp_path: Path) -> None:
    """As ``worker run`` does: a migration must not report success for code that cannot
    start (it used to exit 0 with no word), nor a gate open for it."""
    env = {**clean_env(), "WORKER_HANDLERS": "no_such_module"}
    result = run_cli(env, "migrate", *flags, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("worker: configuration error: WORKER_HANDLERS: cannot import ")
    assert "'no_such_module'" in line
    assert not (tmp_path / "worker.db").exists()  # refused before touching the database


SHOP = """\
from pydantic import BaseModel

from worker import Context, handler


class Ping(BaseModel):
    n: int


@handler("Ping", Ping, consumer="shop-ping")
async def ping(ctx: Context, message: Ping) -> None:
    return None
"""


@pytest.mark.parametrize("form", ["console script", "python -m worker"])
def test_both_forms_import_handlers_from_the_project_folder(form: str, tmp_path: Path) -> None:
    """``worker run`` (the console script pip installs) and ``python -m worker run`` find
    ``WORKER_HANDLERS=shop.orders`` in the folder they are started in, as ``python -m`` does;
    the console script used to fail with "No module named 'shop'"."""
    root = tmp_path / "myproject"
    (root / "shop").mkdir(parents=True)
    (root / "shop" / "__init__.py").write_text("")
    (root / "shop" / "orders.py").write_text(SHOP)
    launcher = (
        console_script(tmp_path) if form == "console script" else [sys.executable, "-m", "worker"]
    )
    env = json_env(
        {
            "PYTHONPATH": str(REPO),  # where an installed worker would be; not the project
            "WORKER_HANDLERS": "shop.orders",
            "WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{root / 'worker.db'}",
        }
    )
    migrated = run_cli(env, "migrate", cwd=root, launcher=launcher)
    assert migrated.returncode == 0, migrated.stderr
    log = tmp_path / "run.log"
    with log.open("w") as output:
        worker = subprocess.Popen(
            [*launcher, "run"], env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=output
        )
    try:
        deadline = time.monotonic() + 60  # a loaded machine imports slowly
        while '"pump started"' not in log.read_text():
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.1)
        assert '"Ping"' in log.read_text()  # the started pump serves shop's handler
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0, log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait(10)


def test_demo_shows_the_naive_handler_wrong_and_the_worker_exact(tmp_path: Path) -> None:
    result = run_cli({**clean_env(), **EXAMPLE}, "demo", "--messages", "200", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    table = dict(
        (line[:30].strip(), line[30:].split())
        for line in result.stdout.splitlines()
        if line[30:].strip()
    )
    naive_total, worker_total = table["actual total"]
    expected, _ = table["expected total"]
    assert worker_total == expected != naive_total
    assert table["accounts exact (of 5)"][1] == "5"
    assert int(table["credits applied (commits)"][0]) > 200  # the naive one double-credited
    assert table["credits applied (commits)"][1] == "200"
    assert "every balance exact" in result.stdout


def test_database_password_never_reaches_the_log(tmp_path: Path) -> None:
    url = "postgresql+asyncpg://app:hunter2@127.0.0.1:1/app"  # nothing listens on port 1
    env = json_env({"WORKER_DATABASE_URL": url, "WORKER_START_TIMEOUT": "0", **EXAMPLE})
    result = run_cli(env, "run", cwd=tmp_path)
    assert result.returncode == 1
    assert "database unavailable at start, giving up" in result.stderr
    assert "app:***@127.0.0.1:1/app" in result.stderr
    assert "hunter2" not in result.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql+asyncpg://u:s3cret@h/db", "postgresql+asyncpg://u:***@h/db"),
        ("amqps://guest:gu%40st@rabbit:5671/vh", "amqps://guest:***@rabbit:5671/vh"),
        (
            "Endpoint=sb://x/;SharedAccessKeyName=k;SharedAccessKey=abc=",
            "Endpoint=sb://x/;SharedAccessKeyName=k;SharedAccessKey=***",
        ),
        ("host=db password=pw user=u", "host=db password=*** user=u"),
        ("no secrets here", "no secrets here"),
    ],
)
def test_scrub_masks_secrets(text: str, expected: str) -> None:
    assert scrub(text) == expected


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_a_secret_in_an_exception_is_scrubbed_in_every_format(fmt: str) -> None:
    import io
    import logging

    import structlog

    from worker import logs

    buffer = io.StringIO()
    real_stderr = sys.stderr
    sys.stderr = buffer
    try:
        logs.configure("INFO", fmt)
        try:
            raise RuntimeError("refused: postgresql://app:hunter2@db.internal/prod")
        except RuntimeError as exc:
            logs.get_logger().warning("handler failed", exc_info=exc)
            logging.getLogger("aiormq").exception("library says amqp://u:hunter2@h/")
    finally:
        sys.stderr = real_stderr
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    text = buffer.getvalue()
    assert "RuntimeError" in text and "app:***@db.internal" in text
    assert "hunter2" not in text


def test_the_wheel_installs_no_top_level_handlers_package(tmp_path: Path) -> None:
    """It installed the example as `handlers` beside `worker`: a user's own `handlers`
    package was shadowed. Built from what the image's build context holds (a clean copy,
    handlers/ included), the wheel holds `worker` alone, and the LICENSE its metadata names.
    """
    import zipfile

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    for folder in ("worker", "handlers"):
        shutil.copytree(REPO / folder, source / folder, ignore=IGNORED)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    [wheel] = tmp_path.glob("idempotent_worker-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"worker"}, tops
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names
    assert "Apache License" in (REPO / "LICENSE").read_text()


def test_the_demo_outside_a_checkout_says_where_it_runs(tmp_path: Path) -> None:
    result = run_cli(clean_env(), "demo", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("worker: configuration error: worker demo runs the example")
    assert "Traceback" not in result.stderr
