"""The README's library snippets run as written (in a scratch folder, from a fresh interpreter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_readme_has_python_snippets() -> None:
    assert python_blocks(), "the README lost its library snippets"


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(python_blocks())))
def test_readme_snippet_runs_as_written(i: int, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    code = python_blocks()[i]
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    if "run_dir=" in code:  # the snippet wrote a run store a user can read
        assert any((tmp_path / "runs").glob("*/steps/*.parquet"))
