"""The library's modules import one another without cycles, function-local imports included.

A cycle hidden behind an import inside a function still ties two modules into one: neither can be
read, tested or changed alone. Imports under `if TYPE_CHECKING:` are left out, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the installed package name of each top-level folder (pyproject's package-dir)
PACKAGES = {
    "harmony": "harmony",
    "decomposer": "harmony.decomposer",
    "scheduler": "harmony.scheduler",
    "runtime": "harmony.runtime",
    "profiling": "harmony.profiling",
    "models": "harmony.models",
}


def library_modules() -> dict[str, Path]:
    """Every module of the library by its dotted name; a package by its own name (its __init__)."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every import statement, at any depth, except those only a type checker reads."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = node.orelse
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        else:
            children = [node]
        for child in children:
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            else:
                yield from _import_nodes(child)


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The library modules that module `name` imports."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    targets = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            targets.add(submodule if submodule in modules else base)
    return {t for t in targets if t in modules and t != name}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def import_graph() -> dict[str, set[str]]:
    modules = library_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def test_the_cycle_finder_sees_a_function_local_import_as_an_edge(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("import os\n\ndef f():\n    from harmony.plan import Plan\n")
    assert imported("harmony.a", path, {"harmony.plan": path, "harmony.a": path}) == {"harmony.plan"}
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_library_has_no_import_cycles():
    cycles = strongly_connected(import_graph())
    assert not cycles, "modules that import one another, directly or through others: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )
