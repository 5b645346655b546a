"""When detectors arm (issue #31, item 2): guard/core/warmup.py says the first step each detector
can give a verdict at; these tests hold it to the detectors themselves, fed a fault from step 0."""

from __future__ import annotations

import numpy as np

from guard.core import schema
from guard.core.config import CollapseConfig, GuardConfig, StallConfig, ThroughputConfig
from guard.core.detectors.collapse import CollapseDetector
from guard.core.detectors.timing import StallDetector, ThroughputDetector
from guard.core.engine import Engine
from guard.core.warmup import notices, warmups
from tests.helpers_collector import make_report


def arms(cfg: GuardConfig) -> dict[str, int]:
    return {w.name: w.arms_at for w in warmups(cfg)}


def first_fire(verdicts) -> int:
    return next(i for i, v in enumerate(verdicts) if v)


def test_collapse_arms_where_the_detector_first_fires() -> None:
    cfg = GuardConfig(collapse=CollapseConfig(warmup=40, maxvio_for=3))
    det = CollapseDetector(cfg.collapse)
    fired = []
    for s in range(80):
        rep = make_report(s)
        rep.maxvio_M = np.full_like(rep.maxvio_M, 3.0)  # collapsed from step 0 ...
        rep.load_ME = np.zeros_like(rep.load_ME)
        rep.load_ME[:, 0] = 100  # ... onto the same expert (a lasting preference)
        fired.append(bool(det.update(rep)))
    assert first_fire(fired) == arms(cfg)["collapse"] == 40


def test_stall_and_throughput_arm_where_they_first_fire() -> None:
    cfg = GuardConfig(stall=StallConfig(warmup=3), throughput=ThroughputConfig(warmup=10, sustain=4))
    # a stall on every step from s on: the first s that fires is where it arms
    first = min(s for s in range(40) if _stall_fires_at(cfg.stall, s))
    assert first == arms(cfg)["stall"] == 11
    tput = ThroughputDetector(cfg.throughput)
    vals = [1000.0] * 10 + [10.0] * 20
    fired = [tput.update(v).fired for v in vals]
    assert first_fire(fired) == arms(cfg)["throughput"] == 13


def _stall_fires_at(c: StallConfig, s: int) -> bool:
    det = StallDetector(c)
    for _ in range(s):
        det.update(0.01)
    return det.update(600.0).fired


def test_grad_spike_arms_after_its_warmup_of_accepted_steps() -> None:
    cfg = GuardConfig()
    w = arms(cfg)["grad_spike"]
    for at, expect in ((w - 1, False), (w, True)):
        engine = Engine(cfg, max_lr=1e-3)
        got = False
        for s in range(at + 1):
            rep = make_report(s, t=1000.0 + s)
            if s == at:
                rep.grad_norm = 1e6  # a 1e6x spike: caught by the first rule that can fire
            d = engine.decide(rep, rep.lr)
            got = any(e.detector == schema.DET_GRAD_SPIKE for e in d.events if e.kind == schema.EV_VERDICT)
        assert got is expect, (at, w)


def test_notices_name_the_detector_the_step_and_the_setting() -> None:
    lines = notices(GuardConfig(), 300, [("collapse", 220, "collapse@220:1"), ("nan", 5, "nan@5")])
    assert len(lines) == 1
    assert "--inject collapse@220:1" in lines[0]
    assert "collapse detector arms at step 250 (collapse.warmup)" in lines[0]
    short = notices(GuardConfig(), 100)
    assert (
        len(short) == 1
        and "ends at step 99" in short[0]
        and "collapse at step 250 (collapse.warmup)" in short[0]
    )
    assert notices(GuardConfig(), 300, [("collapse", 260, "collapse@260:1")]) == []
    assert notices(GuardConfig(enabled=False), 10, [("collapse", 2, "collapse@2:1")]) == []
