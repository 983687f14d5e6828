"""No import circles among vidtune's modules: every `from vidtune... import` / `import vidtune...` (at the top of
a module or inside a function alike) points downhill. Imports under `if TYPE_CHECKING:` are left out: they never
run and only name types for annotations."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import vidtune

PACKAGE = Path(vidtune.__file__).parent


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> its file (a package by its `__init__.py`)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth, but those that only run for type checkers."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda node: node.lineno)


def _parents(module: str) -> list[str]:
    """The packages above a module, but the top one (`vidtune.a.b` -> [`vidtune.a`])."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(2, len(parts))]


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: the line of the first such import}. `from a import b` points at `a.b` when
    that is a module, else at `a`; a module inside a package also points at the package (importing it runs it)."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:  # `import vidtune.a.b` names a module; trim attributes
                    target = target.rpartition(".")[0]
                # Importing `a.b.c` first runs the package `a.b`: an edge to it too (but to the importer's own).
                for parent in _parents(target):
                    if parent in modules and not f"{name}.".startswith(f"{parent}."):
                        edges.setdefault(parent, node.lineno)
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each as a path that closes on itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return [_cycle_in(group, graph) for group in groups]


def _cycle_in(group: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """One circle through the group's first module (breadth first: the shortest), as module names."""
    members = set(group)
    start = group[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    return group


def describe(cycle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    steps = [f"{source} ({modules[source].relative_to(PACKAGE.parent)}:{graph[source][target]})"
             for source, target in itertools.pairwise(cycle)]
    return " -> ".join([*steps, cycle[-1]])


def test_no_module_of_vidtune_imports_itself_through_others():
    modules = module_files()
    graph = import_graph(modules)
    found = [describe(cycle, graph, modules) for cycle in circles(graph)]
    assert not found, "import circles (move what both sides need downhill):\n" + "\n".join(found)


def test_the_graph_sees_circles_through_function_level_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import thing\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (package / "e.py").write_text("from pkg import d\n")
    graph = import_graph(module_files(package))
    assert graph["pkg.sub.b"] == {"pkg.c": 2}
    assert "pkg.a" not in graph["pkg.d"]  # annotations only
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_importing_a_module_of_a_package_counts_as_importing_the_package(tmp_path):
    package = tmp_path / "pkg"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "inner" / "__init__.py").write_text("from pkg import x\n")  # the package runs x ...
    (package / "inner" / "y.py").write_text("VALUE = 1\n")
    (package / "x.py").write_text("from pkg.inner.y import VALUE\n")  # ... and x needs the package run first
    graph = import_graph(module_files(package))
    assert graph["pkg.x"] == {"pkg.inner": 1, "pkg.inner.y": 1}
    assert graph["pkg.inner.y"] == {}  # a module's own package is not counted
    assert circles(graph) == [["pkg.inner", "pkg.x", "pkg.inner"]]
