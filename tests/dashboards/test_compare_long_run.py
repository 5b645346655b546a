"""Issue #38: Compare reads what its charts show, not both runs' whole steps tables. A run past
loaders.FULL_READ_STEPS is read as a bounded perf sample (whole segments, per-step values) and
an overlay from the steps rollups; a shorter one exactly as before."""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from dashboards.data import compare, loaders, runs, shaping
from guard.core import schema
from guard.store import layout, reader
from tests.dashboards.month_stores import RUN, month_store


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """steps -> the run. The 3,000- and 48,000-step runs are test_health_long_run.py's too
    (month_stores.py: built once a session)."""
    return {n: month_store(tmp_path_factory, n) / RUN for n in (3_000, 24_000, 48_000)}


class Reads:
    """Every Parquet file a polars scan opened, and the rows in them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: list[str] = []
        real = pl.scan_parquet

        def spy(source, *a, **kw):  # noqa: ANN001, ANN002, ANN003
            self.files += [str(s) for s in (source if isinstance(source, list) else [source])]
            return real(source, *a, **kw)

        monkeypatch.setattr(pl, "scan_parquet", spy)

    def rows(self, part: str = "") -> int:
        return sum(pq.read_metadata(f).num_rows for f in self.files if part in f)


def _open(path: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    loaders.clear_caches()
    p, sig = str(path), runs.run_signature(path)
    return loaders.load_steady_perf(p, sig), compare.load_overlay(p, sig, "loss", "step", 1)


def test_a_short_run_reads_as_before(stores: dict[int, Path]) -> None:
    p = str(stores[3_000])
    loaders.clear_caches()
    steps = loaders.load_steps(p, runs.run_signature(p))
    perf, overlay = _open(stores[3_000])
    want = shaping.steady_state(steps).select("step", "mfu", "tokens_per_s")
    assert perf.equals(want.gather_every(math.ceil(want.height / 3000)) if want.height > 3000 else want)
    assert overlay.equals(compare.overlay_series(steps, "loss", "step", 1))


@pytest.mark.parametrize("n", [24_000, 48_000])
def test_a_long_run_reads_a_bounded_sample(
    stores: dict[int, Path], n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = Reads(monkeypatch)
    perf, overlay = _open(stores[n])
    raw_steps = reads.rows(f"/{schema.TABLE_STEPS}/")
    # the perf sample: at most PERF_SEGMENTS whole segments (and the open one's parts)
    assert raw_steps <= (loaders.PERF_SEGMENTS + 1) * layout.SEGMENT_STEPS
    assert raw_steps < n  # never the whole table
    assert reads.rows("/rollups/") <= 4 * compare.MAX_LINE_POINTS
    full = reader.read_table(stores[n], schema.TABLE_STEPS)
    # per-step values of the run's own steady-state steps, thinned to the violins' 3,000
    cut = shaping.warmup_end(0, n - 1)
    got = perf.join(full.select("step", "tokens_per_s", "action"), on="step", suffix="_raw")
    assert got.height == perf.height and 2_000 <= perf.height <= 3_000
    assert (got["tokens_per_s"] == got["tokens_per_s_raw"]).all() and perf["step"].min() >= cut
    assert got["action"].is_in([*schema.APPLYING_ACTIONS, schema.ACT_NONE]).all()
    # the overlay: ~1,000 buckets, each its min and max, so the run's extremes (the loss spikes at
    # incidents) are drawn
    assert overlay.height <= compare.MAX_LINE_POINTS
    assert math.isclose(overlay["y"].max(), full["loss"].max(), rel_tol=1e-6)  # float32 rollups
    assert math.isclose(overlay["y"].min(), full["loss"].min(), rel_tol=1e-6)
    assert overlay["step"].min() == 0 and overlay["step"].max() == n - 1


def test_the_long_overlay_on_tokens_and_wall(stores: dict[int, Path]) -> None:
    p = str(stores[48_000])
    loaders.clear_caches()
    sig = runs.run_signature(p)
    full = reader.read_table(p, schema.TABLE_STEPS).sort("step")
    tok = compare.load_overlay(p, sig, "tokens_per_s", "tokens", 1)
    assert math.isclose(tok["x"].max(), float(full["tokens"].sum()), rel_tol=1e-6)
    wall = compare.load_overlay(p, sig, "loss", "wall", 50)  # smoothed: one point a bucket
    span_min = (full["time"].max() - full["time"].min()) / 60
    assert abs(wall["x"].max() - span_min) < 5 and wall.height <= compare.MAX_LINE_POINTS // 2
