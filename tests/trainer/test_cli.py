"""What a user sees from `moeguard train`: refusals that name the problem and the fix, --help that
explains every injection, one line per guard action above the progress bar.

Each test runs the real CLI (`python -m guard train`) on the micro config in a subprocess (a run that
must merely be there first is trained in this process).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from guard.core import schema
from guard.store.reader import read_meta, read_table
from tests.conftest import MICRO, REPO, train_micro


def train(run: Path | None, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    where = ["--run-dir", str(run)] if run is not None else []
    cmd = [
        sys.executable,
        "-m",
        "guard",
        "train",
        "--config",
        str(MICRO),
        *where,
        "--set",
        "train.threads=1",
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def one_line_error(p: subprocess.CompletedProcess) -> str:
    """The single line a refusal prints (exit 2, no traceback)."""
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_run_dir_that_holds_a_run_is_refused_without_resume(tmp_path: Path) -> None:
    run = tmp_path / "r"
    # the run that is there already: trained in this process (the refusal and the resume are the CLI's)
    t = train_micro(run, overrides={"train.steps": 3, "train.threads": 1})
    assert t.exit_code == 0
    meta_before = (run / schema.META_FILE).read_bytes()

    p = train(run, "--steps", "3", "--no-progress")
    line = one_line_error(p)
    assert str(run) in line and "already holds a run" in line and "status finished, 3 steps" in line
    assert "--resume" in line and "new --run-dir" in line
    # nothing was appended or overwritten
    assert (run / schema.META_FILE).read_bytes() == meta_before
    assert read_table(run, schema.TABLE_STEPS)["step"].sort().to_list() == [0, 1, 2]

    # what the message suggests works: --resume continues the same run
    p = train(run, "--steps", "5", "--resume", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_table(run, schema.TABLE_STEPS)["step"].sort().to_list() == [0, 1, 2, 3, 4]
    assert read_meta(run)["restarts"] == 1


def test_an_empty_existing_run_dir_is_fine(tmp_path: Path) -> None:
    run = tmp_path / "made-by-hand"
    run.mkdir()
    p = train(run, "--steps", "2", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_meta(run)["status"] == schema.STATUS_FINISHED


def test_an_injection_past_the_last_step_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "r"
    line = one_line_error(train(run, "--steps", "3", "--inject", "nan@500", "--no-progress"))
    assert "nan@500" in line and "3 steps" in line and "never fire" in line
    line = one_line_error(train(run, "--steps", "3", "--inject", "gradspike@1:50", "--inject", "stall@3:2"))
    assert "stall@3:2" in line and "gradspike" not in line  # the last step is 2
    assert not run.exists(), "a refused run writes nothing"


def test_train_help_says_what_arg_means_for_every_inject_kind() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "guard", "train", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    for kind in schema.INJECT_KINDS:
        [line] = [ln for ln in p.stdout.splitlines() if re.match(rf"\s+{kind}@STEP\b", ln)]
        assert "ARG" in line, line  # "ARG = ..." or "no ARG: ..."
    assert re.search(r"gradspike@STEP:ARG\s+ARG = factor every gradient is scaled by", p.stdout)
    assert re.search(r"collapse@STEP:ARG\s+ARG = MoE layer", p.stdout)
    assert re.search(r"stall@STEP:ARG\s+ARG = seconds", p.stdout)
    assert "143" in p.stdout and "preempted" in p.stdout  # the exit statuses are documented


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuDNN attention may run on a GPU")
def test_an_unavailable_attention_backend_is_one_line_naming_what_is_available(tmp_path: Path) -> None:
    line = one_line_error(
        train(tmp_path / "r", "--steps", "2", "--set", "model.attention=cudnn", "--no-progress")
    )
    assert "model.attention='cudnn' is not available on cpu" in line
    available = line.split("available here: ")[1].split(" (")[0].split(", ")
    assert "math" in available and "cudnn" not in available
    assert not (tmp_path / "r").exists()


def test_guard_actions_print_one_line_each_above_the_progress_bar(tmp_path: Path) -> None:
    # three NaN steps in a row: skip, skip, then a rollback to the snapshot at step 10; the
    # profiler window (steps 5..8) runs too, and kineto's USDT lines must not reach the terminal
    p = train(
        tmp_path / "r",
        "--steps",
        "20",
        "--set",
        "guard.policy.snapshot_every=5",
        "--set",
        "guard.collapse.enabled=false",
        "--set",
        "telemetry.profile=true",
        "--inject",
        "nan@12",
        "--inject",
        "nan@13",
        "--inject",
        "nan@14",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    err = p.stderr
    # captured, stderr is no terminal: no bar (its redraws flooded CI logs, issue #40), plain
    # progress lines instead (the bar on a terminal: tests/trainer/test_console.py)
    assert "%|" not in err and "\r" not in err, err[-3000:]
    assert re.search(r"^progress r: step 20/20 \| ", err, re.M), err[-3000:]
    assert "USDT" not in err, err[-3000:]
    # each guard line stands on a line of its own: the bar is cleared before it and redrawn after
    lines = re.split(r"[\r\n]", err)
    said = [ln.rstrip() for ln in lines if ln.startswith("guard step")]
    assert said == [
        "guard step 12: skip <- nonfinite grad_norm layers [1]",
        "guard step 13: skip <- nonfinite grad_norm layers [1]",
        "guard step 14: rollback to the snapshot of step 10, 20 batches skipped, LR x0.5 for 50 steps "
        "<- nonfinite grad_norm layers [1]",
    ], said
    for s in said:
        assert re.search(rf"(^|[\r\n]){re.escape(s)}\n", err), s
