"""Cached loaders of one run's steps and events tables, and the run summary.

Arguments are (run path as str, `run_signature()`, knobs): all hashable and cheap, so a loader
re-reads a run only when it gained a part file. The run store is read through
guard/store/reader.py (one listing, one part-name parser, one tolerant scan); the app lists parts
with its cache (`cached=True`): it re-lists long runs on every rerun. Reads are lazy polars scans
with projection."""

from __future__ import annotations

import math
from typing import Any

import polars as pl
import streamlit as st

from dashboards.data.guard_events import action_marks, timeline_rows
from dashboards.data.mfu_peak import MFU_LIMIT
from dashboards.data.shaping import MAX_LINE_POINTS, downsample, steady_state
from guard.core import actions, schema
from guard.store import reader
from guard.store.reader import count_actions


@st.cache_data(max_entries=512, show_spinner=False)
def load_summary(path: str, sig: tuple[int, ...]) -> dict[str, Any]:
    """Latest step, loss, recent MFU and tokens/s, guard action and verdict counts."""
    del sig
    out: dict[str, Any] = {
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


_STEP_COLS = [
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


# The two raw frames are shared, not copied: cache_resource hands out the same (immutable)
# polars frame instead of pickling 100k rows on every store and hit. Callers never mutate.
@st.cache_resource(max_entries=16, show_spinner=False)
def load_steps(path: str, sig: tuple[int, ...]) -> pl.DataFrame:
    """The steps table (projected), sorted by step."""
    del sig
    df = reader.scan_table(path, schema.TABLE_STEPS, cached=True).select(_STEP_COLS).collect()
    # parts arrive in step order; only a resumed or rolled-back run needs the sort
    return df if df["step"].is_sorted() else df.sort("step", "time")


@st.cache_resource(max_entries=64, show_spinner=False)
def load_events(path: str, sig: tuple[int, ...]) -> pl.DataFrame:
    del sig
    return reader.scan_table(path, schema.TABLE_EVENTS, cached=True).sort("step", "time").collect()


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


@st.cache_data(max_entries=16, show_spinner=False)
def load_group_series(
    path: str, sig: tuple[int, ...], column: str, max_points: int = MAX_LINE_POINTS
) -> dict[int, pl.DataFrame]:
    """optimizer group -> downsampled (step, `column`) rows of the `groups` table."""
    del sig
    df = reader.scan_table(path, schema.TABLE_GROUPS, cached=True).select("step", "group", column).collect()
    return {
        int(g): downsample(df.filter(pl.col("group") == g), column, max_points=max_points)
        for g in sorted(df["group"].unique().to_list())
    }


MAX_OVER_LAYERS = -1  # load_max_logits' key of the max over layers


@st.cache_data(max_entries=16, show_spinner=False)
def load_max_logits(
    path: str, sig: tuple[int, ...], max_points: int = MAX_LINE_POINTS
) -> dict[int, pl.DataFrame]:
    """layer -> downsampled (step, max_logit) rows of the `layers` table at the steps it was
    sampled (every guard.precursor.max_logit_every-th; the NaN rows between are dropped, not drawn
    as gaps), and MAX_OVER_LAYERS -> the max over layers. Empty when the run never sampled it."""
    del sig
    df = (
        reader.scan_table(path, schema.TABLE_LAYERS, cached=True)
        .select("step", "layer", "max_logit")
        .filter(pl.col("max_logit").is_finite())
        .collect()
    )
    if not df.height:
        return {}
    out = {MAX_OVER_LAYERS: df.group_by("step").agg(pl.col("max_logit").max())}
    out.update({int(g): df.filter(pl.col("layer") == g) for g in sorted(df["layer"].unique().to_list())})
    return {k: downsample(v, "max_logit", max_points=max_points) for k, v in out.items()}


@st.cache_data(max_entries=64, show_spinner=False)
def load_steady_perf(path: str, sig: tuple[int, ...], max_points: int = 3000) -> pl.DataFrame:
    """Steady-state (step, mfu, tokens_per_s), evenly thinned to max_points for violins."""
    steps = steady_state(load_steps(path, sig)).select("step", "mfu", "tokens_per_s")
    if steps.height > max_points:
        steps = steps.gather_every(math.ceil(steps.height / max_points))
    return steps


def clear_caches() -> None:
    st.cache_data.clear()
    st.cache_resource.clear()
    reader.clear_cache()
