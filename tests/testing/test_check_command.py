"""``worker check SAMPLES``: the report on stdout, exit 0 when idempotent, 1 with the first
difference and its cause, 2 with one line naming what is wrong with the input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.processes import REPO, free_port, json_env, run_cli
from worker.testing import SCENARIOS

CREDIT_SAMPLES = Path(__file__).with_name("credit_samples.jsonl")


def check(
    tmp_path: Path, *args: str, handlers: str = "handlers.credit", stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = json_env(
        {
            "WORKER_HANDLERS": handlers,
            "WORKER_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/never.db",
        }
    )
    return run_cli(env, "check", *args, stdin=stdin, timeout=240)


def test_the_credit_handler_passes_from_the_command_line(tmp_path: Path) -> None:
    done = check(tmp_path, str(CREDIT_SAMPLES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 sample messages on SQLite" in done.stdout
    assert done.stdout.count("  ok  ") == len(SCENARIOS) + 1  # applying once, then each
    assert "idempotent: every scenario" in done.stdout
    assert not (tmp_path / "never.db").exists()  # WORKER_DATABASE_URL is never touched


def test_a_mistake_is_reported_with_its_diff_and_cause(tmp_path: Path) -> None:
    samples = '{"type": "SetNickname", "body": {"user_id": "u-1", "name": "Ada"}}\n'
    done = check(tmp_path, "-", handlers="tests.testing.cli_handlers", stdin=samples)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL  each message twice, one after the other" in done.stdout
    assert "outbox:" in done.stdout and "(extra)" in done.stdout
    assert "NOT idempotent: an id was made anew on each attempt" in done.stdout


def test_starting_rows_and_a_chosen_scenario(tmp_path: Path) -> None:
    samples = tmp_path / "pricing.jsonl"
    samples.write_text(
        '{"table": "products", "row": {"id": "p-1", "name": "W", "price": "9.99", "version": 1}}\n'
        '{"type": "ChangeProductPrice", "body": {"product_id": "p-1", "price": "12.50", '
        '"expected_version": 1}}\n'
    )
    done = check(
        tmp_path,
        str(samples),
        "--scenario",
        "twice",
        "--table",
        "products",
        handlers="handlers.pricing",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "each message twice" in done.stdout and "crash" not in done.stdout


def test_a_bad_samples_line_is_named_in_one_line(tmp_path: Path) -> None:
    samples = '{"type": "CreditRequested", "body": {}}\n{"type": "CreditRequested"}\n'
    done = check(tmp_path, "-", stdin=samples)
    assert done.returncode == 2
    assert done.stderr.strip() == "worker: configuration error: samples line 2: missing 'body'"
    assert done.stdout == ""


def test_bad_options_are_named_in_one_line(tmp_path: Path) -> None:
    missing = check(tmp_path, str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2
    assert missing.stderr.strip().endswith("No such file or directory")
    assert "nope.jsonl" in missing.stderr
    scenario = check(tmp_path, str(CREDIT_SAMPLES), "--scenario", "sideways")
    assert scenario.returncode == 2
    assert (
        "unknown scenarios ['sideways']" in scenario.stderr
        and len(scenario.stderr.splitlines()) == 1
    )
    database = check(tmp_path, str(CREDIT_SAMPLES), "--database", "mysql://x@y/z")
    assert database.returncode == 2 and "postgresql+asyncpg://" in database.stderr


def test_an_unreachable_database_server_is_one_line(tmp_path: Path) -> None:
    url = f"postgresql+asyncpg://kit:secret@127.0.0.1:{free_port()}/postgres"
    done = check(tmp_path, str(CREDIT_SAMPLES), "--database", url)
    assert done.returncode == 1, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(
        "worker check: database unavailable: postgresql+asyncpg://kit:***@127.0.0.1:"
    )
    assert "secret" not in done.stderr


def test_the_command_needs_no_test_dependency() -> None:
    probe = (
        "import sys, worker.testing.command; "
        "print(sorted({'pytest', 'aiohttp'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "[]"
