"""The frameworks as extras (issue #37 item 3): `moeguard[torchtitan]` and `moeguard[transformers]`
pin what CI tests (scripts/test installs through them), and each entry point run without its
framework stops with one line naming the extra. The framework is made missing for real in a
child interpreter: a sitecustomize on its path sets sys.modules[name] = None, so every import of
it fails as on a machine without it (nothing of moeguard's is replaced)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

from guard.extras import EXTRAS

REPO = Path(__file__).resolve().parents[2]
PINS = {"torchtitan": ("torchtitan", "triton"), "transformers": ("transformers", "accelerate")}


def test_the_framework_extras_pin_what_ci_installs() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    script = (REPO / "scripts" / "test").read_text()
    # CI installs the frameworks through these extras (one install with every extra the suite needs)
    [extras] = re.findall(r'^EXTRAS="\[([a-z,]+)\]" scripts/bootstrap$', script, re.M)
    assert {"torchtitan", "transformers"} <= set(extras.split(","))
    assert not re.search(r'^python -m pip install .*"(transformers|torchtitan)==', script, re.M)
    for extra, dists in PINS.items():
        assert extra in EXTRAS
        pins = {d.split("==")[0]: d.split("==")[1].split(";")[0] for d in deps[extra]}
        assert set(pins) == set(dists)
        for dist in dists:
            if dist == "triton" and sys.platform != "linux":
                continue
            assert version(dist) == pins[dist], (dist, version(dist), pins[dist])


def without(tmp_path: Path, module: str) -> dict[str, str]:
    """An environment whose interpreters cannot import `module` (a sitecustomize blocks it)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "OMP_NUM_THREADS": "1"}


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


TT_LINE = (
    "python -m guard.integrations.torchtitan needs the 'torchtitan' extra: "
    "pip install \"moeguard[torchtitan]\" (no module 'torchtitan')"
)


@pytest.mark.parametrize("launch", [[], ["--nproc-per-node", "2"]])
def test_the_torchtitan_launcher_without_torchtitan_is_one_line_and_exit_2(
    tmp_path: Path, launch: list[str]
) -> None:
    env = without(tmp_path, "torchtitan")
    p = run(env, "-m", "guard.integrations.torchtitan", *launch, "--module", "deepseek_v3", "--config", "x")
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [TT_LINE]  # no traceback, no torchrun spawned
    assert run(env, "-m", "guard.integrations.torchtitan", "--help").returncode == 0  # help needs none


def test_the_transformers_entry_points_without_transformers_name_the_extra(tmp_path: Path) -> None:
    env = without(tmp_path, "transformers")
    line = "needs the 'transformers' extra: pip install \"moeguard[transformers]\" (no module 'transformers')"
    # the library raises an ImportError (a user's `except ImportError` still catches it) whose
    # message is the one line; transformers' own ModuleNotFoundError is not shown with it
    for stmt, what in (
        ("from guard.integrations.hf_trainer import MoEGuardCallback", "guard.integrations.hf_trainer"),
        (
            "import torch; from guard.integrations.transformers import attach; attach(torch.nn.Linear(2, 2))",
            "guard.integrations.transformers.attach",
        ),
    ):
        caught = run(env, "-c", f"try:\n    {stmt}\nexcept ImportError as e:\n    print(e)")
        assert caught.returncode == 0 and what in caught.stdout and line in caught.stdout, caught.stderr
        raw = run(env, "-c", stmt)
        assert raw.returncode == 1
        assert raw.stderr.strip().splitlines()[-1].startswith("guard.extras.MissingExtra: ")
        assert line in raw.stderr and "ModuleNotFoundError" not in raw.stderr
        assert "During handling" not in raw.stderr
