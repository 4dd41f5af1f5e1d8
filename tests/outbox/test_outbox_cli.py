"""``worker outbox`` and ``worker relay --once`` against a database that cannot serve them:
one line naming it and the reason, exit 1, no traceback."""

from __future__ import annotations

import pytest

from tests.support.processes import clean_env, free_port, run_cli


@pytest.mark.parametrize(
    "command", [("outbox",), ("outbox", "--retry"), ("relay", "--once")], ids=" ".join
)
def test_a_database_that_is_down_is_one_line_and_exit_1(command: tuple[str, ...]) -> None:
    where = f"postgresql+asyncpg://relay@127.0.0.1:{free_port()}/outbox"
    env = {
        **clean_env(),
        "WORKER_DATABASE_URL": where,
        "WORKER_BROKER": "rabbitmq",  # the relay reaches the database before the broker
        "WORKER_LOG_LEVEL": "ERROR",
    }
    result = run_cli(env, *command)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"worker: database unavailable: {where}: ")
    assert "Connect call failed" in lines[0] or "refused" in lines[0].lower()
    assert result.stdout == ""
