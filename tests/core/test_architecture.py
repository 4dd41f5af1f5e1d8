"""The layout's promises: no import cycles inside ``worker`` (typing-only imports included),
and the core loads no broker SDK."""

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


def _module_level_imports(tree: ast.Module, known: set[str]) -> set[str]:
    """Imports at module level, in ``if TYPE_CHECKING:`` and ``try:`` blocks too; imports
    inside functions are deliberate, lazy, and not part of the module graph."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.finalbody)
            elif isinstance(node, ast.ClassDef):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # ``from worker import inbox`` depends on the submodule, not on the
                # package's facade (worker/__init__.py re-exports the handler API)
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                submodules = [name for name in names if name in known]
                found.update(submodules)
                if len(submodules) < len(names):
                    found.add(node.module)

    visit(tree.body)
    return found & known


def import_graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts]
    known = {_module(p) for p in paths}
    return {
        _module(p): _module_level_imports(ast.parse(p.read_text()), known) - {_module(p)}
        for p in paths
    }


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
    assert _module_level_imports(tree, known) == {"worker.inbox", "worker"}
    assert _module_level_imports(ast.parse("from worker import inbox"), known) == {"worker.inbox"}


def test_the_core_imports_no_broker_sdk() -> None:
    probe = (
        "import sys, worker.pump, worker.cli; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(SDKS)!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"
