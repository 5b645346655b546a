"""Run status matches what happened: SIGTERM (preemption), Ctrl-C, a run that ended non-finite.

Each signal test runs the real CLI (`python -m guard train`) on the micro config in a subprocess
and signals it the way a scheduler or a user would (a resume after it is trained in this process).
The non-finite run, which no signal ends, runs the CLI's entry point in this process, as does its
guarded twin.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from guard.core import schema
from guard.store.reader import read_meta, read_table
from tests.conftest import MICRO, REPO, train_micro
from trainer.checkpoint import list_checkpoints
from trainer.outcome import EXIT_INTERRUPTED, EXIT_PREEMPTED


def train_cmd(run: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "guard",
        "train",
        "--config",
        str(MICRO),
        "--run-dir",
        str(run),
        "--no-progress",
        "--set",
        "train.threads=1",
        *args,
    ]


def start_long_run(run: Path) -> subprocess.Popen:
    """A run far longer than the test (checkpoints only every 1000 steps), once it has flushed
    its first chunk of steps (flush_every = 7): it is mid-run, past start-up."""
    p = subprocess.Popen(
        train_cmd(run, "--steps", "5000", "--set", "train.checkpoint_every=1000"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not list((run / schema.TABLE_STEPS).glob("part-*.parquet")):
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never flushed a chunk of steps"
        time.sleep(0.1)
    return p


def test_sigterm_checkpoints_marks_preempted_and_resume_continues(tmp_path: Path) -> None:
    run = tmp_path / "r"
    p = start_long_run(run)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_PREEMPTED == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    meta = read_meta(run)
    assert meta["status"] == schema.STATUS_PREEMPTED
    stopped = meta["final_step"]  # steps run: 0 .. stopped - 1
    assert 7 <= stopped < 5000
    [ckpt] = list_checkpoints(run / schema.CHECKPOINT_DIR)  # none was due before step 1000
    assert ckpt.name == f"step-{stopped:09d}"
    assert (
        "SIGTERM" in meta["status_note"]
        and ckpt.name in meta["status_note"]
        and "--resume" in meta["status_note"]
    )
    assert f"status {schema.STATUS_PREEMPTED}" in out and "SIGTERM" in err
    assert read_table(run, schema.TABLE_STEPS)["step"].sort().to_list() == list(range(stopped))

    # the resume in this process (what the signal did is what needed the subprocess)
    t = train_micro(run, overrides={"train.steps": 5000}, resume=True, until=stopped + 3)
    assert t.exit_code == 0
    steps = read_table(run, schema.TABLE_STEPS).sort("step")
    assert steps["step"].to_list() == list(range(stopped + 3)), "the resumed run continues where it stopped"
    events = read_table(run, schema.TABLE_EVENTS)
    resume = events.filter(pl.col("kind") == schema.EV_RESUME)
    assert resume["step"].to_list() == [stopped]
    meta = read_meta(run)
    assert (
        meta["status"] == schema.STATUS_RUNNING
        and meta["restarts"] == 1
        and meta["final_step"] == stopped + 3
    )


def test_ctrl_c_marks_interrupted_with_a_note(tmp_path: Path) -> None:
    run = tmp_path / "r"
    p = start_long_run(run)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_INTERRUPTED == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted" in err, err[-3000:]
    meta = read_meta(run)
    assert meta["status"] == schema.STATUS_INTERRUPTED
    assert "Ctrl-C" in meta["status_note"] and f"step {meta['final_step']}" in meta["status_note"]


def test_a_run_that_ended_nonfinite_is_marked_and_its_nan_steps_are_badput(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    from guard.cli import main

    run = tmp_path / "nan"
    # the CLI's own entry point in this process (no signal here, so no subprocess: its exit code and
    # what it writes to stdout and stderr are what is judged); torch's thread count is put back
    threads = torch.get_num_threads()
    capfd.readouterr()
    try:
        code = main(train_cmd(run, "--steps", "12", "--no-guard", "--inject", "nan@5")[3:])
    finally:
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    meta = read_meta(run)
    assert meta["status"] == schema.STATUS_FINISHED_NONFINITE
    assert meta["nonfinite_steps"] == 7  # steps 5..11: the NaN update, then NaN weights
    assert "step 5" in meta["status_note"]
    assert f"status {schema.STATUS_FINISHED_NONFINITE}" in out
    assert "step 5:" in err and "non-finite" in err
    gp = meta["goodput"]
    steps = read_table(run, schema.TABLE_STEPS).sort("step")
    assert steps["loss"][:6].is_finite().all() and not steps["grad_norm"][5:].is_finite().any()
    assert not steps["loss"][6:].is_finite().any()  # the NaN update went into the weights
    assert gp["nonfinite_s"] > 0
    # only steps 0..4 count as productive: their compute, not the NaN steps'
    compute = (steps["step_time_s"] - steps["data_wait_s"]).to_list()
    assert abs(gp["productive_s"] - sum(compute[:5])) < 1e-6
    assert abs(gp["nonfinite_s"] - sum(compute[5:])) < 1e-6

    # the same fault with the guard on: skipped, so the run ends finite and "finished"
    guarded = tmp_path / "guarded"  # in this process: its meta.json is what is judged
    assert train_micro(guarded, overrides={"train.steps": 12}, injections=["nan@5"]).exit_code == 0
    meta = read_meta(guarded)
    assert meta["status"] == schema.STATUS_FINISHED and meta["nonfinite_steps"] == 0
    assert meta["goodput"]["nonfinite_s"] == 0 and meta["goodput"]["skipped_s"] > 0


@pytest.mark.slow
@pytest.mark.integration
def test_sigterm_to_torchrun_stops_every_rank_at_the_same_step_with_one_checkpoint(tmp_path: Path) -> None:
    """torchrun forwards SIGTERM to its workers, which may be at different steps when it lands:
    the flag rides in the step's all-reduce, so both ranks stop after the same step and write
    the (collective) checkpoint together; the run resumes from it on one process."""
    from tests.trainer.test_distributed import descendants

    run = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "guard",
        "train",
        "--config",
        str(MICRO),
        "--run-dir",
        str(run),
        "--no-progress",
        "--steps",
        "5000",
        "--set",
        "train.checkpoint_every=1000",
        "--set",
        "train.threads=1",
    ]
    env = {k: v for k, v in os.environ.items() if k != schema.ENV_COLLECTOR}
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not list((run / schema.TABLE_STEPS).glob("part-*.parquet")):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler would
        _, err = p.communicate(timeout=120)
    finally:
        for pid in [p.pid, *descendants(p.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(timeout=30)
    meta = read_meta(run)
    assert meta["status"] == schema.STATUS_PREEMPTED, err[-3000:]
    stopped = meta["final_step"]
    [ckpt] = list_checkpoints(run / schema.CHECKPOINT_DIR)
    assert ckpt.name == f"step-{stopped:09d}" and ckpt.name in meta["status_note"]
    assert (ckpt / "rng-r0.pt").is_file() and (ckpt / "rng-r1.pt").is_file(), "both ranks saved"
    # one process: this one
    assert train_micro(run, overrides={"train.steps": 5000}, resume=True, until=stopped + 2).exit_code == 0
    assert read_table(run, schema.TABLE_STEPS)["step"].sort().to_list() == list(range(stopped + 2))


def test_sigterm_to_the_demo_stops_the_demo_not_just_its_current_run(tmp_path: Path) -> None:
    """A user who stops `moeguard demo` wants it stopped: the run SIGTERM lands in is preempted
    (checkpointed) and the demo's other runs are never started."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "guard", "demo", "--config", str(MICRO), "--steps", "5000"]
    cmd += ["--runs", str(runs), "--threads", "1", "--no-progress"]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not list(runs.glob(f"demo-*/{schema.TABLE_STEPS}/part-*.parquet")):
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the demo's first run never flushed a chunk of steps"
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_PREEMPTED, err[-3000:]
    [run] = list(runs.iterdir())  # the faulty runs never started
    assert run.name.endswith("-clean") and read_meta(run)["status"] == schema.STATUS_PREEMPTED
    assert "demo stopped" in out and "preempted" in out
