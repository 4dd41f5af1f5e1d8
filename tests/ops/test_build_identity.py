"""``worker --version`` and ``worker_build_info``: which build runs, from the command line and
from Prometheus, with the source revision the image was built from."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata

import pytest

from tests.support.processes import REPO, clean_env
from worker.metrics import REVISION_VARIABLE


def worker(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = clean_env()
    environment.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_worker_version_names_the_package_version_and_the_revision() -> None:
    version = metadata.version("idempotent-worker")
    for flag in ("--version", "-V"):  # -V was an argparse error
        result = worker(flag, **{REVISION_VARIABLE: "0123abc"})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"worker {version} (revision 0123abc)"


def test_in_a_git_checkout_the_revision_is_the_checkouts() -> None:
    """It said "revision unknown" in the checkout it was installed from (pip install -e)."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(
        [git, "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout.strip()
    version = metadata.version("idempotent-worker")
    shown = worker("-V").stdout.strip()
    assert shown in (
        f"worker {version} (revision {head})",
        f"worker {version} (revision {head}-dirty)",
    )


def test_the_package_has_a_version_attribute() -> None:
    import worker as package

    assert package.__version__ == metadata.version("idempotent-worker")


def test_worker_build_info_is_exported_with_version_and_revision() -> None:
    script = (
        "from prometheus_client import generate_latest; import worker.metrics; "
        "print(generate_latest().decode())"
    )
    environment = clean_env()
    environment.update(PYTHONPATH=str(REPO), **{REVISION_VARIABLE: "0123abc"})
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    version = metadata.version("idempotent-worker")
    expected = f'worker_build_info{{revision="0123abc",version="{version}"}} 1.0'
    assert expected in result.stdout.splitlines()


def test_the_revision_variable_is_not_reported_as_an_unknown_setting() -> None:
    """The image sets it in every pod: a WORKER_* name would be warned about (or, with
    WORKER_REFUSE_UNKNOWN_VARIABLES, refused) on every start."""
    from worker.settings import Settings, unknown_variables

    assert unknown_variables(Settings, {REVISION_VARIABLE: "0123abc"}) == []
    assert unknown_variables(Settings, {"WORKER_BUILD_REVISION": "0123abc"})  # the check is awake
