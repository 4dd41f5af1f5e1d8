"""README's Layout section names every module of the package, and nothing that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "worker"


def layout() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def named(block: str) -> set[str]:
    """Every ``name.py`` and ``name/`` the block mentions."""
    return set(re.findall(r"[\w]+\.py|[\w]+/", block))


def test_every_module_and_package_of_worker_is_in_the_layout() -> None:
    names = named(layout())
    modules = {p.name for p in PACKAGE.glob("*.py")} | {
        p.name for p in (PACKAGE / "brokers").glob("*.py")
    }
    packages = {
        f"{p.name}/" for p in (PACKAGE / "brokers").iterdir() if (p / "__init__.py").exists()
    }
    missing = sorted((modules | packages) - names - {"__main__.py"})
    assert not missing, f"README's Layout does not name {missing}"


def test_the_layout_names_nothing_that_does_not_exist() -> None:
    block = layout()
    listed = re.findall(r"^ +([\w]+\.py|[\w]+/)", block, flags=re.MULTILINE)
    under_brokers = block.split("brokers/", 1)[1].split("pump.py", 1)[0]
    broker_entries = set(re.findall(r"^ +([\w]+\.py|[\w]+/)", under_brokers, flags=re.MULTILINE))
    gone = []
    for entry in listed:
        base = PACKAGE / "brokers" if entry in broker_entries else PACKAGE
        if not (base / entry.rstrip("/")).exists():
            gone.append(entry)
    assert not gone, f"README's Layout names {gone}, which are not in worker/"
