"""MoEGuardCallback on the real transformers 5 `Trainer` (tiny Mixtral and DeepSeek-V3, CPU).

Each run is bench/common/hf_trainer_job.py: a real Trainer (accelerate's AcceleratedOptimizer, a cosine LR
schedule with warm-up, max_grad_norm 1.0, gradient accumulation), the faults injected into the
reduced gradients just before the guard decides. What must hold: with clip_spikes off, a spike and a
NaN are skipped with weights, AdamW state, LR and LR schedule bitwise unchanged; the guard decides
once per OPTIMIZER step and its loss is the loss the Trainer logs; a rollback restores the snapshot
and skips the data window; a forced collapse is corrected through the model; on 2 ranks (DDP on
gloo, real torchrun, the default policy) both ranks keep the spike alike (flagged, applied within
the grad clip) and skip the NaN alike and end with the same weights, and a new torchrun launch
resumed from that run's checkpoint-40 restores the guard's state on both ranks (the 2-rank resume
test shares the 2-rank launch, so it lives here, not in test_hf_trainer_resume.py); the Trainer's
clip setting is given back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate: pip install accelerate")

from bench.common.hf_trainer_job import main as job  # noqa: E402
from guard.core import schema  # noqa: E402
from guard.integrations.hf_resume import GUARD_STATE_FILE  # noqa: E402
from guard.store.reader import read_meta, read_table  # noqa: E402

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def logged_losses(res: dict) -> list[float]:
    return [h["loss"] for h in res["log_history"] if "loss" in h and "train_loss" not in h]


def skip_spikes(tmp_path: Path, extra: str = "") -> Path:
    """A guard config with clip_spikes off: the skip path, what every NaN and loss spike gets (the
    default clips a finite grad spike, applied within the grad clip here: nothing to hold still)."""
    cfg = tmp_path / "skip-spikes.toml"
    cfg.write_text(f"[policy]\nclip_spikes = false\n{extra}")
    return cfg


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_spike_and_nan_are_skipped_bitwise_with_the_schedule_held(family: str, tmp_path: Path) -> None:
    steps, spike, nan = 60, 45, 50
    res = job(
        [
            "--family",
            family,
            "--steps",
            str(steps),
            "--grad-accum",
            "2",
            "--out",
            str(tmp_path / "out"),
            "--inject",
            f"gradspike@{spike}:1000",
            "--inject",
            f"nan@{nan}",
            "--guard",
            str(skip_spikes(tmp_path)),  # the skip path for the spike too (the default keeps it)
        ]
    )
    # every state the step could touch, bitwise (weights, AdamW moments and step, LR, schedule)
    for step in (spike, nan):
        assert res["checks"][str(step)] == {
            "weights": True,
            "optimizer": True,
            "lr": True,
            "scheduler": True,
        }, (step, res["checks"])
    assert [(i, a) for i, a in enumerate(res["actions"]) if a != schema.ACT_APPLY] == [
        (spike, schema.ACT_SKIP),
        (nan, schema.ACT_SKIP),
    ]
    # the LR schedule stood still on each skipped step and moved on every applied one
    lrs = res["lrs"]
    assert lrs[spike] == lrs[spike - 1] and lrs[nan] == lrs[nan - 1]
    assert all(lrs[i] != lrs[i - 1] for i in range(10, steps) if i not in (spike, nan))
    # one decision per optimizer step (2 micro-batches each), the Trainer's own loss
    run = tmp_path / "out" / "moeguard"  # the callback's default run store: <output_dir>/moeguard
    rows = read_table(run, "steps").sort("step")
    assert rows.height == steps == res["global_step"]
    assert (rows["tokens"] == 2 * 4 * 64).all()
    np.testing.assert_allclose(rows["loss"].to_numpy(), logged_losses(res), rtol=1e-6)
    # the Trainer's logging kept working, with the unclipped norm it computes itself
    grad_norms = [h["grad_norm"] for h in res["log_history"] if "grad_norm" in h]
    assert len(grad_norms) == steps and all(np.isfinite(grad_norms[i]) for i in range(steps) if i != nan)
    assert res["max_grad_norm_after"] == 1.0  # the clip moved into the guard and came back
    assert res["lr_bound"] == 3e-3  # the schedule's peak, though the warm-up starts at 0
    meta = json.loads((run / "meta.json").read_text())
    assert meta["flops_per_token"] > 0  # counted from the model and the first batch (MFU)
    events = read_table(run, "events")
    fired = events.filter(pl.col("kind") == schema.EV_VERDICT)
    assert set(fired["step"].to_list()) == {spike, nan}
    assert "nonfinite" in fired.filter(pl.col("step") == nan)["detector"].to_list()


def test_rollback_restores_the_snapshot_and_skips_the_data_window(tmp_path: Path) -> None:
    # skips of the spikes: a clip would count towards the rollback alike, but leave 52 and 53 applied
    cfg = skip_spikes(tmp_path, "rollback_skip_batches = 2\n")
    spikes = [52, 53, 54]  # three skips inside the skip window -> a rollback at the third
    res = job(
        [
            "--steps",
            "60",
            "--out",
            str(tmp_path / "out"),
            "--guard",
            str(cfg),
            "--record-weights",
            *[x for s in spikes for x in ("--inject", f"gradspike@{s}:1000")],
        ]
    )
    acts = {i: a for i, a in enumerate(res["actions"]) if a != schema.ACT_APPLY}
    assert acts == {
        52: schema.ACT_SKIP,
        53: schema.ACT_SKIP,
        54: schema.ACT_ROLLBACK,
        55: "skip",
        56: "skip",
    }, acts
    events = read_table(tmp_path / "out" / "moeguard", "events")
    rb = events.filter((pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_ROLLBACK))
    restored = json.loads(rb["detail"][0])["restored_step"]
    assert restored == 50  # the newest snapshot (every 25 steps) before the incident
    hashes = res["hashes"]
    # the snapshot labelled 50 is the state after 50 applied steps (indices 0..49)
    assert hashes[54] == hashes[49] != hashes[53]
    assert hashes[55] == hashes[56] == hashes[54]  # the data window: no update
    assert hashes[57] != hashes[56]
    lrs = res["lrs"]
    assert lrs[51] == lrs[52] == lrs[53] == lrs[54] == lrs[55] == lrs[56] != lrs[57]  # schedule held


def test_forced_collapse_is_corrected_through_the_model(tmp_path: Path) -> None:
    cfg = tmp_path / "guard.toml"
    cfg.write_text("[collapse]\nwarmup = 60\n")  # tiny models settle fast (see test_integration_transformers)
    layer, at = 2, 80
    job(
        [
            "--steps",
            "200",
            "--out",
            str(tmp_path / "out"),
            "--guard",
            str(cfg),
            "--balance-coef",
            "0.01",
            "--inject",
            f"collapse@{at}:{layer}",
        ]
    )
    run = tmp_path / "out" / "moeguard"
    events = read_table(run, "events")
    maxvio = read_table(run, "layers").filter(pl.col("layer") == layer).sort("step")["maxvio"]
    assert maxvio[at] == pytest.approx(3.0)  # every token to expert 0
    acts = events.filter((pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_BIAS_CORRECT))
    assert acts.height >= 1 and acts["step"].min() > at, acts
    assert f'"layer": {layer}' in acts["detail"][0] and '"mode": "aux_loss"' in acts["detail"][0]
    rec = events.filter(pl.col("kind") == schema.EV_RECOVERED)
    assert rec.height >= 1
    assert float(maxvio.slice(rec["step"].min(), 20).median()) < 1.0
    # corrected without throwing training away: every step's update applied (the correction's
    # opening step is recorded as bias_correct, an applying action)
    assert read_table(run, "steps")["action"].is_in(list(schema.APPLYING_ACTIONS)).all()


# The 2-rank job: one torchrun launch (each rank pays transformers' import, ~6 CPU-s) whose
# checkpoint-40 the resume test below also continues (on a copy), instead of a launch of its own.
DDP = ["--family", "deepseek_v3", "--steps", "60", "--grad-accum", "2", "--save-steps", "40"]


def torchrun(out: Path, *args: str) -> list[dict]:
    """bench/common/hf_trainer_job.py under real torchrun (2 ranks, gloo); each rank's result."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "bench" / "common" / "hf_trainer_job.py"),
        *DDP,
        "--out",
        str(out),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The 2-rank run with a spike at 45 and a NaN at 50 (a checkpoint at 40), the default policy:
    its output_dir and each rank's result. Read-only: a test that resumes it works on a copy."""
    out = tmp_path_factory.mktemp("ddp") / "out"
    return out, torchrun(out, "--inject", "gradspike@45:1000", "--inject", "nan@50")


