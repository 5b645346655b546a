"""MoEGuardCallback across a transformers `Trainer` resume (tiny Mixtral, CPU, the real Trainer).

Each run is bench/common/hf_trainer_job.py in this process: a first Trainer saves checkpoint-20 (and 40),
then a NEW Trainer with a NEW callback resumes from checkpoint-20 (a path, moved out of output_dir,
or `resume_from_checkpoint=True`) and trains to 40. What must hold:
the guard's state comes back exactly as it was saved in checkpoint-20/moeguard_guard.pt; the run
store holds every step once (the first attempt's rows after 20 dropped), meta.json counts the
restart and a resume event names the checkpoint; a x50 spike right after the resume is skipped by
the restored baselines (clip_spikes off), where the same spike on a guard that lost its state is applied; a
checkpoint saved without the callback resumes with a warning naming the missing file. (The same
resume on 2 ranks under torchrun is test_hf_trainer.py's, on its 2-rank run.)
"""

from __future__ import annotations

import json
import math
import shutil
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate: pip install accelerate")

from bench.common.hf_trainer_job import main as job  # noqa: E402
from guard.api import GuardedStep  # noqa: E402
from guard.core import schema  # noqa: E402
from guard.integrations.hf_resume import GUARD_STATE_FILE  # noqa: E402
from guard.store.reader import read_meta, read_table  # noqa: E402

pytestmark = [pytest.mark.slow]
RUN = ["--steps", "40", "--save-steps", "20"]  # checkpoint-20 and checkpoint-40


def same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two state dicts differ (tensors and arrays exactly, NaN equal to NaN); [] if nowhere."""
    if isinstance(a, deque | tuple):
        a = list(a)
    if isinstance(b, deque | tuple):
        b = list(b)
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{where}[{i}]")]
    if torch.is_tensor(a) or torch.is_tensor(b):
        ok = torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
        return [] if ok else [f"{where}: tensors differ"]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b, equal_nan=True) else [f"{where}: arrays differ"]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.fixture(scope="module")
def first_attempt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], int]:
    """The guarded first attempt (steps 0..39, checkpoint-20 and -40), run once for the tests that
    resume it (each on its own copy: `resumable`), with how many guard states it loaded."""
    out = tmp_path_factory.mktemp("first") / "out"
    real = GuardedStep.load_state_dict
    calls: list[str] = []

    def spy(self: GuardedStep, s: dict[str, Any], *, checkpoint: str = "") -> None:
        calls.append(checkpoint)
        real(self, s, checkpoint=checkpoint)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GuardedStep, "load_state_dict", spy)
        res = job([*RUN, "--out", str(out)])
    return out, res, len(calls)


def resumable(first_attempt: tuple[Path, dict[str, Any], int], tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A copy of the first attempt's output_dir (checkpoints and run store) and its result."""
    out = tmp_path / "out"
    shutil.copytree(first_attempt[0], out)
    return out, first_attempt[1]


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict[str, Any], str]]:
    """Each GuardedStep.load_state_dict call: the guard's state right after it, and the checkpoint named."""
    seen: list[tuple[dict[str, Any], str]] = []
    real = GuardedStep.load_state_dict

    def spy(self: GuardedStep, s: dict[str, Any], *, checkpoint: str = "") -> None:
        real(self, s, checkpoint=checkpoint)
        seen.append((self.state_dict(), checkpoint))

    monkeypatch.setattr(GuardedStep, "load_state_dict", spy)
    return seen


