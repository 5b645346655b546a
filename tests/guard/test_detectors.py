"""Detectors on plain lists of floats (and small StepReports). The quality bench in quick mode is
tests/bench/test_detector_quality.py."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.core import schema
from guard.core.config import (
    CollapseConfig,
    GuardConfig,
    PrecursorConfig,
    SpikeConfig,
    StallConfig,
    ThroughputConfig,
)
from guard.core.detectors.collapse import CollapseDetector
from guard.core.detectors.nonfinite import NonFiniteDetector
from guard.core.detectors.robust import median_of
from guard.core.detectors.spike import LayerSpikeDetector, SpikeDetector
from guard.core.detectors.suite import DetectorSuite
from guard.core.detectors.timing import StallDetector, ThroughputDetector
from guard.core.report import StepReport
from guard.core.tomlconf import ConfigError

# The fixed-z rule (SpikeDetector) with the settings GuardConfig used before the false-alarm budget
# became its default (tests/guard/test_calibrated_spike.py covers the budget rule).
GRAD = SpikeConfig(tail_margin=2.0, tail_warmup=100, early_rel_max=100.0, early_rel_floor=50.0)
LOSS = SpikeConfig(z=6.0, rel_min=1.25)
LAYER = SpikeConfig(
    z=8.0,
    rel_min=3.0,
    rel_max=50.0,
    tail_margin=2.0,
    tail_warmup=100,
    early_rel_max=200.0,
    early_rel_floor=150.0,
)


def noisy(n: int, seed: int, sigma: float = 0.1, level: float = 1.0) -> list[float]:
    rng = np.random.default_rng(seed)
    return (level * np.exp(rng.normal(0.0, sigma, n))).tolist()


def fired_at(det: SpikeDetector, xs: list[float]) -> list[int]:
    return [i for i, x in enumerate(xs) if det.update(x).fired]


def roundtrip(d: dict) -> dict:
    """What a checkpoint does to a state dict: it must survive JSON."""
    return json.loads(json.dumps(d))


def baselines(state: object) -> object:
    """A detector state less what the budget rule moves on every step by design: its clock `t` and
    its run of flagged values (the level-shift count). What is left is what a value can teach."""
    if isinstance(state, dict):
        return {k: baselines(v) for k, v in state.items() if k not in ("t", "flagged_run")}
    return state


# ---------------------------------------------------------------------------------------
# SpikeDetector
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("cfg", [GRAD, LOSS], ids=["grad_cfg", "loss_cfg"])
def test_steady_noisy_series_never_fires(seed: int, cfg: SpikeConfig) -> None:
    assert fired_at(SpikeDetector(cfg), noisy(5000, seed)) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slow_trend_never_fires(seed: int) -> None:
    # a grad norm tripling over 5000 steps and a power-law loss, both noisy: trends are not spikes
    t = np.arange(5000)
    rising = (np.exp(np.log(3.0) * t / 5000) * np.array(noisy(5000, seed))).tolist()
    loss = ((2.0 + 8.0 * (1 + t / 50.0) ** -0.5) * np.array(noisy(5000, seed + 10, sigma=0.02))).tolist()
    assert fired_at(SpikeDetector(GRAD), rising) == []
    assert fired_at(SpikeDetector(LOSS), loss) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_3x_spike_fires_exactly_at_its_index(seed: int) -> None:
    xs = noisy(600, seed)
    xs[400] *= 3.0
    assert fired_at(SpikeDetector(GRAD), xs) == [400]


def test_verdict_carries_evidence_and_threshold() -> None:
    det = SpikeDetector(GRAD, schema.DET_GRAD_SPIKE)
    for x in noisy(300, 0):
        det.update(x)
    v = det.update(det.median * 5)
    assert v.fired and v.detector == schema.DET_GRAD_SPIKE
    assert {"median", "mad", "z", "n"} <= set(v.evidence)
    assert v.evidence["z"] > GRAD.z
    assert v.value > v.threshold >= v.evidence["median"] * GRAD.rel_min


def test_spike_does_not_enter_the_baseline() -> None:
    det = SpikeDetector(GRAD)
    for x in noisy(400, 0):
        det.update(x)
    before = det.state_dict()
    assert det.update(50.0).fired
    assert det.state_dict() == before
    # and the next spike is judged against the same baseline
    assert det.update(50.0).fired


def test_downward_moves_never_fire() -> None:
    det = SpikeDetector(GRAD)
    xs = noisy(300, 0) + [1e-3, 1e-6] + noisy(100, 1)
    assert fired_at(det, xs) == []


def test_nan_does_not_poison_later_detection() -> None:
    det = SpikeDetector(GRAD)
    for x in noisy(300, 0):
        det.update(x)
    before = det.state_dict()
    for bad in (float("nan"), float("inf"), -float("inf")):
        v = det.update(bad)
        assert not v.fired  # NonFiniteDetector owns non-finite values
    assert det.state_dict() == before
    tail = noisy(300, 1)
    tail[150] *= 3.0
    assert fired_at(det, tail) == [150]


def test_warmup_respected() -> None:
    det = SpikeDetector(GRAD)
    xs = noisy(GRAD.warmup, 0)
    xs[GRAD.warmup - 1] = 100.0  # too early for the relative rule: accepted, not flagged
    assert fired_at(det, xs) == []
    assert det.n == GRAD.warmup
    # warm now: before tail_warmup only the cap acts, widened by that accepted 100x swing up to
    # early_rel_max
    assert GRAD.tail_warmup > GRAD.warmup
    assert not det.peek(det.median * GRAD.early_rel_floor * 1.5).fired
    assert det.update(det.median * GRAD.early_rel_max * 1.5).fired


def test_early_cap_widens_with_the_runs_own_swings_up_to_early_rel_max() -> None:
    """Before the tail warm-up the cap is max(early_rel_floor, (largest clean excursion)^tail_margin),
    at most early_rel_max: a wild start earns a wider cap, a steady one keeps the floor."""
    steady = SpikeDetector(GRAD)
    assert fired_at(steady, noisy(40, 2, sigma=0.05)) == []
    assert not steady.peek(steady.median * GRAD.early_rel_floor * 0.9).fired
    assert steady.peek(steady.median * GRAD.early_rel_floor * 1.2).fired
    det = SpikeDetector(GRAD)
    xs = noisy(40, 3, sigma=0.05)
    xs[20] = 8.0  # one clean 8x excursion during warm-up (accepted: no rule may fire yet)
    assert fired_at(det, xs) == []
    cap = min(GRAD.early_rel_max, 8.0**GRAD.tail_margin)  # ~64x, above the floor (50x)
    assert GRAD.early_rel_floor < cap * 0.9
    assert not det.peek(det.median * cap * 0.9).fired  # would have fired at the floor
    v = det.update(det.median * cap * 1.3)
    assert v.fired and v.evidence["rule"] == "rel_max"
    wild = SpikeDetector(GRAD)
    ys = noisy(40, 4, sigma=0.05)
    ys[20] = 1000.0  # an absurd early excursion cannot disarm the cap past early_rel_max
    fired_at(wild, ys)
    assert not wild.peek(wild.median * GRAD.early_rel_max * 0.8).fired
    assert wild.update(wild.median * GRAD.early_rel_max * 1.5).fired


def test_abs_max_fires_during_warmup() -> None:
    det = SpikeDetector(SpikeConfig(abs_max=1e4))
    v = det.update(2e4)
    assert v.fired and v.threshold == 1e4 and v.evidence["rule"] == "abs_max"
    assert det.n == 0  # and it stayed out of the baseline
    assert not det.update(5.0).fired


def test_nonpositive_values_are_ignored() -> None:
    det = SpikeDetector(GRAD)
    assert not det.update(0.0).fired and not det.update(-1.0).fired
    assert det.n == 0


def test_peek_does_not_mutate() -> None:
    det = SpikeDetector(GRAD)
    for x in noisy(100, 0):
        det.update(x)
    before = det.state_dict()
    for x in (0.5, 1.0, 9.0, float("nan")):
        det.peek(x)
    assert det.state_dict() == before


def test_state_dict_roundtrip_gives_identical_future_verdicts() -> None:
    xs = noisy(1200, 3)
    for i in (700, 850, 1000):
        xs[i] *= 4.0
    a = SpikeDetector(GRAD)
    for x in xs[:600]:
        a.update(x)
    b = SpikeDetector(GRAD)
    b.load_state_dict(roundtrip(a.state_dict()))
    va = [a.update(x) for x in xs[600:]]
    vb = [b.update(x) for x in xs[600:]]
    assert [v.fired for v in va] == [v.fired for v in vb]
    assert [v.evidence for v in va] == [v.evidence for v in vb]
    assert [i + 600 for i, v in enumerate(va) if v.fired] == [700, 850, 1000]


def test_trend_does_not_hide_a_spike() -> None:
    # early training: loss falling fast. A 2x loss spike must stand out of the trend.
    t = np.arange(600)
    loss = (2.0 + 8.8 * (1 + t / 30.0) ** -0.6) * np.array(noisy(600, 5, sigma=0.015))
    xs = loss.tolist()
    xs[300] *= 2.0
    assert fired_at(SpikeDetector(LOSS), xs) == [300]


def test_spike_update_is_fast() -> None:
    # ~15 us on an idle core; the bound only catches an accidental O(n log n)-in-Python update
    # and leaves room for a loaded CI machine (best of 5 rounds).
    det = SpikeDetector(GRAD)
    for x in noisy(GRAD.window, 1):
        det.update(x)
    xs = noisy(500, 0)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for x in xs:
            det.update(x)
        best = min(best, (time.perf_counter() - t0) / len(xs))
    assert best < 500e-6, f"{best * 1e6:.0f} us per update"


@settings(max_examples=200, deadline=None)
@given(
    base=st.lists(st.floats(0.05, 20.0), min_size=GRAD.warmup, max_size=300),
    frac=st.floats(0.0, 1.0),
)
def test_never_fires_within_rel_min_of_the_median(base: list[float], frac: float) -> None:
    det = SpikeDetector(GRAD)
    for x in base:
        det.update(x)
    x = det.median * (1.0 + frac * (GRAD.rel_min - 1.0))
    assert not det.peek(x).fired
    assert not det.update(x).fired


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(1e-3, 1e3))
def test_verdicts_are_scale_invariant(seed: int, scale: float) -> None:
    # log scale: the same run in other units (or a rescaled loss) gets the same verdicts
    xs = noisy(400, seed, sigma=0.2)
    xs[200] *= 3.0
    a, b = SpikeDetector(GRAD), SpikeDetector(GRAD)
    assert [a.update(x).fired for x in xs] == [b.update(x * scale).fired for x in xs]


def test_median_of_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 255, 256):
        a = rng.normal(size=n)
        assert median_of(a) == pytest.approx(float(np.median(a)))
    assert math.isnan(median_of(np.zeros(0)))


# ---------------------------------------------------------------------------------------
# Per-layer spikes and non-finite values
# ---------------------------------------------------------------------------------------
def test_layer_spike_detector_names_the_layer() -> None:
    det = LayerSpikeDetector(LAYER)
    ids = [0, 1, 2]
    series = [noisy(300, s) for s in ids]
    for t in range(300):
        assert det.update(ids, [s[t] for s in series]) == []
    out = det.update(ids, [1.0, 40.0, 1.0])
    assert [(v.layer, v.detector) for v in out] == [(1, schema.DET_LAYER_GRAD_SPIKE)]
    clone = LayerSpikeDetector(LAYER)
    clone.load_state_dict(roundtrip(det.state_dict()))
    assert clone.state_dict() == det.state_dict()


def make_report(
    step: int, loss: float = 2.0, grad: float = 1.0, layer_grads: list[float] | None = None, **kw: object
) -> StepReport:
    lg = np.asarray(layer_grads if layer_grads is not None else [], dtype=np.float64)
    return StepReport(
        step=step,
        time=float(step),
        loss=loss,
        grad_norm=grad,
        lr=1e-3,
        tokens=1024,
        layer_ids_L=np.arange(lg.size, dtype=np.int32),
        layer_grad_norm_L=lg,
        **kw,
    )


def test_nonfinite_detector_names_layers() -> None:
    det = NonFiniteDetector()
    assert not det.update(make_report(0, layer_grads=[1.0, 2.0])).fired
    v = det.update(make_report(1, layer_grads=[1.0, float("inf"), float("nan")]))
    assert v.fired and v.severity == "critical" and v.detector == schema.DET_NONFINITE
    assert v.evidence == {"signals": [], "layers": [1, 2]}
    v = det.update(make_report(2, loss=float("nan"), layer_grads=[1.0]))
    assert v.fired and v.evidence["signals"] == ["loss"] and math.isnan(v.value)


# ---------------------------------------------------------------------------------------
# Collapse
# ---------------------------------------------------------------------------------------
E = 8


def moe_report(
    step: int, loads: list[int], maxvio: float = 0.1, load_h: float = 0.95, router_h: float = 1.5
) -> StepReport:
    return make_report(
        step,
        moe_layer_ids_M=np.array([3], np.int32),
        router_entropy_M=np.array([router_h]),
        load_entropy_M=np.array([load_h]),
        maxvio_M=np.array([maxvio]),
        dead_experts_M=np.array([0], np.int32),
        bias_norm_M=np.array([0.0]),
        load_ME=np.array([loads], np.int64),
    )


BALANCED = [100] * E
ONE_EXPERT = [800] + [0] * (E - 1)


def test_dead_experts_fire_within_dead_window() -> None:
    cfg = CollapseConfig(warmup=10, dead_window=20)
    det = CollapseDetector(cfg)
    for s in range(30):
        assert det.update(moe_report(s, BALANCED)) == []
    first = None
    for s in range(30, 30 + cfg.dead_window + 5):
        out = det.update(moe_report(s, ONE_EXPERT))
        if out and first is None:
            first = s
            v = out[0]
            assert v.detector == schema.DET_DEAD_EXPERTS and v.layer == 3
            assert v.evidence["dead"] == E - 1 and v.value == pytest.approx((E - 1) / E)
    assert first is not None and first - 30 < cfg.dead_window
    assert not det.healthy(3)


def test_dead_experts_use_load_history_not_the_reported_count() -> None:
    # the reporter says 0 dead (dead_experts_M), the per-expert loads say otherwise
    det = CollapseDetector(CollapseConfig(warmup=0, dead_window=5))
    outs = [det.update(moe_report(s, ONE_EXPERT)) for s in range(6)]
    assert any(v.detector == schema.DET_DEAD_EXPERTS for out in outs for v in out)


def test_maxvio_sustained_fires_transient_does_not() -> None:
    cfg = CollapseConfig(warmup=0, maxvio=2.0, maxvio_for=10)
    det = CollapseDetector(cfg)
    for s in range(cfg.maxvio_for - 1):  # transient: one step short
        assert det.update(moe_report(s, ONE_EXPERT, maxvio=5.0)) == []
    assert det.update(moe_report(100, BALANCED, maxvio=0.5)) == []
    assert det.healthy(3)
    outs = [det.update(moe_report(200 + s, ONE_EXPERT, maxvio=5.0)) for s in range(cfg.maxvio_for)]
    assert all(o == [] for o in outs[:-1])
    assert [(v.detector, v.layer, v.evidence["for"]) for v in outs[-1]] == [(schema.DET_MAXVIO, 3, 10)]
    assert not det.healthy(3)


def test_a_hot_expert_that_moves_every_step_is_no_collapse() -> None:
    """Each batch sent to a different expert (per-step MaxVio 7, pooled over the window 0): no
    lasting preference for a bias or a balancing gradient to correct, so no verdict; the same
    expert hot every step is one (issue #28, LongCat-Flash's tiny build)."""
    cfg = CollapseConfig(warmup=0, maxvio_for=4, entropy_for=4)
    rotating, same = CollapseDetector(cfg), CollapseDetector(cfg)
    for s in range(3 * E):
        hot = [0] * E
        hot[s % E] = 800
        assert rotating.update(moe_report(s, hot, maxvio=7.0, load_h=0.0)) == []
        out = same.update(moe_report(s, ONE_EXPERT, maxvio=7.0, load_h=0.0))
    assert {(v.detector, v.evidence["pooled"]) for v in out} == {
        (schema.DET_MAXVIO, 7.0),
        (schema.DET_LOAD_ENTROPY, 0.0),
    }
    # healthy() judges by the same pooled rule: the policy asks it whether a correction worked,
    # and a per-step reading rolled back a layer no verdict would fire on (LongCat-Flash, step 90)
    assert rotating.healthy(3)
    assert not same.healthy(3)


def test_the_pooled_window_survives_a_state_round_trip() -> None:
    cfg = CollapseConfig(warmup=0, maxvio_for=5)
    a = CollapseDetector(cfg)
    for s in range(3):
        a.update(moe_report(s, ONE_EXPERT, maxvio=7.0))
    b = CollapseDetector(cfg)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for s in range(3, 5):  # the window's first three steps came from the checkpoint
        assert a.update(moe_report(s, ONE_EXPERT, maxvio=7.0)) == b.update(
            moe_report(s, ONE_EXPERT, maxvio=7.0)
        )
    assert [v.detector for v in b.update(moe_report(5, ONE_EXPERT, maxvio=7.0))] == [schema.DET_MAXVIO]


def test_entropy_floors() -> None:
    cfg = CollapseConfig(warmup=0, entropy_for=3, router_entropy_floor=0.5)
    det = CollapseDetector(cfg)
    outs = [det.update(moe_report(s, ONE_EXPERT, load_h=0.2, router_h=0.1)) for s in range(3)]
    assert outs[:2] == [[], []]
    assert {v.detector for v in outs[2]} == {schema.DET_LOAD_ENTROPY, schema.DET_ROUTER_ENTROPY}
    off = CollapseDetector(CollapseConfig(warmup=0, entropy_for=1))  # router floor 0: disabled
    assert {v.detector for v in off.update(moe_report(0, BALANCED, router_h=0.0))} == set()


def test_collapse_warmup_counts_updates() -> None:
    det = CollapseDetector(CollapseConfig(warmup=50, maxvio_for=1))
    assert all(det.update(moe_report(s, ONE_EXPERT, maxvio=9.0)) == [] for s in range(50))
    assert det.update(moe_report(50, ONE_EXPERT, maxvio=9.0))


def test_reset_layer_restarts_windows_and_healthy_confirms_recovery() -> None:
    cfg = CollapseConfig(warmup=0, dead_window=5, maxvio_for=3)
    det = CollapseDetector(cfg)
    for s in range(6):
        det.update(moe_report(s, ONE_EXPERT, maxvio=7.0))
    assert not det.healthy(3)
    det.reset_layer(3)
    assert det.healthy(3)  # nothing holds right after the reset ...
    assert det.update(moe_report(6, ONE_EXPERT, maxvio=7.0)) == []  # ... and old evidence is gone
    for s in range(7, 20):
        det.update(moe_report(s, BALANCED))
    assert det.healthy(3)
    assert det.healthy(99)  # never seen: nothing against it


def test_collapse_state_roundtrip() -> None:
    cfg = CollapseConfig(warmup=0, dead_window=10, maxvio_for=5)
    a = CollapseDetector(cfg)
    seq = [moe_report(s, ONE_EXPERT if s > 3 else BALANCED, maxvio=5.0) for s in range(30)]
    for r in seq[:8]:
        a.update(r)
    b = CollapseDetector(cfg)
    b.load_state_dict(roundtrip(a.state_dict()))
    for r in seq[8:]:
        assert [(v.detector, v.value) for v in a.update(r)] == [(v.detector, v.value) for v in b.update(r)]


# ---------------------------------------------------------------------------------------
# Stall and throughput
# ---------------------------------------------------------------------------------------
def test_stall_detector() -> None:
    det = StallDetector(StallConfig())
    assert not det.update(30.0).fired  # warm-up: worker start-up
    waits = (np.array(noisy(100, 0, sigma=0.3)) * 0.05).tolist()
    assert not any(det.update(w).fired for w in waits)
    v = det.update(12.0)
    assert v.fired and v.threshold == pytest.approx(5.0)
    assert not det.update(float("nan")).fired
    assert not det.update(4.0).fired  # above 10x median but below min_seconds


def test_stall_threshold_follows_slow_loaders() -> None:
    det = StallDetector(StallConfig(min_seconds=1.0, factor=10.0, warmup=0))
    for _ in range(50):
        det.update(2.0)  # a slow but steady loader
    assert not det.update(15.0).fired
    assert det.update(25.0).fired


def test_throughput_sustained_drop_fires_and_spares_the_baseline() -> None:
    cfg = ThroughputConfig(window=50, drop=0.5, sustain=10)
    det = ThroughputDetector(cfg)
    for x in noisy(100, 0, sigma=0.05, level=1e5):
        assert not det.update(x).fired
    outs = [det.update(3e4).fired for _ in range(cfg.sustain)]
    assert outs == [False] * (cfg.sustain - 1) + [True]
    assert det.update(3e4).evidence["median"] == pytest.approx(1e5, rel=0.05)  # baseline kept
    assert not det.update(1e5).fired  # recovered: the run restarts


def test_throughput_transient_dip_does_not_fire() -> None:
    det = ThroughputDetector(ThroughputConfig(sustain=10))
    for x in noisy(60, 1, sigma=0.05, level=1e5):
        det.update(x)
    for _ in range(5):
        assert not det.update(1e4).fired
    assert not det.update(1e5).fired
    for _ in range(9):
        assert not det.update(1e4).fired


# ---------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------
def warm_suite(n: int = 300, **cfg_kw: object) -> DetectorSuite:
    suite = DetectorSuite(GuardConfig(**cfg_kw))  # type: ignore[arg-type]
    g, lo = noisy(n, 0), noisy(n, 1, sigma=0.02, level=3.0)
    lg = [noisy(n, 10 + k) for k in range(4)]
    for s in range(n):
        assert suite.update(make_report(s, loss=lo[s], grad=g[s], layer_grads=[x[s] for x in lg])) == []
    return suite


def test_suite_flagged_step_pollutes_no_baseline() -> None:
    suite = warm_suite()
    before = suite.state_dict()
    # a bad batch: the loss doubles (fires), the grad norm rises 40% (does not fire alone)
    out = suite.update(make_report(300, loss=6.0, grad=1.4, layer_grads=[1.0] * 4))
    assert [v.detector for v in out] == [schema.DET_LOSS_SPIKE]
    after = suite.state_dict()
    for key in ("grad_spike", "loss_spike", "layer_grad_spike"):
        assert baselines(after[key]) == baselines(before[key]), key
    # a clean step does move the baselines
    suite.update(make_report(301, loss=3.0, grad=1.0, layer_grads=[1.0] * 4))
    assert baselines(suite.state_dict()["grad_spike"]) != baselines(before["grad_spike"])


def test_suite_nonfinite_step_is_critical_and_pollutes_nothing() -> None:
    suite = warm_suite()
    before = suite.state_dict()
    out = suite.update(
        make_report(300, loss=3.0, grad=float("nan"), layer_grads=[1.0, float("nan"), 1.0, 1.0])
    )
    assert [v.detector for v in out] == [schema.DET_NONFINITE]
    assert out[0].evidence["layers"] == [1]
    after = suite.state_dict()
    for key in ("grad_spike", "loss_spike", "layer_grad_spike"):
        assert baselines(after[key]) == baselines(before[key]), key


def test_suite_layer_spike_and_grad_spike() -> None:
    suite = warm_suite()
    out = suite.update(make_report(300, loss=3.0, grad=8.0, layer_grads=[1.0, 1.0, 60.0, 1.0]))
    assert {(v.detector, v.layer) for v in out} == {
        (schema.DET_GRAD_SPIKE, None),
        (schema.DET_LAYER_GRAD_SPIKE, 2),
    }


def test_suite_returns_only_fired_and_honors_enabled_flags() -> None:
    cfg = GuardConfig(
        nonfinite=False,
        grad_spike=SpikeConfig(enabled=False),
        collapse=CollapseConfig(enabled=False),
        stall=StallConfig(enabled=False),
        throughput=ThroughputConfig(enabled=False),
        precursor=PrecursorConfig(detect=False),
    )
    suite = DetectorSuite(cfg)
    assert not {"nonfinite", "grad_spike", "collapse", "update_ratio"} & set(suite.detectors)
    assert suite.healthy(0)
    for s in range(100):
        assert suite.update(make_report(s, grad=1.0 if s < 99 else 1e6)) == []
    assert suite.update(make_report(100, grad=float("nan"))) == []  # no one is watching NaN
    assert set(suite.state_dict()) == {"version", "loss_spike", "layer_grad_spike"}


def test_suite_state_roundtrip_gives_identical_future_verdicts() -> None:
    a = warm_suite(200)
    b = DetectorSuite(GuardConfig())
    b.load_state_dict(roundtrip(a.state_dict()))
    g = noisy(300, 7)
    g[100] *= 5.0
    g[200] = float("inf")
    for s in range(300):
        ra = make_report(
            200 + s, loss=3.0, grad=g[s], layer_grads=[1.0] * 4, data_wait_s=0.01, tokens_per_s=1e5
        )
        assert [(v.detector, v.fired, v.value) for v in a.update(ra)] == [
            (v.detector, v.fired, v.value) for v in b.update(ra)
        ]
    assert a.state_dict() == b.state_dict()


def test_suite_runs_collapse_stall_throughput() -> None:
    suite = DetectorSuite(GuardConfig(collapse=CollapseConfig(warmup=0, maxvio_for=2)))
    out = []
    for s in range(3):
        r = moe_report(s, ONE_EXPERT, maxvio=9.0)
        out += suite.update(r)
    assert [(v.detector, v.layer) for v in out] == [(schema.DET_MAXVIO, 3), (schema.DET_MAXVIO, 3)]
    assert not suite.healthy(3)
    suite.reset_layer(3)
    assert suite.healthy(3)


def test_new_config_fields_are_validated() -> None:
    with pytest.raises(ConfigError, match="level_window"):
        SpikeConfig(level_window=0)
    with pytest.raises(ConfigError, match="window"):
        StallConfig(window=0)
    with pytest.raises(ConfigError, match="warmup"):
        ThroughputConfig(window=5, warmup=6)
