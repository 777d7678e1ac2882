"""Layering of the runtime library: no import cycle among grpo/ modules (lazy imports in functions count too), and
grpo/ never imports the edge packages (tools/, recipes/, benchmarks/, tests/), which import it.

Not import-linter 2.16: it needs Python >= 3.11 (this project: 3.10) and grimp, and checks package-level cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests import ROOT

GRPO = ROOT / "grpo"
EDGE = ("tools", "recipes", "benchmarks", "tests")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(GRPO.rglob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    """The modules an import statement names (`from pkg import mod` names pkg.mod when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level or node.module is None:
        raise AssertionError(f"relative import at line {node.lineno}: use absolute grpo.* imports")
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]


def imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, those inside functions included: a lazy import is still a dependency.
    Imports under `if TYPE_CHECKING:` are left out: they never run (annotations only)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in typing_only]


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, path in known.items():
        graph[name] = {m for node in imports(path) for m in imported(node, known) if m in known and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_grpo_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_grpo_imports_no_edge_package():
    known = modules()
    bad = []
    for name, path in known.items():
        for node in imports(path):
            for target in imported(node, known):
                if target.split(".")[0] not in EDGE:
                    continue
                bad.append(f"{name} imports {target} (line {node.lineno})")
    assert not bad, "\n".join(bad)
