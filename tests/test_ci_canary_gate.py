"""The CI canary itself: scripts/ci-canary, the A/B canary between the last landed commit and this
tree, must pass (exit 1 is a slowdown of the step past canary.ab_fail_pct; a submission that leaves
guard/, trainer/ and configs/ as they were passes at once, with nothing to time).

It is a `serial` test so that scripts/test runs it as one job of its pinned serial phase, beside the
A/B timing tests, on a CPU of its own (MOEGUARD_PIN_WORKERS): it used to run after the whole suite
with the second core idle (~110 s). Its A and B still run back to back on that one core, pair after
pair in ABBA order, so a neighbour's load on the other core reaches both sides of a pair alike.
Measured there, A = A: -0.34% and -0.12% over 6 pairs, as alone (-0.16%). Beside the history gate's
bursty runs it read -1.73% and ran to its 12-pair cap, so those run after it, alone
(docs/BENCHMARKS.md "CI duration"). Its output is kept in test-output/ci-canary.log, which
scripts/test prints after the phase.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOG = REPO / "test-output" / "ci-canary.log"

pytestmark = [
    pytest.mark.serial(cost=110),  # seconds when it measures (6 pairs); ~1 s when it has nothing to time
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.skipif(
        not (REPO / ".git").exists(), reason="the CI canary compares git commits: not a checkout"
    ),
]


@pytest.mark.timeout(1800)
def test_the_submitted_tree_is_no_slower_than_the_last_landed_commit() -> None:
    LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(LOG, "w") as log:
        p = subprocess.run(
            [str(REPO / "scripts" / "ci-canary")],
            cwd=REPO,
            env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)},
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=1700,
        )
    said = LOG.read_text()
    assert p.returncode == 0, said[-4000:]
    assert "== CI canary: " in said, said[-4000:]
