"""kiln's import graph, read from the source (every import, at the top or inside a function): no
circles, and no arrow pointing up a layer."""

from __future__ import annotations

import ast
from pathlib import Path

import kiln

ROOT = Path(kiln.__file__).parent


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the kiln modules it imports. `from package import module` is an arrow to the module."""
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else owner(node.module)
                           for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t is not None and t != name and t.startswith("kiln")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def arrows(graph, source: str, target: str) -> list[str]:
    inside = lambda m, p: m == p or m.startswith(p + ".")  # noqa: E731
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if inside(m, source) for t in ts if inside(t, target))


def test_the_graph_sees_lazy_imports_and_circles():
    graph = import_graph()
    assert "kiln.engine.model" in graph["kiln.server.runtime"]  # imported inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_circles():
    assert cycles(import_graph()) == []


def test_no_arrow_points_up():
    graph = import_graph()
    up = [*arrows(graph, "kiln.server", "kiln.commands"), *arrows(graph, "kiln.engine", "kiln.commands"),
          *arrows(graph, "kiln.engine", "kiln.server"), *arrows(graph, "kiln.store", "kiln.engine"),
          *arrows(graph, "kiln.modelfile", "kiln.engine"), *arrows(graph, "kiln.eval", "kiln.bench")]
    assert up == []
