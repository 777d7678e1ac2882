"""Layering: no import cycle among grpo/ modules (lazy imports in functions and `if TYPE_CHECKING:` imports count too),
grpo/ never imports the edge packages (tools/, recipes/, benchmarks/, tests/, maintainer/), which import it, the
settings sections (grpo/settings.py) are a leaf below every objective, and the two tiers stay apart: the packaged
product (grpo/, tools/, recipes/) never imports the unpackaged maintainer tools (maintainer/), whose package has no
cycle either.

Not import-linter 2.16: it needs Python >= 3.11 (this project: 3.10) and grimp, and checks package-level cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests import ROOT

GRPO = ROOT / "grpo"
EDGE = ("tools", "recipes", "benchmarks", "tests", "maintainer")
PRODUCT = ("grpo", "tools", "recipes")  # pyproject.toml's packages
SETTINGS = "grpo.settings"  # the settings sections: what any module may annotate with


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(top: Path = GRPO) -> dict[str, Path]:
    return {module_name(p): p for p in sorted(top.rglob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    """The modules an import statement names (`from pkg import mod` names pkg.mod when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level or node.module is None:
        raise AssertionError(f"relative import at line {node.lineno}: use absolute grpo.* imports")
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]


def imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, those inside functions and under `if TYPE_CHECKING:` included: a lazy import
    is still a dependency, and a type-only one still ties the two modules' design together."""
    tree = ast.parse(path.read_text(), str(path))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def import_graph(top: Path = GRPO) -> dict[str, set[str]]:
    known = modules(top)
    graph = {}
    for name, path in known.items():
        graph[name] = {m for node in imports(path) for m in imported(node, known) if m in known and m != name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


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


def test_imports_under_type_checking_count(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo.config import RecipeConfig\n")
    assert [n.module for n in imports(path)] == ["typing", "grpo.config"]


def test_grpo_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_settings_are_a_leaf_below_every_objective():
    """grpo/settings.py imports the schema alone (no objective, no torch, not grpo.config), so every module can
    annotate with its classes, and grpo/config.py assembles RecipeConfig from it and the registry."""
    graph = import_graph()
    below = reachable(graph, SETTINGS)
    assert below <= {"grpo.schema", "grpo.errors"}, below
    assert not any(m.startswith("grpo.objectives") for m in below)
    external = {name.split(".")[0] for m in (SETTINGS, *below) for n in imports(modules()[m])
                for name in ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""])}
    assert not external & {"torch", "diffusers", "transformers", "deepspeed"}, external
    # What the registry imports never reaches grpo.config: it is above them all.
    assert "grpo.config" not in reachable(graph, "grpo.objectives") | reachable(graph, "grpo.checks")


def test_the_product_never_imports_the_maintainer_tools():
    bad = []
    for top in PRODUCT:
        known = modules(ROOT / top)
        for name, path in known.items():
            bad += [f"{name} imports {target} (line {node.lineno})" for node in imports(path)
                    for target in imported(node, known) if target.split(".")[0] == "maintainer"]
    assert not bad, "\n".join(bad)


def test_the_maintainer_tools_have_no_import_cycle():
    graph = import_graph(ROOT / "maintainer")
    assert {"maintainer.tiny_worlds.build", "maintainer.tiny_worlds.flux1"} <= graph.keys()
    assert cycles(graph) == []


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
