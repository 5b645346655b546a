"""The layering rules of the packages (docs/ARCHITECTURE.md), checked on the source, not at runtime.

- `guard` never imports `trainer` or `dashboards`: trainer and the app depend on guard, not the
  other way round (the canary's worker, which runs a model, lives in trainer/).
- `guard/core` is pure: no torch and no I/O module, so the detectors, policy and report mapping
  run the same in-process, in the collector and in `replay`, and test with plain lists.

- No import circle inside `guard` or `trainer`: the module graph is acyclic, so every module can
  be read, tested and imported below the ones that use it. A piece two modules share moves down
  into a module of its own (or becomes a Protocol there); a package's `__init__` may re-export it.
- `guard/runtime` never imports `guard/integrations`: the adapters sit above the runtime (the
  routing statistics and the Corrector protocol they share live in guard/runtime/routing.py).

Every `import` / `from ... import` statement counts, module level or inside a function (a lazy
import is still a dependency: it runs the first time the function does, and a circle closed by one
still couples the two modules), and so does one under `if TYPE_CHECKING:` (the annotations that
need it are a dependency too; name a Protocol below instead). Read from each file's AST; relative
imports are resolved. An edge goes to the module named, not to the packages above it (importing
`a.b.c` runs `a/__init__` and `a/b/__init__` first, but a package re-exporting its submodules is
not a circle); `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GUARD = REPO / "guard"
CORE = GUARD / "core"

NOT_FROM_GUARD = ("trainer", "dashboards")
NOT_FROM_CORE = (
    "torch",
    "polars",
    "pyarrow",
    "httpx",
    "requests",
    "socket",
    "http",
    "urllib",
    "threading",
    "subprocess",
    "asyncio",
    "starlette",
    "uvicorn",
    "prometheus_client",
    "opentelemetry",
    "streamlit",
)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, at any depth of the AST."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def violations(root: Path, banned: tuple[str, ...]) -> dict[str, list[str]]:
    """'path imports package' -> ['line N: module', ...] for each banned top-level package under root."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top in banned:
                found.setdefault(f"{path.relative_to(REPO)} imports {top}", []).append(
                    f"line {line}: {module}"
                )
    return found


def _listing(found: dict[str, list[str]]) -> str:
    return "\n".join(f"{k} ({', '.join(where)})" for k, where in sorted(found.items()))


def test_guard_never_imports_trainer_or_dashboards() -> None:
    bad = violations(GUARD, NOT_FROM_GUARD)
    assert not bad, "guard must not depend on trainer or dashboards:\n" + _listing(bad)


def test_guard_core_imports_neither_torch_nor_io() -> None:
    bad = violations(CORE, NOT_FROM_CORE)
    assert not bad, "guard/core must stay pure (no torch, no I/O modules):\n" + _listing(bad)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import trainer.loop", ["trainer.loop"]),
        ("def f():\n    from trainer.cli import parse_overrides", ["trainer.cli"]),
        ("from . import sibling\nfrom .x import y", []),  # relative imports stay inside the package
        ("import os, torch.nn as nn", ["os", "torch.nn"]),
    ],
)
def test_the_checker_sees_every_import(tmp_path: Path, source: str, expected: list[str]) -> None:
    f = tmp_path / "m.py"
    f.write_text(source + "\n")
    assert [m for _, m in imported_modules(f)] == expected


# ---------------------------------------------------------------------------------------------
# Import circles, and the runtime below the adapters.

