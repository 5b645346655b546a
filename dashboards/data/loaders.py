"""Cached loaders of one run's steps and events tables, and the run summary.

Arguments are (run path as str, `run_signature()`, knobs): all hashable and cheap, so a loader
re-reads a run only when it gained a part file. The run store is read through
guard/store/reader.py (one listing, one part-name parser, one tolerant scan); the app lists parts
with its cache (`cached=True`): it re-lists long runs on every rerun. Reads are lazy polars scans
with projection."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import streamlit as st

from dashboards.data.guard_events import action_marks, timeline_rows
from dashboards.data.mfu_peak import MFU_LIMIT
from dashboards.data.shaping import MAX_LINE_POINTS, downsample, steady_state, warmup_end
from guard.core import actions, schema
from guard.store import layout, reader, summary
from guard.store.reader import count_actions


def _empty_summary() -> dict[str, Any]:
    return {
        "step": None,
        "loss": None,
        "mfu": None,
        "tokens_per_s": None,
        "mfu_over": 0,
        "actions": 0,
        "action_counts": actions.zero(),
        "verdicts": 0,
        "halts": 0,
        "damaged": [],
    }


@st.cache_data(max_entries=4096, show_spinner=False)
def load_summary(path: str, sig: tuple[int, ...], *, every_part: bool = False) -> dict[str, Any]:
    """Latest step, loss, recent MFU and tokens/s, guard action and verdict counts.

    From the run's summary.json (guard/store/summary.py, kept current by the writer) when it has
    one: no table is scanned, so listing 1,000 month-long runs costs 1,000 small JSON reads.
    Damaged parts: the open segment's and the newest ones before it, checked by one stat() each
    against the sizes summary.json lists when it is current, else listed and checked for
    truncation (reader.newest_damaged), or every footer parsed with `every_part` (the run-health
    page; checks are incremental, guard/store/reader.py). A store without summary.json is read as
    before."""
    del sig
    summ = summary.read_summary(path)
    if summ is None:
        return _scanned_summary(path)
    out = _empty_summary()
    if every_part:
        out["damaged"] = _damaged(path, every_part)
    else:
        out["damaged"] = [
            (str(x.path.relative_to(path)), x.reason) for x in reader.newest_damaged(path, summ)
        ]
    if summ.get("last_step") is not None:
        out["step"] = int(summ["last_step"])
        out["loss"] = _json_float(summ.get("last_loss"))
    recent = summ.get("recent") or {}
    for c in ("mfu", "tokens_per_s"):
        out[c] = _finite_median(recent.get(c))
    out["mfu_over"] = int(summ.get("mfu_over") or 0)
    counts = actions.zero()
    counts.update({a: int(n) for a, n in (summ.get("actions") or {}).items() if a in counts})
    if not counts[schema.ACT_BIAS_CORRECT]:  # corrections logged as events only (reader.count_actions)
        counts[schema.ACT_BIAS_CORRECT] = int(summ.get("bias_correct_event_steps") or 0)
    out["action_counts"] = counts
    out["actions"] = actions.total(counts)
    ev = summ.get("events") or {}
    out["verdicts"] = int(ev.get(schema.EV_VERDICT, 0))
    out["halts"] = int(ev.get(schema.EV_HALT, 0))
    return out


def _finite_median(vals: Any) -> float | None:
    """The median of the finite numbers in a summary.json list (NaN is written as null and +-inf
    as a string), None when there is none."""
    try:
        a = np.asarray(vals or [], dtype=np.float64)  # null -> NaN, "inf" -> inf: both dropped
    except (TypeError, ValueError):
        a = np.asarray([v for v in vals if isinstance(v, int | float)], dtype=np.float64)
    a = a[np.isfinite(a)] if a.ndim == 1 else np.empty(0)
    return float(np.median(a)) if a.size else None


def _json_float(v: Any) -> float:
    """A float summary.json stored: NaN is written as null and +-inf as a string."""
    try:
        return math.nan if v is None else float(v)
    except (TypeError, ValueError):
        return math.nan


# On the Runs page, a run's newest parts are checked for truncation (magic bytes and footer
# length: a crash, a full disk or a copy in progress): the parts of the open segment (the live
# tail, at most SEGMENT_STEPS / flush_every parts however long the run) and the newest
# NEWEST_PARTS before it, the newest summary.TAIL_MAX of them (older segments were read whole by
# the store's upkeep when it compacted and rolled them up), so the cost is flat in the run's
# length and in the collector's checkpoint rate: by stat() against summary.json's
# sizes (reader.newest_damaged), or here, for a store without summary.json, listed. The
# run-health page parses every part's footer (incrementally).
NEWEST_PARTS = summary.TAIL_BEFORE


def _runs_page_parts(parts: list[Path]) -> list[Path]:
    """The parts the Runs page checks: the open segment's, and the newest NEWEST_PARTS before it."""
    named = [(info.first_step, p) for p in parts if (info := layout.parse_part(p.name)) is not None]
    if not named:
        return parts
    open_from = layout.segment_of(max(s for s, _ in named)) * layout.SEGMENT_STEPS
    older = [p for s, p in named if s < open_from]
    return (older[-NEWEST_PARTS:] + [p for s, p in named if s >= open_from])[-summary.TAIL_MAX :]


