"""bench/detection/guard_whole.py: the guard's every rule and the peers' installed code judge what-if copies of recorded steps."""

from __future__ import annotations

import numpy as np
import pytest

from bench.detection import guard_whole as gw

STEPS = 420


def write_run(path, seed: int) -> str:
    """A run store with a total grad norm, four layers' grad norms and a loss, quiet throughout."""
    from guard.core.report import StepReport
    from guard.store.runstore import RunStore

    rng = np.random.default_rng(seed)
    store = RunStore(path)
    for s in range(STEPS):
        layers = np.exp(rng.normal(0, 0.1, 4))
        rep = StepReport(
            step=s,
            time=float(s),
            loss=float(np.exp(rng.normal(1, 0.02))),
            grad_norm=float(np.sqrt((layers**2).sum())),
            lr=1e-3,
            tokens=64,
        )
        rep.layer_ids_L = np.arange(4)
        rep.layer_grad_norm_L = layers
        store.add_step(rep)
    store.close(status="finished")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return gw.load_reports([write_run(root / "fam-0", 0), write_run(root / "fam-1", 1)])


def test_a_what_if_changes_nothing_and_a_big_spike_is_caught(runs):
    pytest.importorskip("olmo_core")  # OLMo-core's judge is its installed SkipStepOptimizer
    reps = runs["fam-0"]
    assert len(reps) == STEPS and len(reps[0].layer_grad_norm_L) == 4
    for make, value in ((gw.GuardJudge, 1e-5), (gw.OlmoJudge, 6.0)):
        alone = gw.replay(make(value), reps)
        peeked = gw.replay(make(value), reps, gw.WHAT_IFS)
        # the what-ifs leave the clean steps' verdicts as they were
        assert (peeked.clean_flags, peeked.clean_steps) == (alone.clean_flags, alone.clean_steps)
        assert peeked.clean_steps == STEPS - gw.FAULT_START
        assert peeked.faults[("grad", 10.0)] == STEPS - gw.FAULT_START
        assert peeked.recall(("grad", 10.0)) == 1.0 and peeked.recall(("loss", 3.0)) == 1.0


def test_every_spike_rule_gets_the_budget():
    cfg = gw.guard_config(3e-6)
    assert cfg.grad_spike.budget == cfg.loss_spike.budget == cfg.layer_grad_spike.budget == 3e-6


def test_calibration_meets_the_target_on_the_calibration_runs(runs):
    calib = {"fam-0": runs["fam-0"]}
    for judge in gw.JUDGES[:2]:  # ours and OLMo-core (ZClip and Lightning: test_detector_heldout's RealPeer)
        value, fa = gw.calibrate(judge, calib, 1e-3)
        assert fa <= 1e-3 and fa == gw.fa_rate(judge, value, calib), judge.name


def test_split_must_be_disjoint(tmp_path):
    with pytest.raises(SystemExit):
        gw.main(["--calib", str(tmp_path / "a-0"), "--test", str(tmp_path / "a-0")])
