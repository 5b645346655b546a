"""The README's library snippets and marked shell recipes run as written (in a scratch folder,
from a fresh interpreter).

Python blocks run one by one. A Python block whose first line is `# NAME.py` is also a file the
shell recipes use: it is written to the scratch folder as NAME.py. A ```bash block right after the
line `<!-- runs as written: tests/test_readme_snippets.py -->` runs in that folder with this
interpreter's bin first on $PATH (its `python` and `moeguard`); a recipe that says what it prints
when it catches something (`|| echo "... caught"`) must print it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNS_MARK = "<!-- runs as written: tests/test_readme_snippets.py -->"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def shell_recipes() -> list[str]:
    return re.findall(
        re.escape(RUNS_MARK) + r"\n```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S
    )


def named_files() -> dict[str, str]:
    """NAME.py -> code, for the Python blocks that start with `# NAME.py`."""
    out = {}
    for code in python_blocks():
        m = re.match(r"# ([\w.-]+\.py)\n", code)
        if m:
            out[m.group(1)] = code
    return out


def test_readme_has_python_snippets() -> None:
    assert python_blocks(), "the README lost its library snippets"
    assert shell_recipes(), "the README lost its marked shell recipes"


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


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("i", range(len(shell_recipes())))
def test_readme_shell_recipe_runs_as_written(i: int, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    recipe = shell_recipes()[i]
    for name, code in named_files().items():
        (tmp_path / name).write_text(code)
    env = {**os.environ, "PATH": os.pathsep.join((os.path.dirname(sys.executable), os.environ["PATH"]))}
    r = subprocess.run(
        ["bash", "-e", "-c", recipe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    for said in re.findall(r'\|\| echo "([^"]*caught)"', recipe):
        assert said in r.stdout, r.stderr[-3000:]


def torchtitan_recipe() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    found = [b for b in blocks if "-m guard.integrations.torchtitan" in b]
    assert len(found) == 1, "the README's torchtitan recipe is gone"
    return found[0]


@pytest.mark.slow
@pytest.mark.integration
def test_readme_torchtitan_recipe_runs_as_written(tmp_path: Path) -> None:
    """The recipe as a shell script: a collector, two torchtitan ranks streaming to it. Run in a
    scratch folder with the checkout on PYTHONPATH (the README runs it from the repository root)."""
    import json

    pytest.importorskip("torchtitan")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("MOEGUARD_COLLECTOR", None)
    script = "set -e\n" + torchtitan_recipe().replace("kill %1", "kill %1; wait || true")
    r = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    meta = json.loads((tmp_path / "runs" / "tt-demo" / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["final_step"] == 40 and meta["world_size"] == 2
    assert meta["config"]["guard"]["collapse"]["warmup"] == 20  # the recipe's guard file was used
    assert any((tmp_path / "collector-runs" / "tt-demo" / "steps").glob("*.parquet"))  # it streamed
    assert "run tt-demo: 40 steps" in r.stderr  # the end-of-run summary