def _damaged(path: str, every_part: bool) -> list[tuple[str, str]]:
    """(path relative to the run, reason) of each damaged part the check looked at: every part's
    footer, or (a store without summary.json) the newest parts' truncation."""
    found = []
    for t in schema.TABLES:
        if every_part:
            bad = ((p, reader.part_problem(p)) for p in reader.cached_part_files(path, t))
        else:
            parts = reader.cached_part_files(path, t)
            bad = ((p, reader.part_truncated(p)) for p in _runs_page_parts(parts))
        found += [(str(p.relative_to(path)), why) for p, why in bad if why is not None]
    return found


def _scanned_summary(path: str) -> dict[str, Any]:
    """load_summary of a store written before summary.json: read from its tables."""
    out = _empty_summary()
    # (path, reason) of every part the reader skips: the pages say which files, not a traceback
    out["damaged"] = [(str(d.path.relative_to(path)), d.reason) for d in reader.damaged_parts(path)]
    parts = reader.cached_part_files(path, schema.TABLE_STEPS)
    if parts:
        tail = (
            reader.scan_table(path, schema.TABLE_STEPS, parts[-3:])
            .select("step", "loss", "mfu", "tokens_per_s")
            .sort("step")
            .tail(100)
            .collect()
        )
        if tail.height:
            out["step"] = int(tail["step"][-1])
            loss = tail["loss"][-1]
            out["loss"] = float(loss) if loss is not None else None
            for c in ("mfu", "tokens_per_s"):
                vals = tail[c].filter(tail[c].is_finite())
                out[c] = float(vals.median()) if len(vals) else None  # type: ignore[arg-type]
        out["mfu_over"] = (
            reader.scan_table(path, schema.TABLE_STEPS, cached=True)
            # polars orders NaN above every number: a run with no peak (MFU NaN) is not "over"
            .select((pl.col("mfu").is_finite() & (pl.col("mfu") > MFU_LIMIT)).sum())
            .collect()
            .item()
            or 0
        )
    out["action_counts"] = count_actions(path)
    out["actions"] = actions.total(out["action_counts"])
    ev = reader.scan_table(path, schema.TABLE_EVENTS, cached=True).select("step", "kind", "action").collect()
    if ev.height:
        out["verdicts"] = ev.filter(pl.col("kind") == schema.EV_VERDICT).height
        out["halts"] = ev.filter(pl.col("kind") == schema.EV_HALT).height
    return out


STEP_COLS = [  # the steps columns the pages draw
    "step",
    "time",
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "tokens_per_s",
    "mfu",
    "step_time_s",
    "data_wait_s",
    "mem_peak_bytes",
    "action",
    "update_ratio",
    "adam_v_ratio",
    "max_logit",
]


BLOCK_STEPS = 10_000  # the steps and events tables are read and cached in blocks of this many steps


