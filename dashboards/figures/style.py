"""What every chart shares: the guard's action and event symbols (learned once, the same on
every chart), colours, legend and margin layout, and the column helpers that hand plotly numpy."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from guard.core import schema

# action -> (marker symbol, colour); distinct shapes so they read in grey-scale too
ACTION_STYLE: dict[str, tuple[str, str]] = {
    schema.ACT_SKIP: ("x", "#d62728"),
    schema.ACT_ROLLBACK: ("diamond", "#9467bd"),
    schema.ACT_BIAS_CORRECT: ("square", "#2ca02c"),
    schema.ACT_LR_COOLDOWN: ("triangle-down", "#ff7f0e"),
    schema.ACT_HALT: ("star", "#111111"),
    schema.ACT_CLIP: ("x-thin", "#e377c2"),
}


EVENT_STYLE: dict[str, tuple[str, str]] = {
    schema.EV_VERDICT: ("circle", "#d62728"),
    schema.EV_ACTION: ("circle-open", "#9467bd"),
    schema.EV_INJECT: ("bowtie", "#8c564b"),
    schema.EV_RECOVERED: ("circle-open", "#2ca02c"),
    schema.EV_CHECKPOINT: ("line-ns-open", "#7f7f7f"),
    schema.EV_RESUME: ("triangle-right", "#17becf"),
    schema.EV_HALT: ("star", "#111111"),
    schema.EV_OPERATOR: ("hexagon", "#bcbd22"),
    schema.EV_STRAGGLER: ("hourglass", "#e377c2"),
}


LOSS_COLOR = "#1f77b4"


GRAD_COLOR = "#555555"


LR_COLOR = "#8c564b"


RUN_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


# a dash pattern per run as well as a colour: two runs with the same values (bmm and loop
# kernels, one seed) drew one line exactly over the other, and one run seemed missing; solid
# first and widest, so a dashed run on top of it leaves it showing in the gaps
RUN_DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]


def run_line(i: int) -> dict[str, Any]:
    """How the i-th run of an overlay is drawn (plotly `line`); the legend shows the same."""
    dash = RUN_DASHES[i % len(RUN_DASHES)]
    return {"color": RUN_COLORS[i % len(RUN_COLORS)], "dash": dash, "width": 2.4 if dash == "solid" else 1.6}


LEGEND = {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0}


LEGEND_RIGHT = {"orientation": "v", "yanchor": "top", "y": 1.0, "xanchor": "left", "x": 1.01}


MARGIN = {"l": 60, "r": 20, "t": 70, "b": 50}


# The full-width step charts of a page (loss, precursors, throughput) share their margins, so the
# plot areas have one width and a step sits at the same x on each (the legend lives in the right
# margin; a wider legend had narrowed one chart's plot and put step 10 elsewhere on each chart).
# The left margin holds the guard timeline's longest lane name (LANE_NAME_MAX characters; the lane
# axis does not grow it): a lane like collapse_not_recovered had pushed that chart's plot ~90 px right
LANE_NAME_MAX = 24
STEP_MARGIN = {"l": 180, "r": 290, "t": 80, "b": 50}


def step_range(lo: int, hi: int) -> list[float]:
    """The step axis of every chart of a run: the run's own steps, half a step either side (a
    heatmap cell of step s spans s +- 0.5). Not stretched to a detector's warm-up, a checkpoint or
    anything else past the data: a 20-step run drew in the left 8% of an axis that ran to 250."""
    return [lo - 0.5, hi + 0.5]


def fit_step_axis(fig: Any, lo: int, hi: int) -> Any:
    """Give every x-axis of `fig` (a figure whose x is the step) the run's step range."""
    fig.update_xaxes(range=step_range(lo, hi), autorange=False)
    return fig


def column_values(df: pl.DataFrame, c: str) -> np.ndarray | list[Any]:
    """A column for plotly: numeric columns as numpy (validated and serialised as one typed
    array, orders of magnitude faster than lists), strings as lists."""
    s = df[c]
    return s.to_numpy() if s.dtype.is_numeric() else s.to_list()


def series_xy(df: pl.DataFrame, c: str, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    y = df[c].cast(pl.Float64).fill_null(float("nan")).to_numpy() * scale
    # inf becomes a gap like NaN instead of breaking the axis range
    y = np.where(np.isfinite(y), y, np.nan)
    return df["step"].to_numpy(), y


def log_ticks(values: np.ndarray | list[Any]) -> dict[str, Any]:
    """1-2-5 tick values spanning the finite positive values (plotly's own log ticks print
    bare mantissas like "2 5 10 2 5 100", which read as nonsense)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if v.size == 0:
        return {}
    lo, hi = np.floor(np.log10(v.min())), np.ceil(np.log10(v.max()))
    ticks = [m * 10.0**e for e in range(int(lo), int(hi) + 1) for m in (1, 2, 5)]
    ticks = [t for t in ticks if v.min() / 2.5 <= t <= v.max() * 2.5]
    return {"tickvals": ticks, "ticktext": [f"{t:g}" for t in ticks]}
