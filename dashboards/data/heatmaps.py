"""Cached loaders of the per-layer and per-expert heatmaps (the layers and experts tables),
bucketed over steps so a 100k-step run draws as a few hundred columns."""

from __future__ import annotations

import math
from pathlib import Path
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


@st.cache_data(max_entries=16, show_spinner=False)
def load_layer_heatmaps(
    path: str, sig: tuple[int, ...], lo: int, hi: int, n_buckets: int = HEAT_BUCKETS
) -> dict[str, dict[str, Any]]:
    """layer x step-bucket matrices for every LAYER_SIGNALS column, in one scan."""
    del sig
    width = bucket_grid(lo, hi, n_buckets)
    aggs = []
    for c, (how, _) in LAYER_SIGNALS.items():
        e = finite_or_null(c) if c != "dead_experts" else pl.col(c).cast(pl.Float64)
        aggs.append((e.max() if how == "max" else e.min()).alias(c))
    # a NaN/Inf layer grad norm is dropped from the bucket max above but is the best clue to
    # where a non-finite step came from: keep where it happened
    aggs.append((~pl.col("grad_norm").is_finite()).any().alias("gn_nonfinite"))
    long = (
        reader.scan_table(path, schema.TABLE_LAYERS, cached=True)
        .select("step", "layer", *LAYER_SIGNALS)
        .with_columns(b=((pl.col("step") - lo) // width) * width + lo)
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
            out[c] = h
    if "grad_norm" in out:
        bad = long.filter(pl.col("gn_nonfinite").fill_null(False)).sort("b", "layer")
        out["grad_norm"]["marks"] = (bad["b"].to_list(), bad["layer"].to_list(), "non-finite grad norm")
    return out


@st.cache_data(max_entries=16, show_spinner=False)
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

    Reads every part while the table is under `row_budget` rows; past that it reads evenly
    spaced parts only and says so in "note" (load shares move slowly; spikes are in `layers`).
    """
    del sig
    parts = reader.cached_part_files(path, schema.TABLE_EXPERTS)
    if not parts:
        return {}
    note = ""
    per_part = reader.scan_table(path, schema.TABLE_EXPERTS, parts[-1:]).select(pl.len()).collect().item()
    est = per_part * len(parts)
    if est > row_budget:
        stride = math.ceil(est / row_budget)
        parts = parts[::stride]
        note = f"sampled: every {stride}th chunk of the experts table ({len(parts)} chunks, ~{100 / stride:.0f}% of steps)"
    width = bucket_grid(lo, hi, n_buckets)
    long = (
        reader.scan_table(path, schema.TABLE_EXPERTS, parts)
        .select("step", "layer", "expert", "load")
        .filter(pl.col("layer") == layer)
        .with_columns(b=((pl.col("step") - lo) // width) * width + lo)
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
    """layer x expert load share over the last `window` steps (newest parts only)."""
    del sig
    parts = reader.cached_part_files(path, schema.TABLE_EXPERTS)
    if not parts:
        return {}
    # parts are named by first step: walk back until the window is covered
    tail: list[Path] = []
    last_step = None
    for p in reversed(parts):
        tail.append(p)
        first = int(p.name.split("-")[1])
        if last_step is None:
            last_step = (
                reader.scan_table(path, schema.TABLE_EXPERTS, [p])
                .select(pl.col("step").max())
                .collect()
                .item()
            )
        if last_step is not None and first <= last_step - window:
            break
    long = (
        reader.scan_table(path, schema.TABLE_EXPERTS, tail)
        .select("step", "layer", "expert", "load")
        .filter(pl.col("step") > pl.col("step").max() - window)
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
