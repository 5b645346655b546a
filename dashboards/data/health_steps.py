"""Run health's step charts (loss, grad norm, precursors, throughput) and guard marks over a long
run, read at the chart's resolution instead of the whole steps table.

A run longer than loaders.FULL_READ_STEPS whose steps table has rollups (guard/store/rollup.py)
is read for the steps shown (the page's zoom, `view`) through reader.read_series: the finest
resolution with at most ~MAX_LINE_POINTS / 2 buckets (each drawn as its min at its first step and
its max at its last, so a one-step spike in an old, rolled-up stretch is still the line's peak),
the raw rows when the zoom spans few enough steps. On top of that, the raw rows of the run's
full-fidelity ranges (summary.json: the recent window and +-N steps around every incident: verdict,
action, non-finite step...) are read once and drawn where they fall in the view, so an incident is
drawn step by step and its marks sit on real points. A shorter run, or a store without rollups,
is read whole as before (loaders.load_steps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import streamlit as st

from dashboards.data import loaders, step_zoom
from dashboards.data.guard_events import action_marks, timeline_rows
from dashboards.data.shaping import MAX_LINE_POINTS, downsample
from guard.core import schema
from guard.store import reader

Range = tuple[int, int]

# Raw steps rows read for the full-fidelity ranges at most (the `[store]` defaults keep ~12,000 at
# 1M steps: the 10,000-step recent window and 51 steps around each of 40 incidents). Past it the
# widest ranges are left to the rollups, the narrow incident windows read first.
INCIDENT_ROWS = 60_000


def long_span(path: str) -> Range | None:
    """(first, last) step of a run whose step charts read rollups (longer than FULL_READ_STEPS,
    with steps rollups); None: read the steps table whole, as before. Names and summary.json."""
    span = loaders.long_run_span(path)
    if span is None or not reader.rollup_resolutions(path, schema.TABLE_STEPS):
        return None
    return span


def _ranges_to_read(ranges: list[Range], lo: int, hi: int, cap: int = INCIDENT_ROWS) -> list[Range]:
    """The full-fidelity ranges cut to [lo, hi], narrowest first, while their steps fit `cap`."""
    cut = sorted(
        ((max(a, lo), min(b, hi)) for a, b in ranges if b >= lo and a <= hi), key=lambda r: r[1] - r[0]
    )
    out, total = [], 0
    for a, b in cut:
        if total + b - a + 1 > cap:
            break
        out.append((a, b))
        total += b - a + 1
    return sorted(out)


@st.cache_resource(max_entries=16, show_spinner=False)
def load_incident_rows(path: str, sig: tuple[int, ...]) -> pl.DataFrame:
    """Every raw steps row (the page's columns) in the run's full-fidelity ranges, up to
    INCIDENT_ROWS rows: the parts those ranges fall in, nothing else."""
    del sig
    span = reader.run_step_range(path)
    ranges = reader.raw_ranges(path)
    if span is None:
        return reader.scan_table(path, schema.TABLE_STEPS, []).select(loaders.STEP_COLS).collect()
    want = _ranges_to_read([span] if ranges is None else ranges, *span)
    parts = reader.cached_part_files(path, schema.TABLE_STEPS)
    chosen = [p for a, b in want for p in reader.parts_overlapping(parts, a, b)]
    keep = pl.any_horizontal([pl.col("step").is_between(a, b) for a, b in want]) if want else pl.lit(False)
    df = (
        reader.scan_table(path, schema.TABLE_STEPS, list(dict.fromkeys(chosen)))
        .select(loaders.STEP_COLS)
        .filter(keep)
        .collect()
    )
    return df if df["step"].is_sorted() else df.sort("step", "time")


def _event_steps(events: pl.DataFrame, lo: int, hi: int) -> list[int]:
    """Steps in [lo, hi] with a guard event other than a checkpoint (drawn as points: a mark sits
    on one)."""
    ev = events.filter((pl.col("kind") != schema.EV_CHECKPOINT) & pl.col("step").is_between(lo, hi))
    return sorted(set(ev["step"].to_list()))


def merge_points(buckets: pl.DataFrame, raw: pl.DataFrame, column: str) -> pl.DataFrame:
    """(step, column) to draw: the raw rows, and each bucket of `buckets` (a read_series frame)
    that is not wholly inside a stretch the raw rows cover, as its min at its first step and max
    at its last (loaders.series_points). Pure."""
    raw_pts = raw.select("step", pl.col(column).cast(pl.Float64))
    if buckets.height == 0:
        return raw_pts.sort("step")
    if int(buckets["n"].max()) <= 1:  # type: ignore[arg-type]
        # read at every step: the raw rows are the same rows
        return loaders.series_points(buckets, column).with_columns(pl.col(column).cast(pl.Float64))
    have = np.unique(raw_pts["step"].to_numpy())
    if have.size:
        # a bucket every step of which is in the raw rows is drawn from them alone
        a, b = buckets["step_lo"].to_numpy(), buckets["step_hi"].to_numpy()
        seen = np.searchsorted(have, b, side="right") - np.searchsorted(have, a, side="left")
        buckets = buckets.filter(pl.Series(seen < b - a + 1))
    pts = loaders.series_points(buckets, column).with_columns(pl.col(column).cast(pl.Float64))
    return pl.concat([pts, raw_pts]).unique("step", keep="last").sort("step")


@st.cache_data(max_entries=32, show_spinner=False)
def load_view_series(
    path: str,
    sig: tuple[int, ...],
    columns: tuple[str, ...],
    lo: int,
    hi: int,
    max_points: int = MAX_LINE_POINTS,
) -> dict[str, pl.DataFrame]:
    """Downsampled (step, value) series of the steps in [lo, hi] of a long run: the rollup (or
    raw) read_series buckets the view needs, the full-fidelity raw rows in it, every step with a
    guard event kept (loaders.load_step_series' contract, for a view)."""
    got = reader.read_series(
        path, schema.TABLE_STEPS, columns=columns, lo=lo, hi=hi, max_points=max(1, max_points // 2)
    ).frame
    raw = load_incident_rows(path, sig).filter(pl.col("step").is_between(lo, hi))
    keep = _event_steps(loaders.load_events(path, sig), lo, hi)
    return {
        c: downsample(merge_points(got, raw, c), c, max_points=max_points, keep_steps=keep) for c in columns
    }


@st.cache_data(max_entries=32, show_spinner=False)
def load_long_marks(path: str, sig: tuple[int, ...]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """loaders.load_marks of a long run: the marks' step rows are the full-fidelity rows (every
    verdict and action step is an incident, kept raw)."""
    ev = loaders.load_events(path, sig)
    return action_marks(ev, load_incident_rows(path, sig)), timeline_rows(ev)


# ---- what the page calls: one path whatever the run's length ---------------------------------


def step_rows(path: str, sig: tuple[int, ...]) -> pl.DataFrame:
    """Raw steps rows the page marks non-finite steps from: the whole table of a short run, the
    full-fidelity rows of a long one (a non-finite step is an incident: kept raw)."""
    return loaders.load_steps(path, sig) if long_span(path) is None else load_incident_rows(path, sig)


def run_span(path: str, sig: tuple[int, ...]) -> Range | None:
    """(first, last) step of the run; None when its steps table has no row."""
    span = long_span(path)
    if span is not None:
        return span
    steps = loaders.load_steps(path, sig)
    if steps.height == 0:
        return None
    return int(steps["step"].min()), int(steps["step"].max())  # type: ignore[arg-type]


def series(path: str, sig: tuple[int, ...], columns: tuple[str, ...], view: Range) -> dict[str, pl.DataFrame]:
    """The step charts' lines for the steps shown: a long run read at the view's resolution, a
    short one downsampled from the whole table and cut to the view (as before)."""
    if long_span(path) is None:
        return step_zoom.clip(loaders.load_step_series(path, sig, columns), view)
    return load_view_series(path, sig, columns, *view)


def marks(path: str, sig: tuple[int, ...]) -> tuple[pl.DataFrame, pl.DataFrame]:
    return loaders.load_marks(path, sig) if long_span(path) is None else load_long_marks(path, sig)


def resolution_note(path: str, view: Range) -> str:
    """What a long run's lines are read at, for the page's caption ('' for a short run)."""
    if long_span(path) is None:
        return ""
    res = reader.pick_resolution(path, schema.TABLE_STEPS, view[0], view[1], MAX_LINE_POINTS // 2)
    if res == 1:
        return "every step of the range shown is drawn from the raw steps rows"
    return (
        f"lines read at {res:,}-step rollups (each bucket drawn as its min and max, so a one-step spike "
        "stays visible), every step around each incident and in the recent window drawn raw; zoom in "
        "(drag across a chart) for finer steps"
    )


def is_long(path: str | Path) -> bool:
    return long_span(str(path)) is not None
