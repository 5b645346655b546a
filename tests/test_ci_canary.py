"""scripts/ci-canary measures only when the submitted tree changes the code its worker runs.

The canary's worker (trainer/canary_worker.py) runs guard/ and trainer/ code with configs/; both sides
share the venv's packages. A submission that changes none of them (docs, tests, alerts, dashboards)
would time A's code against itself: the script says so and passes at once. A change in guard/ or
trainer/ outside the files a short run of the worker loads (the collector, the app, the CLI) passes
after that run (~5 s). A change to a loaded file or configs/, arguments for the canary, or
MOEGUARD_CI_CANARY=always go on to the A/B measurement, shown here up to `moeguard canary` refusing a
bad --set, or up to the measurement's first line, so the tests stay seconds long.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A fresh clone of this repository's HEAD (CI's situation: a clean tree), with the checkout's
    own scripts/ci-canary (the one under test, committed or not; scripts/ is not step code)."""
    dst = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(dst)], check=True)
    shutil.copy2(REPO / "scripts" / "ci-canary", dst / "scripts" / "ci-canary")
    return dst


def ci_canary(clone: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    # not the caller's MOEGUARD_CI_CANARY (`MOEGUARD_CI_CANARY=always scripts/test` measures the CI
    # canary itself): each case here sets what it tests
    inherited = {k: v for k, v in os.environ.items() if k != "MOEGUARD_CI_CANARY"}
    return subprocess.run(
        [str(clone / "scripts" / "ci-canary"), *args],
        cwd=clone,
        env={**inherited, "BASE": "HEAD", "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_unchanged_step_code_is_not_measured(clone: Path) -> None:
    (clone / "README.md").write_text((clone / "README.md").read_text() + "\nA docs change.\n")
    (clone / "tests" / "test_new.py").write_text("def test_x() -> None:\n    pass\n")
    p = ci_canary(clone)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "guard trainer configs unchanged in the submitted tree" in p.stdout
    assert "nothing to measure" in p.stdout and "B = " not in p.stdout
    assert not (clone / "test-output" / "ci-canary").exists()  # no worktree, no venvs, no worker


def test_a_change_outside_what_the_worker_loads_is_not_measured(clone: Path) -> None:
    path = clone / "guard" / "collector" / "service.py"
    path.write_text(path.read_text() + "\n# changed\n")
    p = ci_canary(clone)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "guard/ and trainer/ files the worker loads changed" in p.stdout, p.stdout + p.stderr
    assert "nothing to measure" in p.stdout and "B = " not in p.stdout
    assert not (clone / "test-output" / "ci-canary").exists()  # no worktree, no venvs


def test_a_change_to_a_file_the_worker_loads_is_measured(clone: Path) -> None:
    path = clone / "guard" / "core" / "schema.py"  # the store's schema: the worker's trainer loads it
    path.write_text(path.read_text() + "\n# changed\n")
    inherited = {k: v for k, v in os.environ.items() if k != "MOEGUARD_CI_CANARY"}
    p = subprocess.Popen(
        [str(clone / "scripts" / "ci-canary")],
        cwd=clone,
        env={**inherited, "BASE": "HEAD", "PYTHON": sys.executable},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    try:
        assert p.stdout is not None
        for line in p.stdout:  # up to the measurement's first line, then stop it
            seen.append(line)
            if "B = the submitted tree" in line or "nothing to measure" in line:
                break
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    out = "".join(seen)
    assert "B = the submitted tree" in out and "nothing to measure" not in out, out


@pytest.mark.parametrize(
    "change",
    ["trainer/loop.py", "configs/canary.toml", "guard/new_module.py", "always"],
)
def test_a_change_to_the_step_code_is_measured(clone: Path, change: str) -> None:
    env = {}
    if change == "always":
        env["MOEGUARD_CI_CANARY"] = "always"
    else:
        path = clone / change
        path.write_text((path.read_text() if path.exists() else "") + "\n# changed\n")
    p = ci_canary(clone, "--set", "canary.no_such_key=1", **env)
    assert "nothing to measure" not in p.stdout
    assert "B = the submitted tree" in p.stdout, p.stdout + p.stderr
    # it went on to `moeguard canary`, which refuses the bad key by name (usage: exit 2)
    assert p.returncode == 2 and "no_such_key" in p.stderr, p.stdout + p.stderr
