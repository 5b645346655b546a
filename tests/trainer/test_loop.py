"""The training loop end to end on the micro config: run store contents, resume, crash safety."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch

from guard.core import schema
from guard.store.reader import read_meta, read_table
from tests.conftest import MICRO, REPO, train_micro


def test_run_store_has_every_column_for_every_step(tmp_path: Path) -> None:
    t = train_micro(tmp_path / "r", overrides={"train.steps": 30})
    run = tmp_path / "r"
    steps = read_table(run, schema.TABLE_STEPS).sort("step")
    assert steps.columns == list(schema.STEPS_COLUMNS)
    assert steps["step"].to_list() == list(range(30))
    assert steps.null_count().sum_horizontal().item() == 0
    for col in ("loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"):
        assert steps[col].is_finite().all(), col
    # MFU needs a pinned peak for this machine class (configs/cpu_peaks.toml); without one it is
    # NaN on every step (tokens/s is the measure), never a self-measured guess
    if read_meta(run)["env"].get("peak_flops"):
        assert steps["mfu"].is_finite().all()
    else:
        assert steps["mfu"].is_nan().all()
    assert (steps["tokens"] == 4 * 32).all()
    layers = read_table(run, schema.TABLE_LAYERS)
    assert layers.columns == list(schema.LAYERS_COLUMNS)
    assert layers.height == 30 * 2 and layers.group_by("step").len()["len"].unique().to_list() == [2]
    experts = read_table(run, schema.TABLE_EXPERTS)
    assert experts.columns == list(schema.EXPERTS_COLUMNS)
    assert experts.height == 30 * 2 * 4
    # every token picks top_k=2 experts: per (step, layer) the loads sum to tokens * 2
    per = experts.group_by("step", "layer").agg(pl.col("load").sum())
    assert (per["load"] == 4 * 32 * 2).all()
    meta = read_meta(run)
    assert meta["status"] == schema.STATUS_FINISHED and meta["final_step"] == 30
    env = meta["env"]
    for key in (
        "torch",
        "cuda",
        "device",
        "peak_flops",
        "attention_backend",
        "expert_kernel",
        "compile",
        "dtype",
        "git_sha",
        "world_size",
    ):
        assert key in env, key
    assert env["expert_kernel"] == "bmm" and env["world_size"] == 1
    assert sum(t.state.counts.get(a, 0) for a in (*schema.APPLYING_ACTIONS, schema.ACT_SKIP)) == 30
    assert steps["action"].value_counts().height >= 1


def test_resume_continues_the_same_loss_trajectory(tmp_path: Path) -> None:
    straight = train_micro(tmp_path / "a", overrides={"train.steps": 30})
    del straight
    train_micro(tmp_path / "b", overrides={"train.steps": 30}, until=17)  # stops with a checkpoint at 17
    assert read_meta(tmp_path / "b")["status"] == schema.STATUS_RUNNING
    train_micro(tmp_path / "b", overrides={"train.steps": 30}, resume=True)
    a = read_table(tmp_path / "a", "steps").sort("step")
    b = read_table(tmp_path / "b", "steps").sort("step")
    assert b["step"].to_list() == list(range(30)), "resumed run must hold each step exactly once"
    # steps 17..29 come from the resumed process; on CPU with deterministic settings: bitwise
    assert a["loss"].to_list() == b["loss"].to_list()
    assert a["grad_norm"].to_list() == b["grad_norm"].to_list()


def test_a_crash_loses_at_most_the_last_chunk_and_resume_recovers(tmp_path: Path) -> None:
    run = tmp_path / "crash"
    cmd = [
        sys.executable,
        "-m",
        "guard",
        "train",
        "--config",
        str(MICRO),
        "--run-dir",
        str(run),
        "--no-progress",
        "--inject",
        "crash@23",
        "--steps",
        "40",
    ]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stderr[-2000:]
    steps = read_table(run, "steps")  # every part on disk is readable: nothing corrupted
    # The flushes: every flush_every = 7 steps, before each checkpoint (waited for: every row before
    # a checkpoint is on disk before it exists, guard/runtime/record.py) and on the step after an
    # event: parts 0-6, 7-9, 10, 11-17, 18-19, then 20 (the checkpoint's event) and 21 (step 20's
    # collapse-correction events), handed to the writer thread unwaited; 22 was never flushed. The
    # checkpoint at 20 holds 0-19 on disk; the parts after it may still have been in flight when the
    # kill came (20 was, 5 of 16 runs on a loaded box, clip_spikes on or off), and what is there is
    # whole parts.
    got = set(steps["step"].to_list())
    assert got in ({*range(20)}, {*range(21)}, {*range(22)}), sorted(got)
    assert read_meta(run)["status"] == schema.STATUS_RUNNING  # the process died without a word
    # the resume in this process (the kill -9 above is what needs its own process)
    assert train_micro(run, overrides={"train.steps": 40}, resume=True).exit_code == 0
    steps = read_table(run, "steps").sort("step")
    assert steps["step"].to_list() == list(range(40))
    events = read_table(run, "events")
    assert schema.EV_RESUME in events["kind"].to_list()
    assert read_meta(run)["restarts"] == 1


def test_loss_falls_on_the_stdlib_corpus(tmp_path: Path) -> None:
    train_micro(tmp_path / "r", overrides={"train.steps": 80})
    loss = read_table(tmp_path / "r", "steps").sort("step")["loss"].to_numpy()
    first, last = loss[:8].mean(), loss[-8:].mean()
    assert last < first - 1.0, (first, last)


def test_bad_config_names_the_key(tmp_path: Path) -> None:
    from guard.core.tomlconf import ConfigError
    from trainer.config import load_config

    with pytest.raises(ConfigError, match="model.experts_kernel"):
        load_config(MICRO, {"model.experts_kernel": "magic"})
    with pytest.raises(ConfigError, match="unknown key 'optim.learning_rate'"):
        load_config(MICRO, {"optim.learning_rate": 1.0})
    p = subprocess.run(
        [sys.executable, "-m", "guard", "train", "--config", str(MICRO), "--set", "train.steps=0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "train.steps = 0" in p.stderr


def test_missing_shards_fail_clearly(tmp_path: Path) -> None:
    from guard.core.tomlconf import ConfigError

    with pytest.raises(ConfigError, match="no .bin or .npy token shards"):
        train_micro(tmp_path / "r", overrides={"data.source": "shards", "data.path": str(tmp_path / "nope")})


def test_token_shards_train(tmp_path: Path) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    np.save(tmp_path / "shard0.npy", rng.integers(0, 256, 20_000).astype(np.uint16))
    rng.integers(0, 256, 20_000).astype(np.uint16).tofile(tmp_path / "shard1.bin")
    t = train_micro(
        tmp_path / "r", overrides={"data.source": "shards", "data.path": str(tmp_path), "train.steps": 5}
    )
    assert t.step == 5
    np.save(tmp_path / "bad.npy", np.full(5000, 70000, dtype=np.uint32))
    from guard.core.tomlconf import ConfigError

    with pytest.raises(ConfigError, match="token id 70000"):
        train_micro(
            tmp_path / "r2", overrides={"data.source": "shards", "data.path": str(tmp_path / "bad.npy")}
        )


def test_probe_makes_one_host_transfer_per_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Count Tensor.item / Tensor.cpu / Tensor.tolist calls made by the probe during one step."""
    from trainer.config import load_config
    from trainer.loop import Trainer

    cfg = load_config(MICRO, {"train.steps": 3})
    t = Trainer(cfg, tmp_path / "r", progress=False)
    t.train_step()  # warm up
    calls = {"item": 0, "cpu": 0, "tolist": 0, "numpy": 0}
    for name in calls:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    t.probe.collect(torch.tensor(1.0), 1)
    monkeypatch.undo()
    # one .cpu() (the transfer); .numpy() then only views that host copy
    assert calls["cpu"] == 1 and calls["item"] == 0 and calls["tolist"] == 0 and calls["numpy"] <= 1, calls
    t.store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_mfu_uses_a_measured_cpu_peak(tmp_path: Path) -> None:
    from trainer.flops import cpu_machine_class, load_cpu_peaks

    if cpu_machine_class() not in load_cpu_peaks():
        pytest.skip(f"no pinned CPU peak for {cpu_machine_class()} (python -m trainer.flops --pin)")
    t = train_micro(tmp_path / "r", overrides={"train.steps": 3})
    env = read_meta(tmp_path / "r")["env"]
    assert env["peak_flops"] and env["peak_flops"] > 1e8
    assert "measured" in env["peak_flops_source"]
    assert 0 < t.peak and math.isfinite(t.peak)
