"""Drills a team runs on its own framework (issue #37 item 4): `--inject` on the torchtitan launcher
and $MOEGUARD_INJECT under the transformers Trainer fire the faults of `moeguard train --inject`
for real (tiny models on the CPU, real torchrun with gloo); and the launcher's own endings
(item 5): a guard halt is one line and exit 3, a relaunch with nothing left to train says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from guard.core import schema
from guard.core.inject import ENV_INJECT
from guard.store.reader import read_table

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
PROG = "guard.integrations.torchtitan"


def env(**extra: str) -> dict[str, str]:
    e = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}
    for k in (schema.ENV_COLLECTOR, ENV_INJECT):
        e.pop(k, None)
    e.update(extra)
    return e


def titan(tmp: Path, *args: str, steps: int = 8, **extra: str) -> subprocess.CompletedProcess[str]:
    """The launcher starting its own single rank (torchrun --standalone underneath)."""
    cmd = [
        sys.executable,
        "-m",
        PROG,
        "--nproc-per-node",
        "1",
        "--module",
        "bench.common.torchtitan_registry",
    ]
    cmd += ["--config", "tiny_moe", "--training.steps", str(steps), "--dump_folder", str(tmp / "out")]
    cmd += ["--run-dir", str(tmp / "run"), *args]
    return subprocess.run(cmd, cwd=REPO, env=env(**extra), capture_output=True, text=True, timeout=400)


def share_of_expert_0(run: Path, layer: int) -> list[float]:
    x = read_table(run, "experts").filter(pl.col("layer") == layer)
    share = (pl.col("load").filter(pl.col("expert") == 0).sum() / pl.col("load").sum()).alias("share")
    return x.group_by("step").agg(share).sort("step")["share"].to_list()


def injected(run: Path) -> dict[int, str]:
    ev = read_table(run, "events").filter(pl.col("kind") == schema.EV_INJECT)
    return {s: json.loads(d)["injection"] for s, d in zip(ev["step"], ev["detail"], strict=True)}


def test_torchtitan_inject_fires_and_a_relaunch_with_nothing_to_train_says_so(tmp_path: Path) -> None:
    p = titan(tmp_path, "--inject", "collapse@3:1", "--inject", "nan@5")
    assert p.returncode == 0, p.stderr[-4000:]
    run = tmp_path / "run"
    assert injected(run) == {3: "collapse@3:1", 5: "nan@5"}
    steps = read_table(run, "steps").sort("step")
    assert steps["action"][5] == schema.ACT_SKIP and steps["grad_norm"].is_nan()[5]
    share = share_of_expert_0(run, 1)  # the forced collapse: layer 1 sends (nearly) all to expert 0
    assert max(share[:3]) < 0.35 and min(share[3:]) > 0.45, share
    # the same command again: torchtitan resumes its step-8 checkpoint, nothing is left to train
    again = titan(tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{PROG}: nothing to train: torchtitan resumed its checkpoint of step 8 in ")
    assert "--training.steps is 8; raise --training.steps to train on" in last


def test_a_guard_halt_ends_the_launcher_in_one_line_and_exit_3(tmp_path: Path) -> None:
    guard = tmp_path / "guard.toml"
    guard.write_text(
        "[guard.policy]\nsnapshot_every = 2\nrollback_after_skips = 1\nrollback_skip_batches = 0\n"
    )
    nans = [a for s in (6, 7, 8, 9) for a in ("--inject", f"nan@{s}")]
    p = titan(tmp_path, "--guard", str(guard), *nans, steps=14)
    assert p.returncode == 3, p.stderr[-4000:]
    out = p.stdout + p.stderr
    # not torchrun's ChildFailedError traceback (the launcher runs torchrun's launcher and catches it)
    assert "ChildFailedError" not in out and "torch/distributed/run.py" not in out, out[-4000:]
    lines = p.stderr.strip().splitlines()
    assert (
        lines[-1]
        == f"{PROG}: exit 3 on rank 0: the guard halted the run (rank 0's line above says where and why)"
    )
    [rank0] = [ln for ln in lines if ln.startswith(f"{PROG}: the run halted at step ")]
    assert rank0.endswith("(exit 3)") and "the checkpoint of torchtitan step" in rank0


def test_a_drill_past_the_last_step_is_one_line_echoing_it(tmp_path: Path) -> None:
    p = titan(tmp_path, "--inject", "nan@999")
    assert p.returncode == 2, p.stderr[-4000:]
    assert f"{PROG}: --inject nan@999: past the run's last step (7; the run has 8 steps" in p.stderr
    assert "raise --training.steps" in p.stderr and "nan@999:0" not in p.stderr
    assert "Traceback" not in p.stderr


def test_the_transformers_trainer_takes_drills_from_the_environment(tmp_path: Path) -> None:
    """MoEGuardCallback() with no inject=: $MOEGUARD_INJECT reaches its GuardedStep."""
    out = tmp_path / "job"
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "common" / "hf_trainer_job.py"),
            "--steps",
            "12",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=env(**{ENV_INJECT: "collapse@3:0,nan@5"}),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    run = out / "moeguard"
    assert injected(run) == {3: "collapse@3:0", 5: "nan@5"}
    actions = json.loads((out / "rank0.json").read_text())["actions"]
    assert [i for i, a in enumerate(actions) if a != schema.ACT_APPLY] == [5]
    share = share_of_expert_0(run, 0)  # top-2 of 8: every token's first choice is expert 0
    assert max(share[:3]) < 0.3 and min(share[3:]) > 0.4, share
