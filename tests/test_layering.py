"""The layering rules of the packages (docs/ARCHITECTURE.md), checked on the source, not at runtime.

- `guard` never imports `trainer` or `dashboards`: trainer and the app depend on guard, not the
  other way round (the canary's worker, which runs a model, lives in trainer/).
- `guard/core` is pure: no torch and no I/O module, so the detectors, policy and report mapping
  run the same in-process, in the collector and in `replay`, and test with plain lists.

Every `import` / `from ... import` statement counts, module level or inside a function (a lazy
import is still a dependency), read from each file's AST.
"""

from __future__ import annotations

import ast
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
