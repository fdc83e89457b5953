"""No import cycle in benchmarks/: every import, at module level or inside a function,
points one way, so each module can be read and loaded after the ones it uses."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

from support.paths import REPO

ROOT = REPO / "benchmarks"


def _module(path: Path) -> str:
    parts = ("benchmarks", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, package: str) -> list[str]:
    """The modules (or packages) an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        mod = ".".join([*base, node.module] if node.module else base)
    else:
        mod = node.module or ""
    # `from . import x` imports module x; `from .m import name` imports module m.
    return [f"{mod}.{a.name}" for a in node.names] + [mod]


def import_graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = _imported(node, package)
            found = [n for n in names[:-1] if n in modules] or names[-1:]
            graph[name] |= {n for n in found if n in modules and n != name}
    return graph


def test_benchmarks_have_no_import_cycle() -> None:
    graph = import_graph()
    assert "benchmarks.report.sharded" in graph["benchmarks.report.markdown"]  # it sees imports
    assert {"benchmarks.goals.throughput", "benchmarks.goals.common"} <= graph["benchmarks.goals"]
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None
