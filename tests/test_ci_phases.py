"""scripts/test's parallel phase leaves out the tests scripts/test-wheel runs beside it against the
installed wheel (their non-`integration` tests), so each runs once: nothing the wheel does not run
is left out, and nothing it runs is run twice."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def collected(*args: str, wheel_runs: str | None) -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "MOEGUARD_WHEEL_RUNS"}
    if wheel_runs is not None:
        env["MOEGUARD_WHEEL_RUNS"] = wheel_runs
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {line for line in r.stdout.splitlines() if "::" in line}


def test_the_parallel_phase_leaves_out_exactly_what_the_wheel_runs() -> None:
    paths = subprocess.run(
        [str(REPO / "scripts" / "test-wheel"), "--tests"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert paths and all((REPO / p).exists() for p in paths), paths
    # with the variable, the wheel's paths keep exactly their `integration` tests (the wheel runs
    # the rest: `-m "not integration"`)
    phase = collected(*paths, wheel_runs=" ".join(paths))
    integration = collected(*paths, "-m", "integration", wheel_runs=None)
    assert phase == integration and any("test_app_pages.py" in t for t in phase)
