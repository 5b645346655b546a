"""bench/detection/detector_heldout.py: scoring, calibration, and the re-implementations against the peers' real code."""

from __future__ import annotations

import numpy as np
import pytest

from bench.detection import detector_heldout as dh
from bench.detection.trace_families import FAMILIES, family_traces


def test_score_copy_counts_hits_within_tolerance_and_false_positives():
    flags = np.zeros(100, dtype=bool)
    flags[[10, 53, 80]] = True  # 10: on the fault; 53: 3 steps late (a hit); 80: a false positive
    hits, fp = dh.score_copy(flags, np.array([10, 50, 70]))
    assert (hits, fp) == (2, 1)


def test_calibration_picks_the_most_sensitive_setting_within_the_target():
    traces = family_traces("lognormal", range(2), 900)
    knob = next(k for k in dh.KNOBS if k.name == "OLMo-core")
    value, fa = dh.calibrate(knob, traces, target=1e-3)
    assert fa <= 1e-3
    i = knob.grid.index(value)
    if i > 0:  # one notch more sensitive breaks the target
        assert dh.fa_rate(knob, knob.grid[i - 1], traces) > 1e-3


def test_every_family_is_positive_and_reproducible():
    for fam in FAMILIES:
        a, b = family_traces(fam, [3], 700), family_traces(fam, [3], 700)
        assert all(np.array_equal(x.values, y.values) for x, y in zip(a, b, strict=True))
        assert all((t.values > 0).all() and np.isfinite(t.values).all() for t in a)


@pytest.mark.parametrize("peer", ["OLMo-core", "ZClip", "Lightning"])
def test_reimplementations_flag_exactly_as_the_installed_peers(peer):
    """Flag for flag on a trace with mixed spikes, at the published setting and a tuned one."""
    pytest.importorskip({"OLMo-core": "olmo_core", "ZClip": "zclip", "Lightning": "lightning"}[peer])
    knob = next(k for k in dh.KNOBS if k.name == peer)
    trace = family_traces("student_t3", [101], 700)[0]
    rng = np.random.default_rng(0)
    pos = dh.fault_positions(700, 10**6, rng, dh.FAULT_START, 100)
    values = dh.inject(trace.values, pos, rng.choice(dh.SIZES, size=len(pos)))
    for setting in (dh.default_of(knob), knob.grid[len(knob.grid) // 4]):
        real = dh.real_flags(peer, setting, values)
        mine = dh.run_detector(knob.make(setting), values)
        assert real is not None and real.any(), "the trace must make the peer flag something"
        assert np.array_equal(real, mine), f"{peer} at {setting}: steps {np.flatnonzero(real != mine)}"


def test_dev_split_never_holds_a_test_trace_or_a_calibration_seed():
    calib, dev = dh.split_traces(400, calib_seeds=2, test_seeds=2, dev=True)
    _, test = dh.split_traces(400, calib_seeds=2, test_seeds=2, dev=False)
    runs = {t.name for t in dev}  # "family-seed"
    assert runs == {f"{f}-{s}" for f in dh.CALIBRATION_FAMILIES for s in range(2, 6)}
    assert not runs & {t.name for t in calib + test}
    with pytest.raises(SystemExit):
        dh.main(["--dev", "--write-docs", "--quick"])


def test_recorded_runs_are_scored_as_their_own_split(tmp_path, capsys):
    """--recorded scores recorded run stores (named family-seed) in place of the test split, per
    family, and refuses --dev; a run store written by the run-store writer is read back as is."""
    from guard.core.report import StepReport
    from guard.store.runstore import RunStore

    rng = np.random.default_rng(0)
    runs = []
    for name in ("fam_a-0", "fam_b-1"):
        store = RunStore(tmp_path / name)
        for s in range(700):
            g, loss = float(np.exp(rng.normal(0, 0.2))), float(np.exp(rng.normal(1, 0.02)))
            store.add_step(StepReport(step=s, time=float(s), loss=loss, grad_norm=g, lr=1e-3, tokens=64))
        store.close(status="finished")
        runs.append(str(tmp_path / name))
    args = ["--quick", "--agreement", "--agreement-steps", "1500", "--detectors", "ours (budget),OLMo-core"]
    assert dh.main([*args, "--recorded", *runs]) == 0  # traces shorter than the agreement steps
    out = capsys.readouterr().out
    assert out.startswith("## Detection on recorded real-model traces")
    assert "| detector | fam_a | fam_b |" in out and "recorded split" in out
    with pytest.raises(SystemExit):
        dh.main(["--dev", "--quick", "--recorded", *runs])


@pytest.mark.parametrize(
    ("pair", "named"), [("xi_max", "KEY=VALUE"), ("no_such=1", "no_such"), ("xi_max=big", "'big'")]
)
def test_a_bad_ours_set_is_refused_by_name(pair: str, named: str) -> None:
    before = dict(dh.OURS_EXTRA)
    with pytest.raises(ValueError, match=named):
        dh.set_ours([pair])
    assert dh.OURS_EXTRA == before
