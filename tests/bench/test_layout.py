"""bench/ is grouped by what it measures, and every module says which docs/BENCHMARKS.md section it
writes (or that it writes none), naming a heading that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
GROUPS = {"attacks", "canary", "common", "detection", "drills", "gpu", "overhead", "scale"}


def headings() -> list[str]:
    """Every `# ` area (its name before the colon) and `## ` section title of BENCHMARKS."""
    text = (REPO / "docs" / "BENCHMARKS.md").read_text()
    areas = [m.split(":")[0] for m in re.findall(r"^# (.+)$", text, re.M)]
    return areas + re.findall(r"^## (.+)$", text, re.M)


def test_no_script_is_left_at_the_top_of_bench():
    assert [p.name for p in BENCH.glob("*.py")] == ["__init__.py"]
    assert {p.name for p in BENCH.iterdir() if p.is_dir() and p.name != "__pycache__"} == GROUPS


def test_every_module_names_the_section_it_writes():
    names = headings()
    for path in sorted(BENCH.rglob("*.py")):
        doc = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split())
        if path.name == "__init__.py" and "Writes docs/BENCHMARKS.md" not in doc:
            assert "docs/BENCHMARKS.md" in doc, path  # a group's docstring names its areas
            continue
        assert "Writes docs/BENCHMARKS.md" in doc, path
        assert any(name in doc for name in names), path
