"""Cached loaders of a run's small side tables: the evaluation metrics its loop reported (`evals`)
and the host's utilisation sampled beside its steps (`host`). Same arguments as loaders.py
(run path, `run_signature()`): re-read only when the table gains a part. A run without the table
(written before it existed, or a loop that never evaluated) gives an empty result, and the page
draws no panel for it."""

from __future__ import annotations

import polars as pl
import streamlit as st

from guard.core import schema
from guard.store import reader


@st.cache_data(max_entries=32, show_spinner=False)
def load_evals(path: str, sig: tuple[int, ...]) -> dict[str, pl.DataFrame]:
    """metric name -> its (step, value) rows in step order (the last reported value of a step)."""
    del sig
    df = reader.scan_table(path, schema.TABLE_EVALS, cached=True).collect()
    if df.height == 0:
        return {}
    df = df.sort("step", "time").unique(["name", "step"], keep="last", maintain_order=True)
    return {
        str(name): df.filter(pl.col("name") == name).select("step", pl.col("value").alias(str(name)))
        for name in sorted(df["name"].unique().to_list())
    }


def eval_step_range(evals: dict[str, pl.DataFrame]) -> tuple[int, int] | None:
    """The first and last step with an evaluation, or None."""
    steps = [int(v) for df in evals.values() for v in (df["step"].min(), df["step"].max()) if v is not None]
    return (min(steps), max(steps)) if steps else None


def loss_like(evals: dict[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The evaluation losses (a name with "loss" in it): they share the train loss's axis."""
    return {k: v for k, v in evals.items() if "loss" in k.lower()}


HOST_VALUES = (
    "cpu_pct",
    "rss_bytes",
    "host_mem_used_bytes",
    "host_mem_total_bytes",
    "gpu_util_pct",
    "gpu_mem_used_bytes",
)


@st.cache_data(max_entries=32, show_spinner=False)
def load_host(path: str, sig: tuple[int, ...]) -> pl.DataFrame:
    """The host table in step order (columns of schema.HOST_COLUMNS); empty when the run has none."""
    del sig
    return reader.scan_table(path, schema.TABLE_HOST, cached=True).collect().sort("step", "time")


def host_series(host: pl.DataFrame) -> list[str]:
    """The host columns that have at least one value (a CPU-only run has no GPU columns)."""
    return [c for c in HOST_VALUES if c in host.columns and host[c].drop_nulls().drop_nans().len()]
