"""No part of a database password reaches a log line or an error, whatever characters it holds.

A raw ``@`` inside the password made SQLAlchemy split the URL at the first one: the mask
covered only the part before it, the tail was printed in every start-up retry line and in
the final error, and the URL was retried for the whole start timeout as an outage. Masking
now takes everything up to the last ``@`` (whatever a parser makes of the URL), and such a
URL is refused as configuration before anything connects.
"""

from __future__ import annotations

import time
from urllib.parse import quote

import pytest

from tests.support.processes import free_port, json_env, run_cli
from worker.db import redact
from worker.errors import ConfigurationError
from worker.logs import scrub
from worker.settings import Settings, load

# Each password is made of pieces no log line holds by chance, glued by the characters that
# URL parsers split on. A test fails if any piece shows.
PIECES = ("QXZ7", "JWK8", "VBN9")
SEPARATORS = ["@", ":", "/", "#", "?", "@@", "%", "&", "=", ";", "'", '"', "\\", "é"]


def passwords() -> list[str]:
    return [f"{PIECES[0]}{sep}{PIECES[1]}{sep}{PIECES[2]}" for sep in SEPARATORS]


def leaked(text: str) -> list[str]:
    return [piece for piece in PIECES if piece in text]


@pytest.mark.parametrize("password", passwords())
@pytest.mark.parametrize("user", ["ledger", "ledger@server", ""])
def test_redact_and_scrub_hide_every_part_of_a_raw_password(user: str, password: str) -> None:
    url = f"postgresql+asyncpg://{user}:{password}@db.internal:5432/ledger?ssl=require"
    for shown in (redact(url), scrub(url), scrub(f"connect to {url} failed: refused")):
        assert not leaked(shown), shown
        assert shown.endswith(("db.internal:5432/ledger?ssl=require", "refused")), shown
    assert redact(url).startswith(f"postgresql+asyncpg://{user}:***@")


@pytest.mark.parametrize("password", passwords())
def test_a_percent_encoded_password_is_hidden_too(password: str) -> None:
    url = f"postgresql+asyncpg://ledger:{quote(password, safe='')}@db/ledger"
    assert redact(url) == "postgresql+asyncpg://ledger:***@db/ledger"
    assert scrub(f"url={url}") == "url=postgresql+asyncpg://ledger:***@db/ledger"


def test_other_schemes_and_urls_without_a_password_keep_their_text() -> None:
    assert redact("sqlite+aiosqlite:////data/w@rker.db") == "sqlite+aiosqlite:////data/w@rker.db"
    assert redact("postgresql+asyncpg://app@db/app") == "postgresql+asyncpg://app@db/app"
    assert scrub("amqp://guest:g@st@mq:5672/") == "amqp://guest:***@mq:5672/"
    assert scrub("mail bob@example.com about it") == "mail bob@example.com about it"


@pytest.mark.parametrize("password", [p for p in passwords() if "@" in p] + ["a b"])
def test_an_ambiguous_database_url_is_refused_as_configuration(
    password: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKER_DATABASE_URL", f"postgresql+asyncpg://ledger:{password}@db/ledger")
    with pytest.raises(ConfigurationError) as refused:
        load(Settings, check=False)
    line = str(refused.value)
    assert line.startswith("WORKER_DATABASE_URL: Value error, holds ")
    assert "%40" in line or "%20" in line
    assert not leaked(line) and "\n" not in line


def test_worker_run_refuses_a_raw_at_at_once_and_never_prints_the_tail() -> None:
    """It was retried for WORKER_START_TIMEOUT with the tail in every retry line."""
    url = f"postgresql+asyncpg://ledger:{PIECES[0]}@{PIECES[1]}@127.0.0.1:{free_port()}/ledger"
    started = time.monotonic()
    result = run_cli(json_env({"WORKER_DATABASE_URL": url, "WORKER_START_TIMEOUT": "300"}), "run")
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 30
    assert result.stderr.startswith("worker: configuration error: WORKER_DATABASE_URL")
    assert not leaked(result.stdout + result.stderr), result.stderr


def test_start_up_retry_lines_and_the_last_error_hide_an_encoded_password() -> None:
    """A usable URL whose server is away: every retry line and the final error masked."""
    password = quote(f"{PIECES[0]}@{PIECES[1]}/{PIECES[2]}", safe="")
    url = f"postgresql+asyncpg://ledger:{password}@127.0.0.1:{free_port()}/ledger"
    env = json_env({"WORKER_DATABASE_URL": url, "WORKER_START_TIMEOUT": "2"})
    result = run_cli(env, "run")
    assert result.returncode == 1, result.stderr
    assert "unavailable at start, retrying" in result.stderr
    assert "ledger:***@127.0.0.1" in result.stderr.splitlines()[-1]
    assert password not in result.stderr
    assert not leaked(result.stdout + result.stderr), result.stderr
