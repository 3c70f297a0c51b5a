"""The import graph of the project's own packages: no circle (a module that imports, at any
depth and anywhere in its body, a module that imports it back), and dependencies point one way:
serving -> pipelines -> maxdiff; and the pipeline and service modules stay small."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("maxdiff", "pipelines", "serving")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports}, from every import statement in its source
    (function-level ones too); ``from a import b`` is an import of ``a.b`` when that is a
    module, else of ``a``."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    base = ".".join(up[:len(up) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports():
    graph = import_graph()
    assert "maxdiff.models.unet" in graph["maxdiff.loaders"]  # `from maxdiff.models import unet`
    assert "pipelines.program" in graph["pipelines.runner"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    assert _cycles(import_graph()) == []


def test_dependencies_point_one_way():
    graph = import_graph()
    rank = {"maxdiff": 0, "pipelines": 1, "serving": 2}
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
              if rank[d.partition(".")[0]] > rank[m.partition(".")[0]]]
    assert upward == []


MAX_LINES = 450  # issue #40: modules of a few hundred lines with one job each


def test_pipeline_and_service_modules_stay_small():
    long = {str(p.relative_to(ROOT)): n for pkg in ("pipelines", "serving")
            for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
