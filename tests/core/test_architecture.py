"""The layout's promises: no import cycles inside ``worker``, counting every import (module
level, typing-only and inside functions alike); no module importing another module's
private names; no module but the pump touching the pump's private state; and the core
loads no broker SDK."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "worker"
SDKS = ("aio_pika", "aiormq", "aiokafka", "azure")


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, known: set[str]) -> set[str]:
    """Every import in the module, wherever it stands: at module level, under ``if
    TYPE_CHECKING:``, in ``try:`` blocks and inside functions. An import inside a function
    is still a dependency; hiding one there only hides a cycle."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # ``from worker import inbox`` depends on the submodule, not on the
            # package's facade (worker/__init__.py re-exports the handler API)
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            submodules = [name for name in names if name in known]
            found.update(submodules)
            if len(submodules) < len(names):
                found.add(node.module)
    return found & known


def private_imports(tree: ast.Module, known: set[str]) -> list[str]:
    """``from worker.x import _name`` and ``x._name`` on an imported worker module."""
    found: list[str] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in known and not node.level:
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.module}.{alias.name}")
                elif f"{node.module}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def import_graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts]
    known = {_module(p) for p in paths}
    return {_module(p): _imports(ast.parse(p.read_text()), known) - {_module(p)} for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> None:
        for target in sorted(graph[node]):
            if target in path:
                found.append([*path[path.index(target) :], target])
            elif target not in done:
                walk(target, [*path, target])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            walk(start, [start])
    return found


def test_the_package_has_no_import_cycles() -> None:
    graph = import_graph()
    assert graph.get("worker.pump")  # the walk found real modules
    assert cycles(graph) == []


def test_the_cycle_check_can_fail() -> None:
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


def test_a_name_imported_from_the_facade_is_an_edge_to_it() -> None:
    known = {"worker", "worker.inbox", "worker.pump"}
    tree = ast.parse("from worker import inbox\nfrom worker import Context")
    assert _imports(tree, known) == {"worker.inbox", "worker"}
    assert _imports(ast.parse("from worker import inbox"), known) == {"worker.inbox"}


def test_an_import_inside_a_function_is_an_edge() -> None:
    known = {"worker.inbox", "worker.pump"}
    tree = ast.parse("def f():\n    from worker.pump import Pump\n    import worker.inbox\n")
    assert _imports(tree, known) == {"worker.pump", "worker.inbox"}


def modules() -> dict[str, ast.Module]:
    paths = [p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts]
    return {_module(p): ast.parse(p.read_text()) for p in paths}


def test_no_module_imports_another_modules_private_names() -> None:
    trees = modules()
    known = set(trees)
    found = {name: private_imports(tree, known) for name, tree in trees.items()}
    assert {name: names for name, names in found.items() if names} == {}


def test_the_private_name_check_can_fail() -> None:
    known = {"worker.claims", "worker.sweeper"}
    tree = ast.parse("from worker.claims import _aware\nfrom worker import sweeper\nsweeper._x()")
    assert private_imports(tree, known | {"worker"}) == [
        "worker.claims._aware",
        "worker.sweeper._x",
    ]


def test_no_module_but_the_pump_touches_the_pumps_private_state() -> None:
    """``pump._anything`` (or ``self.pump._anything``) appears in worker/pump.py only."""
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "pump.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "pump._" in line
    ]
    assert offenders == []


def test_the_core_imports_no_broker_sdk() -> None:
    probe = (
        "import sys, worker.pump, worker.cli; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(SDKS)!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"
