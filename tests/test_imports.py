"""No import circle anywhere (issue #36, point 3): the modules of provisioner/, providers/ and
policies/ form a graph without cycles, counting every import a module runs — at module level or
inside a function (a function-local import only postpones a circle, it does not end it). Imports
under ``if TYPE_CHECKING:`` run never and are left out: a helper may name its adapter's type.

An edge goes to the module an import names: ``from a.b import c`` is an edge to ``a.b.c`` when
that is a module, else to ``a.b``. The packages an import passes through on the way (``a``'s
``__init__``) are not counted, or every package that gathers its own modules would be a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("provisioner", "providers", "policies")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" not in p.parts:
                out[module_name(p)] = p
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs, at any depth, less the type-checking-only ones."""
    out: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                for sub in child.orelse:
                    walk(sub)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            walk(child)

    walk(tree)
    return out


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the modules of ours it imports."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected set of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_circle(edges, g) for g in groups]


def _circle(edges: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(edges[v] & group):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    raise AssertionError(f"no circle in {sorted(group)}")


def test_no_module_imports_itself_round_a_circle():
    found = cycles(graph(sources()))
    assert not found, "import circles (function-local imports count):\n" + "\n".join(
        " → ".join(c) for c in found
    )


def test_a_clouds_helpers_never_import_its_adapter():
    """The adapter is the top of its folder: it imports its helpers (volumes, network, errors,
    billing…), none of them imports it back, even inside a function (its type, for checking
    only, is allowed)."""
    edges = graph(sources())
    upward = sorted(
        f"{m} → {t}"
        for m, targets in edges.items()
        for t in targets
        if t.startswith("providers.") and t.endswith(".adapter") and m != t
    )
    assert not upward, "a cloud's module imports an adapter: " + ", ".join(upward)


def test_a_function_local_circle_is_found(tmp_path):
    """The detector itself: a circle closed only inside a function is one."""
    edges = {"p.a": {"p.b"}, "p.b": set(), "p.c": set()}
    assert cycles(edges) == []
    tree = ast.parse("import os\ndef f():\n    from p import a\n")
    assert [n.names[0].name for n in _imports(tree)] == ["os", "a"]
    edges["p.b"].add("p.a")
    assert cycles(edges) == [["p.a", "p.b", "p.a"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.a\n")
    assert [n.module for n in _imports(tree) if isinstance(n, ast.ImportFrom)] == ["typing"]
