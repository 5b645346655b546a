"""Compare says only what it can know (issue #31, item 3). Its interval is a bootstrap over steps
within each run: blind to host drift between runs made at different times. So two runs of the same
code, config and environment are called run-to-run variation; a difference is set against the
spread of same-config runs when the store has some; otherwise the caveat and the A/B canary."""

from __future__ import annotations

import json
from pathlib import Path

from tests.dashboards.synth_run import ENV_A, SynthRun, write_run

OTHER = {**ENV_A, "expert_kernel": "bmm"}


def verdict(open_page, root: Path, a: str, b: str) -> str:
    at = open_page("compare", root)
    at.multiselect(key="runs").set_value([a, b]).run()
    at.selectbox(key="run_a").set_value(a).run()
    at.selectbox(key="run_b").set_value(b).run()
    assert not at.exception, [e.value for e in at.exception]
    return next(m.value for m in at.markdown if m.value.startswith(("**B", "No clear")))


def test_same_config_runs_minutes_apart_are_run_to_run_variation(tmp_path: Path, open_page) -> None:
    write_run(tmp_path, SynthRun(run_id="faulty", steps=300, faults=[], mfu=0.40, seed=1))
    write_run(tmp_path, SynthRun(run_id="clean", steps=300, faults=[], mfu=0.46, seed=1))
    said = verdict(open_page, tmp_path, "faulty", "clean")
    assert "higher** than **A (faulty)" in said and "faster" not in said
    assert "same code, config and environment" in said and "run-to-run variation" in said


def test_a_difference_is_set_against_the_spread_of_same_config_runs(tmp_path: Path, open_page) -> None:
    write_run(tmp_path, SynthRun(run_id="a1", steps=300, faults=[], mfu=0.40, seed=1))
    write_run(
        tmp_path, SynthRun(run_id="a2", steps=300, faults=[], mfu=0.41, seed=2)
    )  # ~2.7% apart (noise included)
    write_run(tmp_path, SynthRun(run_id="b-big", steps=300, faults=[], env=OTHER, mfu=0.48, seed=3))
    env = {**OTHER, "compile": "max-autotune"}  # a config of its own: A's spread is the only one
    write_run(tmp_path, SynthRun(run_id="b-small", steps=300, faults=[], env=env, mfu=0.404, seed=4))
    said = verdict(open_page, tmp_path, "a1", "b-big")
    assert (
        "Same-config runs here vary by up to 2.7% run to run (2 runs); this difference is larger" in said
    ), said
    said = verdict(open_page, tmp_path, "a1", "b-small")
    assert said.startswith("No clear") or "is within that" in said, said


def test_a_drill_run_is_not_a_same_config_repeat(tmp_path: Path, open_page) -> None:
    """A run that injected faults on purpose (meta.json "injections": a stall drill here, at half
    the speed) is not host noise: it does not widen the same-config spread that a1 and a2 make."""
    write_run(tmp_path, SynthRun(run_id="a1", steps=300, faults=[], mfu=0.40, seed=1))
    write_run(tmp_path, SynthRun(run_id="a2", steps=300, faults=[], mfu=0.41, seed=2))
    drill = write_run(tmp_path, SynthRun(run_id="drill", steps=300, faults=[], mfu=0.20, seed=5))
    meta = json.loads((drill / "meta.json").read_text())
    (drill / "meta.json").write_text(json.dumps({**meta, "injections": ["stall@100:5"]}))
    write_run(tmp_path, SynthRun(run_id="b-big", steps=300, faults=[], env=OTHER, mfu=0.48, seed=3))
    said = verdict(open_page, tmp_path, "a1", "b-big")
    assert "vary by up to 2.7% run to run (2 runs); this difference is larger" in said, said


def test_without_repeats_it_says_drift_is_not_in_the_interval(tmp_path: Path, open_page) -> None:
    write_run(tmp_path, SynthRun(run_id="a", steps=300, faults=[], mfu=0.40, seed=1))
    write_run(tmp_path, SynthRun(run_id="b", steps=300, faults=[], env=OTHER, mfu=0.46, seed=2))
    said = verdict(open_page, tmp_path, "a", "b")
    assert "faster" not in said.split("decide")[0].replace("whether B is faster", "")
    assert "Host drift between runs made at different times is not in that interval" in said
    assert "moeguard canary --ab" in said


def test_runs_without_a_peak_say_so_and_show_no_empty_mfu_column(tmp_path: Path, open_page) -> None:
    env = {**ENV_A, "peak_flops": None, "peak_flops_source": "no pinned fp32 peak for CPU class cpu-x-2c"}
    write_run(tmp_path, SynthRun(run_id="a", steps=120, faults=[], env=env, peak_known=False, seed=1))
    write_run(tmp_path, SynthRun(run_id="b", steps=120, faults=[], env=env, peak_known=False, seed=2))
    at = open_page("compare", tmp_path)
    at.multiselect(key="runs").set_value(["a", "b"]).run()
    assert not at.exception, [e.value for e in at.exception]
    assert "MFU p50 %" not in at.dataframe[0].value.columns
    captions = " ".join(c.value for c in at.caption)
    assert (
        "No chosen run has a peak for its device" in captions and "divide by different peaks" not in captions
    )