CIRCLE_FREE = ("guard", "trainer")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line} for every module of `packages` under `root`,
    with edges only to modules of those packages (the rules in the module docstring)."""
    files = {module_name(root, f): f for pkg in packages for f in sorted((root / pkg).rglob("*.py"))}

    def known(name: str) -> str | None:  # the module itself, else the nearest package above it
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        edges = graph.setdefault(mod, {})
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]  # the package it is in
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [
                    known(f"{base}.{a.name}") if f"{base}.{a.name}" in files else known(base)
                    for a in node.names
                ]
            else:
                continue
            for t in targets:
                if t is not None and t != mod:
                    edges.setdefault(t, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as the
    path m0 -> m1 -> ... -> m0, starting at the component's first module by name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in components:
        start = min(comp)
        # the shortest way back to start inside the component (breadth first)
        came: dict[str, str] = {}
        frontier = [start]
        while start not in came:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in comp and w not in came:
                        came[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while came[path[-1]] != start:
            path.append(came[path[-1]])
        out.append([start, *reversed(path[1:]), start])
    return sorted(out)


def _circle_listing(graph: dict[str, dict[str, int]], found: list[list[str]]) -> str:
    return "\n".join(
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:], strict=False)) + f" -> {c[-1]}"
        for c in found
    )


def upward_imports(graph: dict[str, dict[str, int]], lower: str, upper: str) -> list[str]:
    """'module line N: imported' for every import from package `lower` into package `upper`."""
    return [
        f"{m} line {line}: {t}"
        for m, edges in sorted(graph.items())
        if m == lower or m.startswith(lower + ".")
        for t, line in sorted(edges.items())
        if t == upper or t.startswith(upper + ".")
    ]


def test_no_import_circle_in_guard_or_trainer() -> None:
    graph = import_graph(REPO, CIRCLE_FREE)
    assert len(graph) > 100  # the checker read the tree (not an empty glob)
    found = circles(graph)
    assert not found, "import circles (move the shared piece down; tests/test_layering.py):\n" + (
        _circle_listing(graph, found)
    )


def test_runtime_never_imports_integrations() -> None:
    graph = import_graph(REPO, CIRCLE_FREE)
    assert "guard.runtime.probe" in graph and "guard.integrations.base" in graph
    bad = upward_imports(graph, "guard.runtime", "guard.integrations")
    assert not bad, "guard/runtime must not import the adapters above it:\n" + "\n".join(bad)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def test_the_circle_checker_flags_a_circle(tmp_path: Path) -> None:
    """A tiny package in tmp_path: a circle closed at module level, one closed by a lazy import,
    one through relative imports, one under TYPE_CHECKING, and a chain that is no circle."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.chain_a import A as A\n",  # re-exporting is no circle
            "pkg/chain_a.py": "from pkg.chain_b import B\nA = B\n",
            "pkg/chain_b.py": "import os\nB = 1\n",
            "pkg/mod_a.py": "import pkg.mod_b\n",
            "pkg/mod_b.py": "from pkg import mod_a\n",
            "pkg/lazy_a.py": "from pkg.lazy_b import f\n",
            "pkg/lazy_b.py": "def f():\n    from pkg.lazy_a import g\n    return g\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/rel_a.py": "from . import rel_b\n",
            "pkg/sub/rel_b.py": "from ..sub.rel_c import x\n",
            "pkg/sub/rel_c.py": "from .rel_a import y\n",
            "pkg/typed_a.py": "from pkg.typed_b import T\n",
            "pkg/typed_b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.typed_a import U\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg"] == {"pkg.chain_a": 1}
    assert circles(graph) == [
        ["pkg.lazy_a", "pkg.lazy_b", "pkg.lazy_a"],
        ["pkg.mod_a", "pkg.mod_b", "pkg.mod_a"],
        ["pkg.sub.rel_a", "pkg.sub.rel_b", "pkg.sub.rel_c", "pkg.sub.rel_a"],
        ["pkg.typed_a", "pkg.typed_b", "pkg.typed_a"],
    ]
    listing = _circle_listing(graph, circles(graph))
    assert "pkg.lazy_b (line 2) -> pkg.lazy_a" in listing  # says where each arrow is
    # breaking one: the shared piece moves down, and the checker passes
    _write(tmp_path, {"pkg/lazy_b.py": "from pkg.lazy_c import g\n", "pkg/lazy_c.py": "g = 1\n"})
    assert ["pkg.lazy_a", "pkg.lazy_b", "pkg.lazy_a"] not in circles(import_graph(tmp_path, ["pkg"]))


def test_the_upward_import_checker_flags_runtime_importing_integrations(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "guard/__init__.py": "",
            "guard/integrations/__init__.py": "",
            "guard/integrations/base.py": "from guard.runtime.routing import Corrector\n",
            "guard/runtime/__init__.py": "",
            "guard/runtime/routing.py": "class Corrector: ...\n",
            "guard/runtime/apply.py": "def f():\n    from guard.integrations.base import Corrector\n",
        },
    )
    graph = import_graph(tmp_path, ["guard"])
    assert upward_imports(graph, "guard.runtime", "guard.integrations") == [
        "guard.runtime.apply line 2: guard.integrations.base"
    ]
    assert upward_imports(graph, "guard.integrations", "guard.runtime") == [
        "guard.integrations.base line 1: guard.runtime.routing"
    ]
