"""A guard halt under plain `torchrun` (issue #37 item 5): torchrun still raises its ChildFailedError
for the ranks' exit 3 (only exit 0 avoids it, and a halt must not read as done), but its report
names the halt in the ranks' own words instead of "To enable traceback see: ..." (the ranks'
error files, guard/runtime/elastic.py). Real `torchrun --standalone --nproc-per-node 2` (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from guard.core import schema
from guard.runtime.elastic import ENV_ERROR_FILE, tell_launcher
from guard.store.reader import read_meta

REPO = Path(__file__).resolve().parents[2]
MICRO = REPO / "tests" / "data" / "micro.toml"
# a NaN every step from 6: the rollback at 6 finds the next one and the guard halts at 7
HALT = [
    *("--set", "guard.policy.snapshot_every=2", "--set", "guard.policy.rollback_after_skips=1"),
    *("--set", "guard.policy.rollback_skip_batches=0"),
    *(a for s in (6, 7, 8, 9) for a in ("--inject", f"nan@{s}")),
]


def test_the_error_file_is_what_torchruns_report_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "error.json"
    assert not tell_launcher("x")  # not under torchrun: nothing written
    monkeypatch.setenv(ENV_ERROR_FILE, str(f))
    assert tell_launcher("moeguard train: halted at step 7: why (exit 3)")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=3, error_file=str(f))
    assert failure.message["message"] == "moeguard train: halted at step 7: why (exit 3)"
    report = str(ChildFailedError("guard", {0: failure}))
    assert "traceback : moeguard train: halted at step 7: why (exit 3)" in report
    assert "To enable traceback" not in report
    monkeypatch.setenv(ENV_ERROR_FILE, str(tmp_path / "no" / "such" / "dir" / "e.json"))
    assert not tell_launcher("x")  # an unwritable file is no error of the run's


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_halt_under_plain_torchrun_names_itself_in_torchruns_report(tmp_path: Path, restarts: int) -> None:
    """restarts=1: torchrun relaunches the halted job, whose ranks refuse to resume it (exit 3)."""
    run_dir = tmp_path / "run"
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *(f"--max-restarts={restarts}", "-m", "guard", "train", "--config", str(MICRO)),
        *("--run-dir", str(run_dir), "--no-progress", "--steps", "20", *HALT),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop(schema.ENV_COLLECTOR, None)
    env.pop(ENV_ERROR_FILE, None)
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, p.stderr[-4000:]  # torchrun's own status for a failed child
    meta = read_meta(run_dir)
    assert meta is not None and meta["status"] == schema.STATUS_HALTED
    root = p.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "exitcode  : 3" in root and "To enable traceback" not in p.stderr, p.stderr[-4000:]
    said = next(ln for ln in root.splitlines() if ln.strip().startswith("traceback :"))
    if restarts == 0:
        assert said.strip() == f"traceback : moeguard train: {meta['status_note']} (exit 3)"
        assert "halted at step 7:" in said
    else:
        assert said.strip() == (
            f"traceback : moeguard train: {run_dir} is halted; not resuming it automatically "
            "(look at its halt event, then rerun with --resume) (exit 3)"
        )
