"""The pytest plugin: declared under the ``pytest11`` entry point, and its fixtures working in
a project of a user's own (a pytest run in a directory with nothing of this repository's)."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

from tests.support.processes import REPO, clean_env
from tests.support.services import unavailable

IGNORED = shutil.ignore_patterns("__pycache__")

USER_TEST = """
import pytest

import handlers.credit  # registers the handler
from worker.testing import Sample, prove_idempotent


@pytest.mark.asyncio
async def test_deliver(worker_harness):
    async with worker_harness() as worker:
        done = await worker.deliver("CreditRequested", {"account_id": "a", "amount": "1.00"})
        assert done.acked
        assert [row["id"] for row in await worker.rows("accounts")] == ["a"]


@pytest.mark.asyncio
async def test_prove(worker_database):
    sample = Sample("CreditRequested", {"account_id": "a", "amount": "1.00"})
    await prove_idempotent([sample], database=worker_database, scenarios=["twice"])
"""


def user_project(tmp_path: Path, *args: str, autoload: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_user.py").write_text(USER_TEST)
    # the user's own handlers: a copy of the example (the package does not install it)
    shutil.copytree(REPO / "handlers", tmp_path / "handlers", ignore=IGNORED)
    env = clean_env()
    env.pop("PYTEST_ADDOPTS", None)
    if not autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_the_entry_point_is_declared() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = project["project"]["entry-points"]["pytest11"]
    assert declared == {"idempotent_worker": "worker.testing.plugin"}
    plugin = importlib.import_module(declared["idempotent_worker"])
    assert callable(plugin.pytest_addoption)


def test_loaded_by_name_its_fixtures_work_in_a_users_project(tmp_path: Path) -> None:
    done = user_project(
        tmp_path, "-p", "worker.testing.plugin", "-p", "pytest_asyncio.plugin", autoload=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_installed_its_fixtures_need_nothing_at_all(tmp_path: Path) -> None:
    if not any(e.value == "worker.testing.plugin" for e in entry_points(group="pytest11")):
        unavailable("the installed package predates its pytest11 entry point: pip install -e .")
    done = user_project(tmp_path, autoload=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