@pytest.mark.integration
def test_two_ranks_ddp_on_gloo_decide_alike(ddp: tuple[Path, list[dict]]) -> None:
    """The default policy (clip_spikes): the x1000 spike at 45 is flagged on the reduced gradient
    and kept, its clip at the threshold looser than the Trainer's max_grad_norm (1.0), so the step
    is the unguarded one (clipped by max_grad_norm alone: the verdict's action none, within the
    grad clip; test_integration_transformers.py checks such a step against an observing guard's
    update): applied, the schedule moved on, no guard action. The NaN at 50 is skipped with
    weights, AdamW state, LR and schedule bitwise unchanged. Both ranks alike."""
    out, ranks = ddp
    assert [r["world_size"] for r in ranks] == [2, 2]
    for r in ranks:
        assert set(r["checks"]) == {"45", "50"} and all(r["checks"]["50"].values())
        assert not any(r["checks"]["45"].values()), r["checks"]["45"]  # weights, AdamW, LR, schedule moved
        assert [(i, a) for i, a in enumerate(r["actions"]) if a != schema.ACT_APPLY] == [
            (50, schema.ACT_SKIP)
        ]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # replicas still identical: the same decisions
    assert ranks[0]["lrs"] == ranks[1]["lrs"]
    events = read_table(out / "moeguard", "events")
    fired = events.filter(pl.col("kind") == schema.EV_VERDICT).sort("step")
    assert set(fired["step"].to_list()) == {45, 50}, fired
    spike = fired.filter(pl.col("step") == 45)
    assert set(spike["detector"].to_list()) <= {schema.DET_GRAD_SPIKE, schema.DET_LAYER_GRAD_SPIKE}, spike
    assert set(spike["action"].to_list()) == {schema.ACT_NONE}, spike
    assert all(json.loads(x)["within_grad_clip"] == 1.0 for x in spike["detail"]), spike["detail"]
    assert schema.DET_NONFINITE in fired.filter(pl.col("step") == 50)["detector"].to_list()
    # only rank 0 wrote the run store; its loss is the Trainer's (mean over ranks), its tokens both ranks'
    rows = read_table(out / "moeguard", "steps").sort("step")
    assert rows.height == 60 and (rows["tokens"] == 2 * 2 * 4 * 64).all()
    np.testing.assert_allclose(rows["loss"].to_numpy(), logged_losses(ranks[0]), rtol=1e-6)


