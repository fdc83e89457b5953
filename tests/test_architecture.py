"""The package stays readable in an afternoon: no import circle between its modules, no
module over 350 lines, no folder over 15 modules.

An import anywhere in a module counts (a function-level import that closes a circle is
still a circle to a reader); imports under `if TYPE_CHECKING:` do not, as they never run.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest
from support.paths import REPO

PACKAGE = REPO / "mlx_prefix"
MAX_LINES = 350
MAX_MODULES = 15


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        test = node.test if isinstance(node, ast.If) else None
        if test is not None and "TYPE_CHECKING" in ast.unparse(test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that the module `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        graph[name] = set()
        # A package's __init__ importing its own modules is how a package is made, and
        # every module of it importing the package's name runs that __init__: not a circle
        # a reader follows, so a module's edge to its own enclosing packages is left out.
        for target in imported(name, path, known):
            if not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def test_the_import_graph_is_read_from_the_code():
    graph = import_graph()
    assert "mlx_prefix.config" in graph["mlx_prefix.engine.engine"]
    assert sum(len(targets) for targets in graph.values()) > 500


def test_no_import_circle():
    try:
        TopologicalSorter(import_graph()).prepare()
    except CycleError as error:
        pytest.fail(f"modules importing each other in a circle: {' -> '.join(error.args[1])}")


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(REPO))
)
def test_no_module_is_over_350_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)}: {lines} lines"


@pytest.mark.parametrize(
    "folder",
    sorted({p.parent for p in PACKAGE.rglob("*.py")}),
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_no_folder_holds_over_15_modules(folder):
    count = len(list(folder.glob("*.py")))  # __init__.py included: it is a module too
    assert count <= MAX_MODULES, f"{folder.relative_to(REPO)}: {count} modules"
