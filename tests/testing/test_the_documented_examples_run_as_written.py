"""docs/testing.md's harness and prove_idempotent examples, copied into a project of a
user's own with the one setting the page names beside them: they run as written.

Copied without it they failed with "async def functions are not natively supported": they
need pytest-asyncio's auto mode, which the page never mentioned (issue 32, row 12).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.processes import REPO, clean_env

PAGE = REPO / "docs" / "testing.md"
MODE = 'asyncio_mode = "auto"'


def examples() -> list[str]:
    """The page's Python blocks that define a test."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    return [block for block in blocks if "async def test_" in block]


def test_the_page_names_the_mode_beside_its_examples() -> None:
    text = PAGE.read_text()
    first_example = text.index("async def test_")
    assert MODE in text[:first_example], "the mode is not named before the first example"
    assert len(examples()) >= 2


def test_the_examples_run_as_written_in_a_users_project(tmp_path: Path) -> None:
    # the user's handlers: the example application under the examples' own name
    shutil.copytree(
        REPO / "handlers",
        tmp_path / "myapp" / "handlers",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (tmp_path / "myapp" / "__init__.py").write_text("")
    named = re.search(r'asyncio_mode = "\w+"', PAGE.read_text())  # what the page tells
    assert named is not None, "the page names no asyncio_mode"
    (tmp_path / "pyproject.toml").write_text(f"[tool.pytest.ini_options]\n{named[0]}\n")
    for number, example in enumerate(examples()):
        (tmp_path / f"test_example_{number}.py").write_text(example)
    env = clean_env()
    env.pop("PYTEST_ADDOPTS", None)
    # `import myapp.handlers` as the page writes it; the example's modules import each
    # other as `handlers`, so its folder is on the path too
    env["PYTHONPATH"] = str(tmp_path / "myapp")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(examples())} passed" in done.stdout, done.stdout