@pytest.mark.integration
def test_two_ranks_resume_with_the_guards_state(ddp: tuple[Path, list[dict]], tmp_path: Path) -> None:
    """DDP on gloo through torchrun: rank 0 writes the guard's file, both ranks read it back (a new
    torchrun launch, new processes) and skip the same spike right after the resume (clip_spikes
    off: the skip decision both ranks must take alike; the default would apply it), the replicas
    stay identical. The first attempt is the `ddp` run above, continued from its checkpoint-40 (40 steps
    applied: the spike at 45 comes after it) for its last 20 steps."""
    out = tmp_path / "out"
    shutil.copytree(ddp[0], out)
    saved = torch.load(out / "checkpoint-40" / GUARD_STATE_FILE, weights_only=False)
    assert saved["step"] == 40 and "sync" in saved  # the straggler windows of a 2-rank run
    ranks = torchrun(
        out,
        "--resume",
        str(out / "checkpoint-40"),
        "--inject",
        "gradspike@40:50",
        "--guard",
        str(skip_spikes(tmp_path)),
    )
    for r in ranks:
        assert r["world_size"] == 2 and r["global_step"] == 60
        assert r["actions"][0] == schema.ACT_SKIP and set(r["actions"][1:]) == {schema.ACT_APPLY}
        assert all(r["checks"]["40"].values())
    assert ranks[0]["weights"] == ranks[1]["weights"]
    run = out / "moeguard"
    assert read_table(run, schema.TABLE_STEPS).sort("step")["step"].to_list() == list(range(60))
    meta = read_meta(run)
    assert meta["restarts"] == 1 and meta["world_size"] == 2
    resumes = read_table(run, schema.TABLE_EVENTS).filter(pl.col("kind") == schema.EV_RESUME)
    assert resumes["step"].to_list() == [40]
