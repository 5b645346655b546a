"""The guard never leaves a run worse than no guard (issue #39), drilled on tiny Mixtral and
Qwen3-MoE (bench/drills/fault_drill.py, shortened for CI: 200 iterations, faults at batches 30 / 45 / 60,
collapse warm-up 40). Guarded vs unguarded (the same loop observing only) vs clean, the same data
and seed: held-out loss at the end, actions, halts, and the pushed layer's MaxVio.

Stated bounds (the issue's): no action on the clean runs; the NaN skipped once; the x50 kept:
flagged and left to the loop's grad_clip 1.0, which bounds it under the threshold, so the
step is the unguarded one (PolicyConfig.clip_spikes, the default; no guard action, its verdict
recorded) and "never worse than unguarded" holds exactly, within NEAR (1%) of the clean run; the
NaN run, one batch short, within SPREAD of it. The collapse (+10 on expert 0's router logit of
layer 1 from batch 60 on): corrected (opens at 69-72, the detector's 10 steps over the line), no
rollback, no halt, back under the MaxVio line (5 steps running) within BACK_WITHIN steps of its
onset (the logit bias, guard/integrations/router_push.py LogitBias: 19-29 measured) while the
unguarded control never is, and its final loss (the mean held-out loss at iterations 160-200)
within NEAR of the unguarded run's: the correction moves tokens between experts, so the two runs
cannot be the same, and one perturbed batch moves these tiny models at lr 3e-3 by up to SPREAD at
200 iterations (skipping batch 45 with no fault ended Mixtral 2.3% above the clean run); the
three faults together within SPREAD of clean. The 400-iteration drill over seeds 0-2
(`python -m bench.drills.fault_drill`, docs/BENCHMARKS.md) has the figures.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.drills import fault_drill as fd
from guard.core import schema
from guard.core.config import CollapseConfig, GuardConfig

STEPS = 200  # the figures in the docstring were measured at 200 iterations
AT = {"nan": 30, "x50": 45, "collapse": 60}
NAN_UNGUARDED_STEPS = AT["nan"] + 50  # see drill_runs
BACK_WITHIN = 40
SPREAD = 0.03
NEAR = 0.01  # the bound: within 1% of clean (the x50 drill, and the collapse vs unguarded)

pytestmark = pytest.mark.slow


def worse(a: float, b: float) -> float:
    """How much worse loss a is than b, relative (NaN: infinitely)."""
    return math.inf if math.isnan(a) else (-math.inf if math.isnan(b) else a / b - 1)


def drill_runs(family: str, tmp: Path) -> dict[tuple[str, bool], dict[str, Any]]:
    """Every run of one family: {(fault set, guarded): result}."""
    from trainer.data import stdlib_corpus

    torch.set_num_threads(1)
    corpus = stdlib_corpus(4_000_000)
    cfg = GuardConfig(collapse=CollapseConfig(warmup=40))  # the default policy: clip_spikes on
    plan = [  # (the unguarded all-three run stops at its NaN: nothing to compare with, not run)
        ("clean", True, STEPS),
        ("all", True, STEPS),
        ("collapse", True, STEPS),
        ("collapse", False, STEPS),
        ("nan", True, STEPS),
        # unguarded, the NaN reaches every weight at its batch and each later step only computes
        # NaNs: its held-out loss is NaN at 80 as at 200 (its 5 evals at 40-80 all come after it)
        ("nan", False, NAN_UNGUARDED_STEPS),
        ("x50", True, STEPS),
        ("x50", False, STEPS),
    ]

    def run(name: str, guarded: bool, steps: int) -> dict[str, Any]:
        faults = () if name == "clean" else fd.FAULTS[name]
        run_dir = tmp / f"{family}-{name}-{guarded}"
        return fd.run(
            family, faults, guarded=guarded, steps=steps, corpus=corpus, run_dir=run_dir, cfg=cfg, at=AT
        )

    runs = {(name, guarded): run(name, guarded, steps) for name, guarded, steps in plan}
    # The clean reference. A guarded run that took no action is the observing run, bit for bit (the
    # same loop, every update applied as computed: eval losses and MaxVio compared equal on both
    # families), so the observing run is made only when the guarded one acted (and then
    # test_clean_runs_draw_no_action fails with the actions named).
    clean = runs["clean", True]
    acted = clean["actions"] or clean["halted_at"] is not None
    runs["clean", False] = run("clean", False, STEPS) if acted else clean
    return runs


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def drill(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return drill_runs(request.param, tmp_path_factory.mktemp(request.param))


def test_clean_runs_draw_no_action(drill: dict) -> None:
    assert drill["clean", True]["actions"] == [] and drill["clean", True]["halted_at"] is None


def test_nan_is_skipped_and_x50_kept_both_near_the_clean_run(drill: dict) -> None:
    clean = drill["clean", False]["eval_loss"]
    g, u = drill["nan", True], drill["nan", False]
    assert [tuple(a) for a in g["actions"]] == [(AT["nan"], "skip")], g["actions"]
    # A skip is a batch the run never sees, which moves these models by up to SPREAD at 200
    # iterations (Mixtral skipping batch 45 with no fault: +2.3%). Where the skip lands within that
    # is the CPU's rounding: within NEAR (1%) on the 2-vCPU VMs the drill was first measured on,
    # Qwen3 +1.6% on an AVX-512 Xeon, with the same one skip. So the NaN run is held to SPREAD,
    # the x50 (no skip: the unguarded run's update) to NEAR.
    assert worse(g["eval_loss"], clean) <= SPREAD, (g["eval_loss"], clean)
    # unguarded, the NaN reaches the LM head's weight: every later loss is NaN
    assert math.isnan(u["eval_loss"])
    # x50: flagged and left to grad_clip 1.0 (it bounds it under the threshold), so
    # the batch is kept and the run is the unguarded one (not a guard action)
    g, u = drill["x50", True], drill["x50", False]
    assert g["actions"] == [], g["actions"]
    assert [(s, a) for s, d, a in g["verdicts"]] == [(AT["x50"], schema.ACT_NONE)], g["verdicts"]
    assert g["eval_loss"] <= u["eval_loss"] and worse(g["eval_loss"], clean) <= NEAR, (g, u, clean)


@pytest.mark.parametrize("faults", ["collapse", "all"])
def test_a_collapse_is_corrected_back_with_no_halt_and_no_rollback(drill: dict, faults: str) -> None:
    g = drill[faults, True]
    assert g["halted_at"] is None and not any(a == "rollback" for _, a in g["actions"]), g["actions"]
    corrections = [s for s, a in g["actions"] if a == "bias_correct"]
    assert corrections and AT["collapse"] < corrections[0] <= AT["collapse"] + 12, g["actions"]
    back = g["collapse_back_after"]
    assert back is not None and back <= BACK_WITHIN, back
    if faults == "collapse":  # the control: the cause stays, the layer never comes back alone
        u = drill[faults, False]
        # the correction moves tokens between experts, so the guarded run cannot be the unguarded
        # one: "never worse" within the 1% (measured +0.73% Mixtral, -0.04% Qwen3)
        assert worse(g["eval_loss"], u["eval_loss"]) <= NEAR, (g["eval_loss"], u["eval_loss"])
        assert u["collapse_back_after"] is None and u["maxvio_last50"][fd.COLLAPSE_LAYER] > 2.5
    else:  # all three: the unguarded run is NaN from batch 30; against clean (+0.66%, -1.3%)
        clean = drill["clean", False]["eval_loss"]
        assert worse(g["eval_loss"], clean) <= SPREAD, (g["eval_loss"], clean)
    # the healthy layers were left alone: none pushed into a collapse by the correction
    assert all(v < 2.0 for k, v in g["maxvio_last50"].items() if k != fd.COLLAPSE_LAYER)


def test_offset_router_is_the_routers_own_forward_plus_the_offset(tmp_path: Path) -> None:
    from guard.integrations.tiny import build
    from guard.integrations.transformers import decoder_layers

    model = build("qwen3_moe", seed=0)
    gate = decoder_layers(model)[1].mlp.gate
    h = torch.randn(5, 64)
    logits, w, idx = gate(h)
    undo = fd.offset_router(model, 1, offset=0.0)
    l2, w2, idx2 = gate(h)
    assert torch.allclose(logits, l2) and torch.allclose(w, w2) and torch.equal(idx, idx2)
    undo()
    fd.offset_router(model, 1, offset=10.0)
    l3, _, idx3 = gate(h)
    assert torch.allclose(l3[:, 0], logits[:, 0] + 10) and (idx3 == 0).any(-1).all()
