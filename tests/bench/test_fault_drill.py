"""The guard never leaves a run worse than no guard (issue #39), drilled on tiny Mixtral and
Qwen3-MoE (bench/drills/fault_drill.py, shortened for CI: 200 iterations, faults at batches 30 / 45 / 60,
collapse warm-up 40). Guarded vs unguarded (the same loop observing only) vs clean, the same data
and seed: held-out loss at the end, actions, halts, and the pushed layer's MaxVio.

Stated bounds: the collapse (+10 on expert 0's router logit of layer 1 from batch 60 on) is back
under the MaxVio line (5 steps running) within BACK_WITHIN steps of its onset on the guarded runs
(the correction opens at 69-72: the detector's 10 steps over the line; the layer's logit bias,
guard/integrations/router_push.py LogitBias, brought it back 19-29 steps after the onset where the
gradient-only correction took 40-70) and never on the unguarded ones; a guarded run's final loss (the mean held-out loss at iterations
160-200) is at most SPREAD above the unguarded run's and, on the NaN and x50 drills, the clean
run's. SPREAD is what one dropped batch does to these tiny models at 200 iterations, lr 3e-3, with
no fault at all: skipping batch 45 (the x50 drill: every weight untouched at the skip) ended Mixtral
2.3% above the clean run and 2.0% above the unguarded x50 run, whose clipped step keeps the batch;
skipping batch 30 (NaN) ended it 0.2% below. At 400 iterations (the issue's table,
`python -m bench.drills.fault_drill`, docs/escalation.md) the runs are judged against 1%.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.drills import fault_drill as fd
from guard.core.config import CollapseConfig, GuardConfig

STEPS = 200  # the SPREAD figures below were measured at 200 iterations
AT = {"nan": 30, "x50": 45, "collapse": 60}
BACK_WITHIN = 40
SPREAD = 0.03

pytestmark = pytest.mark.slow


def worse(a: float, b: float) -> float:
    """How much worse loss a is than b, relative (NaN: infinitely)."""
    return math.inf if math.isnan(a) else (-math.inf if math.isnan(b) else a / b - 1)


def drill_runs(family: str, tmp: Path) -> dict[tuple[str, bool], dict[str, Any]]:
    """Every run of one family: {(fault set, guarded): result}."""
    from trainer.data import stdlib_corpus

    torch.set_num_threads(1)
    corpus = stdlib_corpus(4_000_000)
    cfg = GuardConfig(collapse=CollapseConfig(warmup=40))
    plan = [
        ("clean", False, STEPS),
        ("clean", True, STEPS),
        ("all", True, STEPS),
        ("all", False, STEPS),
        ("collapse", True, STEPS),
        ("collapse", False, STEPS),
        ("nan", True, STEPS),
        ("nan", False, STEPS),
        ("x50", True, STEPS),
        ("x50", False, STEPS),
    ]
    return {
        (name, guarded): fd.run(
            family,
            () if name == "clean" else fd.FAULTS[name],
            guarded=guarded,
            steps=steps,
            corpus=corpus,
            run_dir=tmp / f"{family}-{name}-{guarded}",
            cfg=cfg,
            at=AT,
        )
        for name, guarded, steps in plan
    }


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def drill(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return drill_runs(request.param, tmp_path_factory.mktemp(request.param))


def test_clean_runs_draw_no_action(drill: dict) -> None:
    assert drill["clean", True]["actions"] == [] and drill["clean", True]["halted_at"] is None


def test_nan_and_x50_are_skipped_and_end_near_clean(drill: dict) -> None:
    clean = drill["clean", False]["eval_loss"]
    for fault in ("nan", "x50"):
        g, u = drill[fault, True], drill[fault, False]
        assert [tuple(a) for a in g["actions"]] == [(AT[fault], "skip")], (fault, g["actions"])
        assert worse(g["eval_loss"], clean) <= SPREAD, (fault, g["eval_loss"], clean)
        assert worse(g["eval_loss"], u["eval_loss"]) <= SPREAD, (fault, g["eval_loss"], u["eval_loss"])
    # unguarded, the NaN reaches the LM head's weight: every later loss is NaN
    assert math.isnan(drill["nan", False]["eval_loss"])


@pytest.mark.parametrize("faults", ["collapse", "all"])
def test_a_collapse_is_corrected_back_with_no_halt_and_no_rollback(drill: dict, faults: str) -> None:
    g, u = drill[faults, True], drill[faults, False]
    assert g["halted_at"] is None and not any(a == "rollback" for _, a in g["actions"]), g["actions"]
    corrections = [s for s, a in g["actions"] if a == "bias_correct"]
    assert corrections and AT["collapse"] < corrections[0] <= AT["collapse"] + 12, g["actions"]
    back = g["collapse_back_after"]
    assert back is not None and back <= BACK_WITHIN, back
    assert worse(g["eval_loss"], u["eval_loss"]) <= SPREAD, (g["eval_loss"], u["eval_loss"])
    if faults == "collapse":  # the control: the cause stays, the layer never comes back alone
        assert u["collapse_back_after"] is None and u["maxvio_last50"][fd.COLLAPSE_LAYER] > 2.5
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
