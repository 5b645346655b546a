"""What keeps big runs fast: nothing per-step reaches the browser.

Line charts are downsampled keeping each bucket's first, last, min and max point plus every
non-finite step and every step with an event (spikes survive); heatmaps are bucketed (integer
step buckets, a max or min per bucket as the signal needs). Pure: no streamlit, no I/O."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl

from guard.core import schema

MAX_LINE_POINTS = 2000  # per series sent to the browser


HEAT_BUCKETS = 300  # columns of a step heatmap


def finite_or_null(col: str) -> pl.Expr:
    return pl.when(pl.col(col).is_finite()).then(pl.col(col))


def downsample(
    df: pl.DataFrame,
    y: str,
    *,
    max_points: int = MAX_LINE_POINTS,
    keep_steps: tuple[int, ...] | list[int] = (),
) -> pl.DataFrame:
    """Rows (step, y) to draw, at most ~max_points plus the kept ones.

    Per step bucket keeps the first, last, min and max row (so a one-step spike survives any
    zoom level), every non-finite row (drawn as a gap; the marks show where), and every step
    in `keep_steps` (steps with events, so a mark sits on a drawn point).
    """
    df = df.select("step", y).sort("step")
    if df.height <= max_points:
        return df
    lo, hi = df["step"][0], df["step"][-1]
    buckets = max(1, max_points // 4)
    width = max(1, math.ceil((hi - lo + 1) / buckets))
    yy = finite_or_null(y)
    idx = df.with_row_index("i").with_columns(b=(pl.col("step") - lo) // width)
    picks = idx.group_by("b").agg(
        pl.col("i").first().alias("first"),
        pl.col("i").last().alias("last"),
        pl.col("i").sort_by(yy, nulls_last=True).first().alias("min"),
        pl.col("i").sort_by(yy, descending=True, nulls_last=True).first().alias("max"),
    )
    keep = pl.concat([picks[c] for c in ("first", "last", "min", "max")]).cast(pl.UInt32)
    special = idx.filter(~pl.col(y).is_finite() | pl.col("step").is_in(list(keep_steps)))["i"].cast(pl.UInt32)
    rows = pl.concat([keep, special]).unique()
    return idx.filter(pl.col("i").is_in(rows.implode())).select("step", y)


def bucket_grid(lo: int, hi: int, n_buckets: int = HEAT_BUCKETS) -> int:
    """Width in steps of one heatmap column so that [lo, hi] fits in n_buckets columns."""
    return max(1, math.ceil((hi - lo + 1) / max(1, n_buckets)))


def long_to_heat(
    df: pl.DataFrame,
    *,
    x: str,
    y: str,
    z: str,
    x_values: np.ndarray | None = None,
    y_values: list[int] | None = None,
) -> dict[str, Any]:
    """Long (x, y, z) rows -> {"x", "y", "z"[len(y)][len(x)]} with NaN where nothing was seen."""
    xs = np.asarray(sorted(df[x].unique().to_list()) if x_values is None else x_values)
    ys = sorted(df[y].unique().to_list()) if y_values is None else list(y_values)
    zz = np.full((len(ys), len(xs)), np.nan)
    if df.height:
        xi = np.searchsorted(xs, df[x].to_numpy())
        ypos = {v: i for i, v in enumerate(ys)}
        yi = np.array([ypos.get(v, -1) for v in df[y].to_list()])
        ok = (yi >= 0) & (xi < len(xs))
        zz[yi[ok], xi[ok]] = df[z].cast(pl.Float64).fill_null(float("nan")).to_numpy()[ok]
    return {"x": xs, "y": ys, "z": zz}


def warmup_end(lo: int, hi: int, *, warmup_frac: float = 0.1, min_warmup: int = 20) -> int:
    """The first steady-state step of a run spanning steps [lo, hi]."""
    return lo + max(min_warmup, int((hi - lo) * warmup_frac))


def steady_state(
    steps: pl.DataFrame,
    *,
    warmup_frac: float = 0.1,
    min_warmup: int = 20,
    span: tuple[int, int] | None = None,
) -> pl.DataFrame:
    """Steps after warm-up (compile, ramp) where the guard did not intervene. `span`: the run's
    (first, last) step when `steps` is a sample of it (default: the frame's own)."""
    if steps.height == 0:
        return steps
    lo, hi = span if span is not None else (steps["step"].min(), steps["step"].max())
    cut = warmup_end(lo, hi, warmup_frac=warmup_frac, min_warmup=min_warmup)  # type: ignore[arg-type]
    return steps.filter(
        (pl.col("step") >= cut)
        & pl.col("action").fill_null(schema.ACT_APPLY).is_in([*schema.APPLYING_ACTIONS, schema.ACT_NONE])
    )
