"""Issue #38: the app's pages over a rolled-up run (raw layer / expert rows kept only around
incidents and for the recent window, older ones as rollups; summary.json), under AppTest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from app_helpers import chart_titled, charts, messages

from bench.scale.month_store import write_month_run
from dashboards.data import heatmaps
from guard.core import schema
from tests.dashboards.synth_run import SynthRun, write_run

STEPS = 3000


EXTREMES: dict = {}


@pytest.fixture(scope="module")
def long_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("longruns")
    EXTREMES.clear()
    EXTREMES.update(
        write_month_run(
            root / "month",
            steps=STEPS,
            layers=4,
            experts=8,
            ranks=16,
            incident_every=1000,
            recent=1000,
            radius=20,
        )["extremes"]
    )
    write_run(root, SynthRun(run_id="short", steps=200, seed=3))  # a store without rollups beside it
    return root


def test_runs_page_lists_the_rolled_up_run_from_its_summary(long_store: Path, open_page) -> None:
    at = open_page("runs", long_store)
    assert not at.exception, [e.value for e in at.exception]
    df = at.dataframe[0].value
    row = df[df["run"] == "month"].iloc[0]
    # every figure from summary.json: steps, the last loss, actions and verdicts counted as written
    assert row["steps"] == STEPS and row["verdicts"] == 3 and row["guard actions"] >= 1
    assert row["tokens/s"] > 0 and 0 < row["MFU %"] < 100
    assert df[df["run"] == "short"].iloc[0]["steps"] == 200  # the old store, read from its tables


def test_health_page_draws_a_rolled_up_run(long_store: Path, open_page) -> None:
    at = open_page("health", long_store, run="month")
    assert not at.exception, [e.value for e in at.exception]
    assert not [m for m in messages(at) if "damaged" in m]
    titles = [c["layout"]["title"]["text"] for c in charts(at) if c.get("layout", {}).get("title")]
    assert any(t.startswith("MaxVio per layer") for t in titles), titles
    # the expert heatmap covers the whole run from the rollups and says so; the dead expert at
    # each incident (load 0) is in its bucket's share
    share = chart_titled(at, "Layer ")
    first = share["data"][0]["customdata"][0][0]  # a column's first step (x is its centre: issue #40)
    assert first == 0 and share["data"][0]["x"][-1] >= STEPS - 20
    assert any("rollups" in m for m in messages(at) + [c.value for c in at.caption])


def test_layer_heatmap_extremes_survive_the_rollups(long_store: Path) -> None:
    """The bucket max of MaxVio over the whole run, read from rollups, equals the raw max the
    writer saw; the heatmap was read at a rollup resolution, not from raw rows."""
    from guard.store import reader

    got = heatmaps.load_layer_heatmaps(str(long_store / "month"), (0,), 0, STEPS - 1)
    assert got["maxvio"]["resolution"] == 10
    series = reader.read_series(
        long_store / "month", schema.TABLE_LAYERS, columns=("maxvio",), max_points=10**9
    )
    assert np.nanmax(got["maxvio"]["z"]) == pytest.approx(series.frame["maxvio_max"].max(), rel=1e-6)


def test_compare_page_opens_rolled_up_and_old_runs_together(long_store: Path, open_page) -> None:
    at = open_page("compare", long_store)
    assert not at.exception, [e.value for e in at.exception]
    assert at.get("plotly_chart")