def read_blocks(path: str, table: str, columns: tuple[str, ...] | None = None) -> pl.DataFrame:
    """The whole table, read block by block (parts grouped by first step // BLOCK_STEPS), each
    block cached under its parts' names, sizes and mtimes: a live run's new part changes only the
    newest block's key, so an open tab re-reads only what is new, not the whole table."""
    parts = reader.cached_part_files(path, table)
    blocks: dict[int, list[tuple[str, int, int]]] = {}
    for p in parts:
        try:
            st_ = os.stat(p)
        except OSError:
            continue
        first = int(p.name.split("-")[1])
        blocks.setdefault(first // BLOCK_STEPS, []).append((p.name, st_.st_size, st_.st_mtime_ns))
    frames = [_block(path, table, tuple(b), columns) for _, b in sorted(blocks.items())]
    frames = [f for f in frames if f.height]
    if not frames:
        empty = reader.scan_table(path, table, []).collect()
        return empty if columns is None else empty.select(columns)
    return pl.concat(frames, how="vertical_relaxed") if len(frames) > 1 else frames[0]


# Blocks are shared, not copied: cache_resource hands out the same (immutable) polars frame
# instead of pickling it on every store and hit. Callers never mutate.
@st.cache_resource(max_entries=1024, show_spinner=False)
def _block(
    path: str, table: str, parts: tuple[tuple[str, int, int], ...], columns: tuple[str, ...] | None
) -> pl.DataFrame:
    lf = reader.scan_table(path, table, [Path(path, table, name) for name, _, _ in parts])
    return (lf if columns is None else lf.select(columns)).collect()


@st.cache_resource(max_entries=16, show_spinner=False)
def load_steps(path: str, sig: tuple[int, ...]) -> pl.DataFrame:
    """The steps table (projected), sorted by step. The steps table is kept whole at every run
    length (one row a step); its blocks are cached (read_blocks)."""
    del sig
    df = read_blocks(path, schema.TABLE_STEPS, tuple(STEP_COLS))
    # parts arrive in step order; only a resumed or rolled-back run needs the sort
    return df if df["step"].is_sorted() else df.sort("step", "time")


@st.cache_resource(max_entries=64, show_spinner=False)
def load_events(path: str, sig: tuple[int, ...]) -> pl.DataFrame:
    del sig
    return read_blocks(path, schema.TABLE_EVENTS).sort("step", "time")


@st.cache_data(max_entries=32, show_spinner=False)
def load_step_series(
    path: str, sig: tuple[int, ...], columns: tuple[str, ...], max_points: int = MAX_LINE_POINTS
) -> dict[str, pl.DataFrame]:
    """Downsampled (step, value) series for each column, event steps always included."""
    steps = load_steps(path, sig)
    ev = load_events(path, sig)
    keep = tuple(sorted(set(ev["step"].to_list()))) if ev.height else ()
    return {c: downsample(steps, c, max_points=max_points, keep_steps=keep) for c in columns}


@st.cache_data(max_entries=32, show_spinner=False)
def load_marks(path: str, sig: tuple[int, ...]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(action marks, timeline rows) for the health chart."""
    steps = load_steps(path, sig)
    ev = load_events(path, sig)
    return action_marks(ev, steps), timeline_rows(ev)


def series_points(frame: pl.DataFrame, column: str) -> pl.DataFrame:
    """(step, column) rows to draw from a reader.read_series frame: every step at resolution 1;
    each rollup bucket as its min at its first step and its max at its last (so the line spans
    every extreme the bucket saw)."""
    lo_pts = frame.select(pl.col("step_lo").alias("step"), pl.col(f"{column}_min").alias(column))
    if frame.height and int(frame["n"].max()) <= 1:  # type: ignore[arg-type]
        return lo_pts.sort("step")
    hi_pts = frame.select(pl.col("step_hi").alias("step"), pl.col(f"{column}_max").alias(column))
    return pl.concat([lo_pts, hi_pts]).sort("step")


@st.cache_data(max_entries=16, show_spinner=False)
def load_group_series(
    path: str, sig: tuple[int, ...], column: str, max_points: int = MAX_LINE_POINTS
) -> dict[int, pl.DataFrame]:
    """optimizer group -> downsampled (step, `column`) rows of the `groups` table, read at the
    resolution the chart needs (reader.read_series)."""
    del sig
    df = reader.read_series(path, schema.TABLE_GROUPS, columns=(column,), max_points=max_points).frame
    return {
        int(g): downsample(
            series_points(df.filter(pl.col("group") == g), column), column, max_points=max_points
        )
        for g in sorted(df["group"].unique().to_list())
    }


MAX_OVER_LAYERS = -1  # load_max_logits' key of the max over layers


@st.cache_data(max_entries=16, show_spinner=False)
def load_max_logits(
    path: str, sig: tuple[int, ...], max_points: int = MAX_LINE_POINTS
) -> dict[int, pl.DataFrame]:
    """layer -> downsampled (step, max_logit) rows of the `layers` table at the steps it was
    sampled (every guard.precursor.max_logit_every-th; the NaN rows between are dropped, not drawn
    as gaps), and MAX_OVER_LAYERS -> the max over layers. Empty when the run never sampled it.
    Read at the resolution the chart needs (a rollup bucket's max is the max of its samples)."""
    del sig
    got = reader.read_series(path, schema.TABLE_LAYERS, columns=("max_logit",), max_points=max_points).frame
    df = got.select("step", "layer", pl.col("max_logit_max").alias("max_logit")).filter(
        pl.col("max_logit").is_finite()
    )
    if not df.height:
        return {}
    out = {MAX_OVER_LAYERS: df.group_by("step").agg(pl.col("max_logit").max()).sort("step")}
    out.update({int(g): df.filter(pl.col("layer") == g) for g in sorted(df["layer"].unique().to_list())})
    return {k: downsample(v, "max_logit", max_points=max_points) for k, v in out.items()}


# Compare reads a run of up to FULL_READ_STEPS steps whole (exact, and cheap at that size); a
# longer one at a bounded size however long it is: its perf sample from PERF_SEGMENTS whole
# segments (load_steady_perf), its overlay from the steps rollups (compare.load_overlay).
FULL_READ_STEPS = 20_000
PERF_SEGMENTS = 32


def long_run_span(path: str) -> tuple[int, int] | None:
    """(first, last) step of a run Compare reads in bounded samples (longer than FULL_READ_STEPS),
    None for a shorter one (read whole). From summary.json or two part reads: no table scan."""
    span = reader.run_step_range(path)
    return span if span is not None and span[1] - span[0] + 1 > FULL_READ_STEPS else None


@st.cache_data(max_entries=64, show_spinner=False)
def load_steady_perf(path: str, sig: tuple[int, ...], max_points: int = 3000) -> pl.DataFrame:
    """Steady-state (step, mfu, tokens_per_s), evenly thinned to max_points for violins.

    A run longer than FULL_READ_STEPS is sampled, not read whole: PERF_SEGMENTS 1,000-step
    segments evenly spread over its steady state (one compacted part each), every step of them,
    with the same warm-up cut (from the run's whole span) and the same action filter; then
    thinned as a short run is. Per-step values (a bucket mean would narrow the violin and the
    bootstrap interval), ~32k rows read at any run length."""
    span = long_run_span(path)
    if span is None:
        steps = steady_state(load_steps(path, sig))
    else:
        steps = steady_state(_perf_sample(path, span), span=span)
    steps = steps.select("step", "mfu", "tokens_per_s")
    if steps.height > max_points:
        steps = steps.gather_every(math.ceil(steps.height / max_points))
    return steps


def _perf_sample(path: str, span: tuple[int, int]) -> pl.DataFrame:
    """Every steps row of PERF_SEGMENTS segments spread evenly over [warm-up end, last step]."""
    first, last = layout.segment_of(warmup_end(*span)), layout.segment_of(span[1])
    segs = sorted({int(k) for k in np.linspace(first, last, PERF_SEGMENTS).round()})
    seg = layout.SEGMENT_STEPS
    parts = reader.cached_part_files(path, schema.TABLE_STEPS)
    chosen = [p for k in segs for p in reader.parts_overlapping(parts, k * seg, (k + 1) * seg - 1)]
    keep = pl.any_horizontal([pl.col("step").is_between(k * seg, (k + 1) * seg - 1) for k in segs])
    return (
        reader.scan_table(path, schema.TABLE_STEPS, list(dict.fromkeys(chosen)))
        .select("step", "mfu", "tokens_per_s", "action")
        .filter(keep)
        .collect()
        .sort("step")
    )


def clear_caches() -> None:
    st.cache_data.clear()
    st.cache_resource.clear()
    reader.clear_cache()
