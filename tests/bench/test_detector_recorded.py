"""bench/detection/detector_recorded.py: knobs set on recorded calibration runs only, scored on the other set, both ways."""

from __future__ import annotations

import numpy as np
import pytest

from bench.detection import detector_heldout as dh
from bench.detection import detector_recorded as dr
from bench.detection.trace_families import family_traces
from bench.detection.traces import recorded_traces

STEPS = 800


def write_run(path, seed: int, spike_every: int | None) -> str:
    """A run store like bench/drills/real_models.py --keep writes; `spike_every` adds natural 4x grad-norm
    spikes (a noisier run than the calibration runs)."""
    from guard.core.report import StepReport
    from guard.store.runstore import RunStore

    rng = np.random.default_rng(seed)
    store = RunStore(path)
    for s in range(STEPS):
        g = float(np.exp(rng.normal(0, 0.15)))
        if spike_every and s % spike_every == 0:
            g *= 4.0
        loss = float(np.exp(rng.normal(1, 0.02)))
        store.add_step(StepReport(step=s, time=float(s), loss=loss, grad_norm=g, lr=1e-3, tokens=64))
    store.close(status="finished")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Set A: two quiet runs (seed 0); set B: two runs with natural 4x spikes every 97 steps (seed 1)."""
    root = tmp_path_factory.mktemp("runs")
    quiet = [write_run(root / f"{fam}-0", i, None) for i, fam in enumerate(("fam_a", "fam_b"))]
    noisy = [write_run(root / f"{fam}-1", 10 + i, 97) for i, fam in enumerate(("fam_a", "fam_b"))]
    return quiet, noisy


def test_each_direction_sets_its_knobs_on_its_calibration_runs_alone(runs, monkeypatch):
    quiet, noisy = runs
    seen: list[set[str]] = []
    real_calibrate = dh.calibrate

    def spying_calibrate(knob, traces, target):
        seen.append({t.name for t in traces})
        return real_calibrate(knob, traces, target)

    monkeypatch.setattr(dh, "calibrate", spying_calibrate)
    knobs = [k for k in dh.KNOBS if k.name in ("ours (budget)", "OLMo-core")]
    target = 2e-3
    on_quiet = dr.one_direction(quiet, noisy, target, knobs, copies=1)
    on_noisy = dr.one_direction(noisy, quiet, target, knobs, copies=1)
    assert seen == [{"fam_a-0", "fam_b-0"}] * 2 + [{"fam_a-1", "fam_b-1"}] * 2
    for d, calib in ((on_quiet, quiet), (on_noisy, noisy)):
        traces = recorded_traces(calib)
        for knob in knobs:
            measured = dh.fa_rate(knob, d.settings[knob.name], traces)
            assert measured == d.calib_fa[knob.name] <= target, knob.name
    # The noisy runs' natural 4x spikes must loosen the peer's knob: the two sets set it differently,
    # so a knob set on the scored runs would have shown here.
    assert on_noisy.settings["OLMo-core"] > on_quiet.settings["OLMo-core"]
    # Scored on the other set: the clean test steps are the other runs' (2 runs x 2 series x 500)
    clean = dh.pooled(on_quiet.results["OLMo-core"], "grad_norm", 0.0, ("fam_a", "fam_b"))
    assert clean.clean_steps == 2 * (STEPS - dh.FAULT_START)


def test_more_copies_score_more_faults_at_other_steps():
    t = family_traces("lognormal", [0], 1300)[0]
    first, second = dh.fault_steps(t, 0), dh.fault_steps(t, 1)
    assert not np.array_equal(first, second)
    assert first.min() >= dh.FAULT_START and np.diff(second).min() >= dh.FAULT_GAP
    knob = next(k for k in dh.KNOBS if k.name == "OLMo-core")
    one, two = dh.evaluate(knob, 8.0, [t], copies=1), dh.evaluate(knob, 8.0, [t], copies=2)
    key = ("lognormal", t.series, 3.0)
    assert two[key].faults == one[key].faults + len(second)


def test_main_runs_both_ways_and_refuses_overlapping_sets(runs, capsys):
    quiet, noisy = runs
    args = ["--detectors", "ours (budget),OLMo-core", "--copies", "1", "--target", "2e-3"]
    assert dr.main([*args, "--calib", *quiet, "--test", *noisy, "--fixed-z"]) == 0
    out = capsys.readouterr().out
    assert "| ours (fixed z, candidate) | z |" in out  # the candidate is calibrated like the rest
    assert "set on seed 0 (calibration FA/1k)" in out and "set on seed 1 (calibration FA/1k)" in out
    assert "Grad-norm faults, ours against the best peer (OLMo-core)" in out
    assert "RUNS/fam_a-0" in out and str(quiet[0]) not in out  # no machine paths in the report
    with pytest.raises(SystemExit, match="share runs fam_a-0"):
        dr.main([*args, "--calib", *quiet, "--test", quiet[0], noisy[0]])
    with pytest.raises(SystemExit):  # the docs show ours as the guard ships it
        dr.main([*args, "--calib", *quiet, "--test", *noisy, "--ours-set", "xi_max=0.3", "--write-docs"])
