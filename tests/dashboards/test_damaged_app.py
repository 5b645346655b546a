"""The app over a store with a damaged part (issue #31, item 1): the Runs page still lists every
run, and the run's health page draws the rest of the run under a warning that names the file."""

from __future__ import annotations

from pathlib import Path

from app_helpers import messages

from guard.core import schema
from guard.store.layout import part_files
from tests.dashboards.synth_run import SynthRun, write_run


def damaged_store(root: Path) -> Path:
    write_run(root, SynthRun(run_id="whole", steps=200, seed=1))
    bad = write_run(root, SynthRun(run_id="damaged", steps=200, seed=2))
    p = part_files(bad, schema.TABLE_STEPS)[1]
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return p


def test_runs_page_lists_every_run_and_names_the_damaged_file(tmp_path: Path, open_page) -> None:
    bad = damaged_store(tmp_path)
    at = open_page("runs", tmp_path)
    assert not at.exception, [e.value for e in at.exception]
    df = at.dataframe[0].value
    assert set(df["run"]) == {"whole", "damaged"}
    steps = dict(zip(df["run"], df["steps"], strict=True))
    assert steps["damaged"] == 200 and steps["whole"] == 200
    warn = [m for m in messages(at) if "damaged part" in m]
    assert len(warn) == 1 and f"steps/{bad.name}" in warn[0] and "truncated" in warn[0]


def test_health_page_draws_the_rest_and_names_the_damaged_file(tmp_path: Path, open_page) -> None:
    bad = damaged_store(tmp_path)
    at = open_page("health", tmp_path, run="damaged")
    assert not at.exception, [e.value for e in at.exception]
    warn = [m for m in messages(at) if "damaged part" in m]
    assert len(warn) == 1 and f"steps/{bad.name}" in warn[0]
    assert at.get("plotly_chart")  # the charts are drawn from the parts that read
