"""Issue #38: Run health reads what its step charts show, not the whole steps table. A run past
loaders.FULL_READ_STEPS with steps rollups is read at the chart's resolution (read_series) plus
the raw rows of its full-fidelity ranges; a zoom reads its own range finer (the raw rows when it
is short); a spike in an old, rolled-up segment is still the line's peak there."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from app_helpers import charts
from streamlit.testing.v1 import AppTest

from dashboards.data import config, health_steps, heatmaps, loaders, runs
from guard.core import schema
from guard.store import layout, reader
from tests.dashboards.conftest import APP
from tests.dashboards.month_stores import RUN, month_store

N = 48_000
COLS = ("loss", "grad_norm", "lr")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root of a store holding the one run RUN, test_compare_long_run.py's 48,000-step run too
    (month_stores.py: built once a session)."""
    return month_store(tmp_path_factory, N)


class Reads:
    """Every Parquet file a polars scan opened, and the rows in them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: list[str] = []
        real = pl.scan_parquet

        def spy(source, *a, **kw):  # noqa: ANN001, ANN002, ANN003
            self.files += [str(s) for s in (source if isinstance(source, list) else [source])]
            return real(source, *a, **kw)

        monkeypatch.setattr(pl, "scan_parquet", spy)

    def rows(self, part: str) -> int:
        return sum(pq.read_metadata(f).num_rows for f in set(self.files) if part in f)


RAW_STEPS = f"/{RUN}/{schema.TABLE_STEPS}/"


def _raw_bound(path: Path) -> int:
    """Steps rows the whole-run view may read: the segments its full-fidelity ranges touch."""
    ranges = reader.full_fidelity_ranges(path)
    segs = {s for a, b in ranges for s in range(layout.segment_of(a), layout.segment_of(b) + 1)}
    return (len(segs) + 1) * layout.SEGMENT_STEPS


def _open(at_root: Path, monkeypatch: pytest.MonkeyPatch, steps: tuple[int, int] | None = None) -> AppTest:
    loaders.clear_caches()
    monkeypatch.setenv(config.ENV_RUNS, str(at_root))
    monkeypatch.delenv(config.ENV_HISTORY, raising=False)
    at = AppTest.from_file(str(APP), default_timeout=120).run()
    at.switch_page("page_health.py")
    at.query_params["run"] = RUN
    if steps is not None:
        at.query_params["steps"] = [str(steps[0]), str(steps[1])]
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _loss(at: AppTest) -> tuple[np.ndarray, np.ndarray]:
    t = next(t for t in charts(at)[0]["data"] if t.get("name") == "loss")
    return np.asarray(t["x"], dtype=float), np.asarray(t["y"], dtype=float)


def test_the_page_reads_a_bounded_part_of_the_steps_table(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = Reads(monkeypatch)
    at = _open(store, monkeypatch)
    raw = reads.rows(RAW_STEPS)
    assert raw < N // 4 and raw <= _raw_bound(store / RUN), raw  # was every one of the 48,000
    x, y = _loss(at)
    full = reader.read_table(store / RUN, schema.TABLE_STEPS)
    # the whole run drawn, its extremes (the loss spikes at incidents) kept, <= ~2,000 points
    assert x.min() == 0 and x.max() == N - 1 and len(x) <= 2 * loaders.MAX_LINE_POINTS
    assert math.isclose(np.nanmax(y), full["loss"].max(), rel_tol=1e-6)
    assert any("rollups" in c.value for c in at.caption)
    # the marks sit on drawn points (every action step is a full-fidelity row)
    marks = [t for t in charts(at)[0]["data"] if t.get("mode") == "markers" and t.get("yaxis") in (None, "y")]
    assert marks and all(set(t["x"]) <= set(x.tolist()) for t in marks)


def test_a_zoom_reads_the_raw_rows_of_its_range(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lo, hi = 12_100, 12_699  # an old, rolled-up stretch, no incident in it
    assert not any(a <= hi and lo <= b for a, b in reader.full_fidelity_ranges(store / RUN))
    reads = Reads(monkeypatch)
    at = _open(store, monkeypatch, (lo, hi))
    x, y = _loss(at)
    want = (
        reader.scan_steps(store / RUN, schema.TABLE_STEPS, lo, hi)
        .select("step", "loss")
        .collect()
        .sort("step")
    )
    assert x.tolist() == want["step"].to_list()  # every step of the zoom, raw
    assert np.allclose(y, want["loss"].to_numpy())
    assert reads.rows(RAW_STEPS) <= _raw_bound(store / RUN) + 2 * layout.SEGMENT_STEPS


def test_a_wider_zoom_reads_finer_rollups_than_the_whole_run(store: Path) -> None:
    p, sig = str(store / RUN), runs.run_signature(store / RUN)
    whole = reader.pick_resolution(p, schema.TABLE_STEPS, 0, N - 1, loaders.MAX_LINE_POINTS // 2)
    zoom = reader.pick_resolution(p, schema.TABLE_STEPS, 10_000, 19_999, loaders.MAX_LINE_POINTS // 2)
    assert whole == 100 and zoom == 10
    got = health_steps.load_view_series(p, sig, COLS, 10_000, 19_999)["loss"]
    assert got["step"].min() >= 10_000 and got["step"].max() <= 19_999 and got.height > 1000


def test_a_spike_in_an_old_rolled_up_segment_is_the_lines_peak_there(store: Path) -> None:
    """grad_norm's largest excursion outside every full-fidelity range (a one-step noise peak the
    guard did not flag) is drawn at its value, in the bucket that holds it, at the whole-run view."""
    p, sig = str(store / RUN), runs.run_signature(store / RUN)
    loaders.clear_caches()
    full = reader.read_table(p, schema.TABLE_STEPS).select("step", "grad_norm")
    kept = pl.any_horizontal([pl.col("step").is_between(a, b) for a, b in reader.full_fidelity_ranges(p)])
    old = full.filter(~kept)
    peak = old.sort("grad_norm").row(-1, named=True)
    drawn = health_steps.series(p, sig, COLS, (0, N - 1))["grad_norm"]
    res = reader.pick_resolution(p, schema.TABLE_STEPS, 0, N - 1, loaders.MAX_LINE_POINTS // 2)
    b0 = peak["step"] // res * res
    near = drawn.filter(pl.col("step").is_between(b0, b0 + res - 1))
    assert math.isclose(near["grad_norm"].max(), peak["grad_norm"], rel_tol=1e-6)  # float32 rollups
    assert drawn.height <= 2 * loaders.MAX_LINE_POINTS


def test_a_short_run_and_an_old_store_read_as_before(
    store: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    for p in (str(month_store(tmp_path_factory, 3_000) / RUN),):  # test_compare_long_run.py's too
        sig = runs.run_signature(p)
        loaders.clear_caches()
        assert health_steps.long_span(p) is None
        want = loaders.load_step_series(p, sig, COLS)
        got = health_steps.series(p, sig, COLS, (0, 2_999))
        assert all(got[c].equals(want[c]) for c in COLS)
        assert health_steps.step_rows(p, sig).height == 3_000


def test_every_step_of_the_expert_share_is_capped_on_a_rolled_up_run(store: Path) -> None:
    p, sig = str(store / RUN), runs.run_signature(store / RUN)
    loaders.clear_caches()
    exact = heatmaps.load_expert_share_over_time(p, sig, 0, 0, N - 1, row_budget=heatmaps.EXACT_ROWS)
    assert "rollups" in exact["note"] and f"{heatmaps.EXACT_MAX_COLUMNS:,} columns" in exact["note"]
    # a zoom of at most EXACT_MAX_COLUMNS steps in the recent window: every raw step
    zoom = heatmaps.load_expert_share_over_time(p, sig, 0, N - 1000, N - 1, row_budget=heatmaps.EXACT_ROWS)
    assert zoom["note"] == "" and zoom["width"] == 5  # 1,000 steps in 200 columns, from raw rows
