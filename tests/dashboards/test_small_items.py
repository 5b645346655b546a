"""The smaller items of issue #31: the expert-load panel opens on the layer that misbehaved, no
`None` in the events table, hover text that does not call a skip a warning, steps counted as
--steps counts them, `moeguard app --runs runs/<run>` noticing it is a run, `moeguard --version`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl

from dashboards.data import guard_events
from dashboards.launch import store_of
from guard.core import schema
from tests.conftest import REPO
from tests.dashboards import synth_store as synth


def events(*rows: dict) -> pl.DataFrame:
    base = {
        "step": 0,
        "time": 0.0,
        "kind": schema.EV_VERDICT,
        "detector": "",
        "value": 1.0,
        "threshold": 0.5,
        "action": schema.ACT_NONE,
        "detail": "{}",
    }
    return pl.DataFrame([{**base, **r} for r in rows])


def test_the_misbehaving_layer_is_the_one_routing_detectors_flagged_most() -> None:
    ev = events(
        {"detector": schema.DET_MAXVIO, "detail": json.dumps({"layer": 3})},
        {"detector": schema.DET_MAXVIO, "detail": json.dumps({"layer": 2})},
        {"detector": schema.DET_LOAD_ENTROPY, "detail": json.dumps({"layer": 2})},
        {"detector": schema.DET_GRAD_SPIKE, "detail": json.dumps({"layer": 1})},  # not routing
        {"detector": schema.DET_GRAD_SPIKE, "detail": json.dumps({"layer": 1})},
    )
    assert guard_events.misbehaving_layer(ev) == 2
    assert guard_events.misbehaving_layer(events({"detector": schema.DET_GRAD_SPIKE})) is None


def test_hover_does_not_call_a_skip_a_warning() -> None:
    skip = {
        "kind": schema.EV_VERDICT,
        "detector": schema.DET_GRAD_SPIKE,
        "value": 9.0,
        "threshold": 2.0,
        "action": schema.ACT_SKIP,
        "detail": json.dumps({"severity": "warning", "median": 1.0}),
    }
    assert "severity" not in guard_events.evidence_text(skip) and "median: 1" in guard_events.evidence_text(
        skip
    )
    warn = {**skip, "action": schema.ACT_NONE}
    assert "severity: warning (recorded, no action)" in guard_events.evidence_text(warn)


def test_health_page_opens_expert_load_on_the_flagged_layer_and_has_no_none_cells(
    store: Path, open_page
) -> None:
    at = open_page("health", store, run=synth.GUARDED)
    assert not at.exception, [e.value for e in at.exception]
    ev = pl.read_parquet(sorted((store / synth.GUARDED / schema.TABLE_EVENTS).glob("*.parquet")))
    flagged = guard_events.misbehaving_layer(ev)
    assert flagged is not None and at.selectbox(key="expert_layer").value == flagged
    table = next(d.value for d in at.dataframe if "threshold" in d.value.columns)
    for c in ("value", "threshold", "detector", "action"):
        cells = [str(v) for v in table[c].tolist()]
        assert "None" not in cells and "nan" not in cells, (c, cells[:20])
    steps = next(m for m in at.metric if m.label == "steps")
    assert steps.value == "600"  # a 600-step run (steps 0..599)


def test_app_runs_pointing_at_a_run_serves_its_store(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / schema.META_FILE).write_text("{}")
    store, note = store_of(run, "http://127.0.0.1:8501")
    assert store == (tmp_path / "runs").resolve()
    assert note is not None and "is a run" in note and "health?run=r1" in note
    assert store_of(tmp_path / "runs", "u") == (tmp_path / "runs", None)


def test_moeguard_version() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "guard", "--version"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0 and p.stdout.startswith("moeguard ") and p.stdout.split()[1][0].isdigit(), p


def test_stacked_verdicts_share_one_dot_with_every_evidence_in_its_hover() -> None:
    ev = events(
        {"step": 5, "detector": schema.DET_MAXVIO, "detail": json.dumps({"layer": 1})},
        {"step": 5, "detector": schema.DET_MAXVIO, "detail": json.dumps({"layer": 3})},
        {"step": 6, "detector": schema.DET_MAXVIO, "detail": json.dumps({"layer": 1})},
    )
    rows = guard_events.timeline_rows(ev)
    assert rows.select("step", "lane").rows() == [(5, schema.DET_MAXVIO), (6, schema.DET_MAXVIO)]
    hover = rows["hover"][0]
    assert "(2 events)" in hover and "layer: 1" in hover and "layer: 3" in hover


def test_a_run_without_a_peak_has_no_steps_above_100pct_mfu(tmp_path: Path) -> None:
    """NaN MFU (no peak) is not "above 100%": polars orders NaN above every number."""
    from dashboards.data import loaders, runs
    from tests.dashboards.synth_run import SynthRun, write_run

    run = write_run(tmp_path, SynthRun(run_id="no-peak", steps=60, faults=[], peak_known=False))
    assert loaders.load_summary(str(run), runs.run_signature(run))["mfu_over"] == 0
