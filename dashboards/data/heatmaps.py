"""Cached loaders of the per-layer and per-expert heatmaps (the layers and experts tables),
bucketed over steps so a 100k-step run draws as a few hundred columns."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl
import streamlit as st

from dashboards.data.shaping import HEAT_BUCKETS, bucket_grid, finite_or_null, long_to_heat
from guard.core import schema
from guard.store import reader

# Per-layer signals: (column, bucket aggregate, label). max keeps spikes and collapse, min
# keeps entropy drops: a mean would smear a one-step event over the whole bucket.
LAYER_SIGNALS: dict[str, tuple[str, str]] = {
    "grad_norm": ("max", "Per-layer grad norm (bucket max)"),
    "maxvio": ("max", "MaxVio per layer (bucket max, ratio)"),
    "dead_experts": ("max", "Dead experts per layer (bucket max, count)"),
    "router_entropy": ("min", "Router entropy per layer (bucket min, nats)"),
    "load_entropy": ("min", "Load entropy per layer (bucket min, 0..1)"),
    "bias_norm": ("max", "Expert-bias L2 norm per layer (bucket max)"),
    "update_ratio": ("max", "Update ratio ||ΔW|| / ||W|| per layer (bucket max)"),
}


# Expert rows scanned for one over-time heatmap before reading evenly spaced parts only. 50M
# rows is ~0.3-0.6 s of scanning; a 100k-step x 32 x 64 run has 205M. Load shares drift over
# hundreds of steps, so a quarter of the steps in every bucket estimates the bucket's mean
# share to well under a percent; one-step events are in the layers table, read in full.
EXPERT_ROW_BUDGET = 50_000_000

# The "every step" toggle. A store without rollups: every row of the range, however many (as
# before). A rolled-up store: the finest resolution kept with at most EXACT_MAX_COLUMNS columns
# in the range: raw rows for a zoom of up to that many steps kept at full fidelity (the recent
# window, an incident), 10- or 100-step rollups for a wider zoom, and for a whole 1M-step run the
# same 1,000-step rollups as without the toggle. Uncapped it read 10,000 100-step buckets of all
# 58 layers' rollups at 1M (1.86 s) for a chart 2,000 pixels wide.
EXACT_ROWS = 10**15  # row_budget that means "every step"
EXACT_MAX_COLUMNS = 5_000
EXACT_HELP = (
    "Read every step of the range shown. On a long run, whose old steps are kept as rollups, at most "
    f"{EXACT_MAX_COLUMNS:,} columns: zoom to {EXACT_MAX_COLUMNS:,} steps or fewer inside the recent window "
    "or around an incident for every raw step; wider ranges read the finest rollup that fits. Off: the "
    f"chart's ~2,000 columns (and a sample of chunks of a store without rollups past "
    f"{EXPERT_ROW_BUDGET / 1e6:.0f}M rows)."
)


@st.cache_data(max_entries=16, show_spinner=False)
def load_layer_heatmaps(
    path: str, sig: tuple[int, ...], lo: int, hi: int, n_buckets: int = HEAT_BUCKETS
) -> dict[str, dict[str, Any]]:
    """layer x step-bucket matrices for every LAYER_SIGNALS column, in one read of the layers
    table at the resolution [lo, hi] needs (guard/store/reader.read_series: every step of a short
    run, a rollup of a long one; the rollups' min and max are what the bucket extremes come from)."""
    del sig
    width = bucket_grid(lo, hi, n_buckets)
    got = reader.read_series(path, schema.TABLE_LAYERS, columns=tuple(LAYER_SIGNALS), lo=lo, hi=hi)
    aggs = []
    for c, (how, _) in LAYER_SIGNALS.items():
        src = f"{c}_{how}"
        e = finite_or_null(src) if c != "dead_experts" else pl.col(src).cast(pl.Float64)
        aggs.append((e.max() if how == "max" else e.min()).alias(c))
    # a NaN/Inf layer grad norm is dropped from the bucket max above but is the best clue to
    # where a non-finite step came from: keep where it happened (a rollup's mean carries it)
    aggs.append(
        (~pl.col("grad_norm_mean").is_finite() | ~pl.col("grad_norm_max").is_finite())
        .any()
        .alias("gn_nonfinite")
    )
    long = (
        got.frame.lazy()
        .with_columns(b=((pl.col("step") - lo).clip(0) // width) * width + lo)
        .group_by("b", "layer")
        .agg(aggs)
        .collect()
    )
    if long.height == 0:
        return {}
    xs = np.arange(lo, hi + 1, width)
    layers = sorted(long["layer"].unique().to_list())
    out = {}
    for c in LAYER_SIGNALS:
        h = long_to_heat(long, x="b", y="layer", z=c, x_values=xs, y_values=layers)
        if np.isfinite(h["z"]).any():
            h["width"] = width
            h["resolution"] = got.resolution
            out[c] = h
    if "grad_norm" in out:
        bad = long.filter(pl.col("gn_nonfinite").fill_null(False)).sort("b", "layer")
        out["grad_norm"]["marks"] = (bad["b"].to_list(), bad["layer"].to_list(), "non-finite grad norm")
    return out


@st.cache_data(max_entries=16, show_spinner=False)
def all_zero(h: dict[str, Any]) -> bool:
    """No non-zero value in the matrix (NaN cells aside): e.g. the expert-bias norm of a model
    without expert biases (Mixtral), which drew a grey block on a -0.5..0.5 scale."""
    z = np.asarray(h["z"], dtype=float)
    return not bool(np.any(np.nan_to_num(z) != 0))


def load_layer_ids(path: str, sig: tuple[int, ...]) -> list[int]:
    """MoE layers (those with expert rows), read from the newest part only."""
    del sig
    parts = reader.cached_part_files(path, schema.TABLE_EXPERTS)
    if not parts:
        return []
    return sorted(
        reader.scan_table(path, schema.TABLE_EXPERTS, parts[-1:])
        .select(pl.col("layer").unique())
        .collect()["layer"]
        .to_list()
    )


@st.cache_data(max_entries=64, show_spinner=False)
def load_expert_share_over_time(
    path: str,
    sig: tuple[int, ...],
    layer: int,
    lo: int,
    hi: int,
    n_buckets: int = 200,
    row_budget: int = EXPERT_ROW_BUDGET,
) -> dict[str, Any]:
    """expert x step-bucket matrix of one layer's load share (bucket sum of load / layer total).

    A range that needs rollups is read at the resolution the chart needs (reader.read_series: a
    few hundred thousand rows at any run length; "every step" reads the finest kept). A range
    kept at full fidelity (a short run, a store written before rollups) is read whole while its
    rows in [lo, hi] are under `row_budget`;
    past that, evenly spaced parts only, said in "note" (load shares move slowly; spikes are in
    `layers`). Its rows are estimated from the run's steps times the rows a step has, not from
    the newest part (a one-step part written at a checkpoint read as "tiny" and the page read
    every part).
    """
    del sig
    width = bucket_grid(lo, hi, n_buckets)
    note = ""
    exact = row_budget >= EXACT_ROWS
    max_points = EXACT_MAX_COLUMNS if exact else 2000
    if reader.pick_resolution(path, schema.TABLE_EXPERTS, lo, hi, max_points) > 1:
        got = reader.read_series(
            path,
            schema.TABLE_EXPERTS,
            columns=("load",),
            lo=lo,
            hi=hi,
            max_points=max_points,
            where=pl.col("layer") == layer,
        )
        long = got.frame.lazy().with_columns(load=pl.col("load_mean") * pl.col("n"))
        note = f"read at {got.resolution}-step rollups (each step kept whole around every incident)"
        if exact:
            note += (
                f"; 'every step' reads at most {EXACT_MAX_COLUMNS:,} columns: zoom to {EXACT_MAX_COLUMNS:,} "
                "steps or fewer in the recent window or around an incident for raw steps"
            )
    else:  # every step is kept (a short run, a store without rollups): read raw, within the budget
        parts = reader.cached_part_files(path, schema.TABLE_EXPERTS)
        if not parts:
            return {}
        per_step = reader.rows_per_step(path, schema.TABLE_EXPERTS, parts)
        est = per_step * (hi - lo + 1)
        parts = reader.parts_overlapping(parts, lo, hi)
        if est > row_budget and len(parts) > 1:
            stride = math.ceil(est / row_budget)
            parts = parts[::stride]
            note = f"sampled: every {stride}th chunk of the experts table ({len(parts)} chunks, ~{100 / stride:.0f}% of steps)"
        long = reader.scan_steps(path, schema.TABLE_EXPERTS, lo, hi, parts=parts).select(
            "step", "layer", "expert", "load"
        )
    long = (
        long.filter(pl.col("layer") == layer)
        .with_columns(b=((pl.col("step") - lo).clip(0) // width) * width + lo)
        .group_by("b", "expert")
        .agg(pl.col("load").sum())
        .with_columns(share=pl.col("load") / pl.col("load").sum().over("b"))
        .collect()
    )
    if long.height == 0:
        return {}
    h = long_to_heat(long, x="b", y="expert", z="share", x_values=np.arange(lo, hi + 1, width))
    h["note"] = note
    h["width"] = width
    return h


@st.cache_data(max_entries=64, show_spinner=False)
def load_expert_share_now(path: str, sig: tuple[int, ...], window: int = 100) -> dict[str, Any]:
    """layer x expert load share over the last `window` steps (the newest parts only: the recent
    window is always kept at full fidelity)."""
    del sig
    parts = reader.cached_part_files(path, schema.TABLE_EXPERTS)
    if not parts:
        return {}
    last = None
    for p in reversed(parts[-3:]):  # the newest part that reads (a checkpoint may leave a short one)
        last = (
            reader.scan_table(path, schema.TABLE_EXPERTS, [p]).select(pl.col("step").max()).collect().item()
        )
        if last is not None:
            break
    if last is None:
        return {}
    long = (
        reader.scan_steps(path, schema.TABLE_EXPERTS, int(last) - window + 1, int(last), parts=parts)
        .select("step", "layer", "expert", "load")
        .group_by("layer", "expert")
        .agg(pl.col("load").sum(), pl.col("step").min().alias("from"), pl.col("step").max().alias("to"))
        .with_columns(share=pl.col("load") / pl.col("load").sum().over("layer"))
        .collect()
    )
    if long.height == 0:
        return {}
    h = long_to_heat(long, x="expert", y="layer", z="share")
    h["from"], h["to"] = int(long["from"].min()), int(long["to"].max())  # type: ignore[arg-type]
    return h
