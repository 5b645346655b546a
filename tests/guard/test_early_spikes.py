"""The first steps of a run are no blind spot (issue #28): the all-layers rule's early cap, its
loss discount and its ceiling after the warm-up, on plain arrays (per-layer grad norms, a loss)."""

from __future__ import annotations

import math

import numpy as np

from guard.core import schema
from guard.core.config import GuardConfig, SpikeConfig
from guard.core.detectors.suite import DetectorSuite
from guard.core.report import StepReport
from tests.guard.test_calibrated_spike import _layers


def _run(
    layers: np.ndarray, loss: np.ndarray | None = None, cfg: GuardConfig | None = None
) -> dict[int, list]:
    """Step verdicts per step of a whole run through GuardConfig's suite (defaults: what a user gets)."""
    suite = DetectorSuite(cfg or GuardConfig())
    fired: dict[int, list] = {}
    for i, row in enumerate(layers):
        rep = StepReport(
            step=i,
            time=0.0,
            loss=float(loss[i]) if loss is not None else 2.0 + 1e-3 * math.sin(i),
            grad_norm=float(np.sqrt((row**2).sum())),
            lr=1e-3,
            tokens=0,
            layer_ids_L=np.arange(layers.shape[1], dtype=np.int32),
            layer_grad_norm_L=row.astype(np.float64),
        )
        for v in suite.update(rep):
            if v.detector in schema.STEP_DETECTORS:
                fired.setdefault(i, []).append((v.detector, v.evidence.get("rule")))
    return fired


def test_a_whole_model_x50_at_step_20_and_x20_at_step_50_are_skipped() -> None:
    """Before: only the total's cap acted in the first 200 steps, and only after 32 (50-100x)."""
    clean = _layers(260, 3)
    assert _run(clean) == {}, "a clean start (one-layer bursts included) draws no verdict"
    # x50 from step 20 on, x20 from step 50 on (issue #28's targets; the early cap 8x)
    for at, factor in ((20, 50.0), (50, 50.0), (120, 50.0), (50, 20.0), (90, 20.0), (150, 20.0)):
        spiked = clean.copy()
        spiked[at] *= factor
        fired = _run(spiked)
        assert schema.DET_GRAD_SPIKE in [d for d, _ in fired.get(at, [])], (at, factor, fired)
    old = GuardConfig()
    old.grad_spike.all_layers_early_cap = 1e9  # the early cap off: what the guard did before
    spiked = clean.copy()
    spiked[20] *= 50.0  # before the total's own warm-up (32 steps) nothing else acts
    assert 20 not in _run(spiked, cfg=old)


def test_a_rise_the_loss_explains_is_a_hard_batch_not_a_fault() -> None:
    clean = _layers(260, 4)
    loss = 2.0 + 1e-3 * np.sin(np.arange(260))
    hard = clean.copy()
    hard[90] *= 12.0  # every layer 12x at once (over the early cap, 8x) ...
    loss[90] *= 1.5  # ... and the loss with it: a hard batch
    # (the loss rule may flag a 1.5x loss on this flat a series: the hard batch is its to judge)
    assert (schema.DET_GRAD_SPIKE, "all_layers") not in _run(hard, loss).get(90, [])
    flat = 2.0 + 1e-3 * np.sin(np.arange(260))  # the same gradients, the loss unmoved: a fault
    assert _run(hard, flat).get(90) == [(schema.DET_GRAD_SPIKE, "all_layers")]
    # The loss explains a rise by at most 2x: every layer 30x with the same 1.5x loss is a fault
    # (uncapped, (1.5 / 1.05)^8 = 17x of discount let it through)
    worse = clean.copy()
    worse[90] *= 30.0
    assert (schema.DET_GRAD_SPIKE, "all_layers") in _run(worse, loss).get(90, [])


def test_a_whole_model_x8_after_the_warm_up_is_skipped() -> None:
    """After the tail fit the rise's threshold is capped at 6x its level (was the total's 8x, which
    a x8 spike on a level just under 1 did not clear)."""
    cfg = GuardConfig(layer_grad_spike=SpikeConfig(enabled=False))  # the per-layer rule is another detector
    clean = _layers(700, 5)
    assert _run(clean, cfg=cfg) == {}
    caught = 0
    at = (400, 500, 600)
    for t in at:
        spiked = clean.copy()
        spiked[t] *= 8.0
        caught += [d for d, _ in _run(spiked, cfg=cfg).get(t, [])] == [schema.DET_GRAD_SPIKE]
    assert caught == len(at)