def test_resume_restores_the_guards_state_and_the_run_store_keeps_each_step_once(
    tmp_path: Path, loaded: list[tuple[dict[str, Any], str]], first_attempt: tuple[Path, dict[str, Any], int]
) -> None:
    out, first = resumable(first_attempt, tmp_path)
    saved = torch.load(out / "checkpoint-20" / GUARD_STATE_FILE, weights_only=False)
    assert saved["step"] == 20 and saved["counts"] == {schema.ACT_APPLY: 20}
    assert saved["guard"]["detectors"]["grad_spike"]["n_accepted"] == 20  # a baseline worth keeping
    assert first_attempt[2] == 0 and not loaded  # a fresh start loads nothing

    # moved out of output_dir (copied off a cluster, say): found from the path train() was given
    moved = tmp_path / "kept" / "checkpoint-20"
    shutil.move(out / "checkpoint-20", moved)
    resumed = job([*RUN, "--out", str(out), "--resume", str(moved)])
    assert len(loaded) == 1
    state, checkpoint = loaded[0]
    assert Path(checkpoint) == moved
    # goodput books the time since the save as restarts_s (issue #40): the rest as it was saved
    assert state.pop("saved_at") > saved.pop("saved_at")
    assert state["goodput"]["split"].pop("restarts_s") > saved["goodput"]["split"].pop("restarts_s")
    assert same(state, saved) == []  # every baseline, window, counter as it was saved
    assert resumed["global_step"] == 40 and len(resumed["actions"]) == 20  # steps 20..39 only
    assert resumed["weights"] == first["weights"]  # a faithful resume: the same end as one run
    # carried on from 20 to 40, not rebuilt from nothing
    end = torch.load(out / "checkpoint-40" / GUARD_STATE_FILE, weights_only=False)
    assert end["step"] == 40 and end["counts"] == {schema.ACT_APPLY: 40}
    assert end["guard"]["detectors"]["loss_spike"]["n_accepted"] == 40

    run = out / "moeguard"
    steps = read_table(run, schema.TABLE_STEPS).sort("step")
    assert steps["step"].to_list() == list(range(40))  # each step once: the first attempt's tail was dropped
    assert read_table(run, schema.TABLE_LAYERS)["step"].value_counts()["count"].unique().to_list() == [4]
    meta = read_meta(run)
    assert meta["status"] == schema.STATUS_FINISHED and meta["restarts"] == 1
    events = read_table(run, schema.TABLE_EVENTS)
    resumes = events.filter(pl.col("kind") == schema.EV_RESUME)
    assert resumes["step"].to_list() == [20]
    detail = json.loads(resumes["detail"].item())
    assert detail["checkpoint"] == "checkpoint-20" and detail["restarts"] == 1
    assert detail["rows_dropped"] > 0  # steps 20..39 of the first attempt (and their layer/expert rows)
    saves = events.filter(pl.col("kind") == schema.EV_CHECKPOINT)
    assert [json.loads(d)["path"] for d in saves["detail"]] == ["checkpoint-40"]  # 20's went with the tail


def test_a_spike_right_after_the_resume_is_skipped_by_the_restored_baselines(
    tmp_path: Path, first_attempt: tuple[Path, dict[str, Any], int]
) -> None:
    out, _ = resumable(first_attempt, tmp_path)
    # clip_spikes off: the skip shows the restored baselines flagged the spike, bitwise (the
    # default would apply it, clipped within the grad clip, like the guard that lost its state)
    cfg = tmp_path / "skip-spikes.toml"
    cfg.write_text("[policy]\nclip_spikes = false\n")
    spike = ["--inject", "gradspike@20:50", "--guard", str(cfg)]  # the first optimizer step after the resume
    shutil.rmtree(out / "checkpoint-40")  # so `resume_from_checkpoint=True` finds checkpoint-20
    kept = job([*RUN, "--out", str(out), "--resume", "last", *spike])
    assert kept["actions"][0] == schema.ACT_SKIP, kept["actions"]
    assert kept["checks"]["20"] == {"weights": True, "optimizer": True, "lr": True, "scheduler": True}
    assert set(kept["actions"][1:]) == {schema.ACT_APPLY}

    # the same resume, the same spike, with the guard's state gone: a guard warming up applies it
    shutil.rmtree(out / "checkpoint-40")
    (out / "checkpoint-20" / GUARD_STATE_FILE).unlink()
    with pytest.warns(UserWarning, match=GUARD_STATE_FILE):
        lost = job([*RUN, "--out", str(out), "--resume", "last", *spike])
    assert lost["actions"][0] == schema.ACT_APPLY, lost["actions"]
    assert not lost["checks"]["20"]["weights"]  # the x50 update landed


def test_a_checkpoint_saved_without_the_callback_resumes_with_a_warning(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job([*RUN, "--out", str(out), "--no-guard"])
    assert not (out / "checkpoint-20" / GUARD_STATE_FILE).exists() and not (out / "moeguard").exists()
    missing = str(out / "checkpoint-20" / GUARD_STATE_FILE)
    with pytest.warns(UserWarning, match="no moeguard_guard.pt") as caught:
        res = job([*RUN, "--out", str(out), "--resume", str(out / "checkpoint-20")])
    assert any(missing in str(w.message) for w in caught)  # names the file it looked for
    assert res["global_step"] == 40 and set(res["actions"]) == {schema.ACT_APPLY}
    run = out / "moeguard"
    assert read_table(run, schema.TABLE_STEPS).sort("step")["step"].to_list() == list(range(20, 40))
    resumes = read_table(run, schema.TABLE_EVENTS).filter(pl.col("kind") == schema.EV_RESUME)
    assert resumes["step"].to_list() == [20]
    assert "started afresh" in json.loads(resumes["detail"].item())["guard_state"]
    assert read_meta(run)["status"] == schema.STATUS_FINISHED
    # the guard's own state is in the checkpoint it saves next, numbered by the Trainer's steps
    end = torch.load(out / "checkpoint-40" / GUARD_STATE_FILE, weights_only=False)
    assert end["step"] == 40 and end["counts"] == {schema.ACT_APPLY: 20}
