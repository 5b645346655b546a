"""A step whose value is NaN/Inf has no point on a line, so every chart that draws per-step
series marks those steps with the same thin red tick pinned to the top of the panel: an
unguarded run that went NaN and trained on would otherwise look as if it had stopped there."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import plotly.graph_objects as go
import polars as pl

NONFINITE_COLOR = "#b2182b"


NONFINITE_STEP = "non-finite step"  # the marks' legend entry (tests find them by it)


NONFINITE_MARKER = {"symbol": "line-ns", "size": 10, "line": {"width": 2, "color": NONFINITE_COLOR}}


def nonfinite_steps(steps: pl.DataFrame, columns: Iterable[str]) -> np.ndarray:
    """The steps (sorted, unique) where any of `columns` is NaN or Inf; a null (not measured)
    is not one."""
    cols = [c for c in columns if c in steps.columns]
    if not cols or steps.height == 0:
        return np.array([], dtype=np.int64)
    bad = pl.any_horizontal([(~pl.col(c).cast(pl.Float64).is_finite()).fill_null(False) for c in cols])
    return np.unique(steps.filter(bad)["step"].to_numpy())


def panel_top(values: Iterable[Any]) -> float:
    """Where the ticks sit: the largest finite value drawn in the panel (1.0 when none is)."""
    arrays = [np.asarray(v, dtype=float).ravel() for v in values]
    v = np.concatenate(arrays) if arrays else np.array([])
    v = v[np.isfinite(v)]
    return float(v.max()) if v.size else 1.0


def mark_nonfinite_steps(
    fig: go.Figure,
    steps: np.ndarray | list[int],
    top: float,
    *,
    hover: str,
    row: int,
    col: int = 1,
    first: bool = True,
) -> None:
    """A tick at `top` for each of `steps` in panel (row, col), `hover` saying what was not
    finite; `first` gives the marks their one legend entry."""
    x = np.asarray(steps)
    if x.size == 0:
        return
    fig.add_trace(
        go.Scatter(
            x=x,
            y=np.full(x.size, top),
            mode="markers",
            name=NONFINITE_STEP,
            legendgroup="nonfinite",
            showlegend=first,
            marker=NONFINITE_MARKER,
            hovertemplate=f"step %{{x}}<br>{hover}<extra></extra>",
        ),
        row=row,
        col=col,
    )
