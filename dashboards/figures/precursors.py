"""The health page's precursor chart (guard/runtime/precursor.py measures the signals): pure, data
in (from dashboards.data), figure out, in dashboards/figures/style.py's conventions."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from dashboards.data import guard_events
from dashboards.figures.style import LEGEND_RIGHT, LOSS_COLOR, MARGIN, column_values, log_ticks, series_xy
from guard.core import schema

PRECURSOR_COLOR = "#e377c2"
GROUP_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf"]
MAX_SPIKE_LINES = 50  # dotted lines at the first loss-spike episodes, not a wall of them


def precursor_figure(
    series: dict[str, pl.DataFrame], groups: dict[int, pl.DataFrame], events: pl.DataFrame
) -> go.Figure:
    """The precursor signals on a shared step axis: the update ratio ||ΔW|| / ||W|| (log) with
    every precursor verdict and, as dotted lines, the loss spikes they may precede; the grad norm
    per optimizer group (log); Adam's second-moment ratio when the run measured it."""
    has_v = "adam_v_ratio" in series and series["adam_v_ratio"]["adam_v_ratio"].is_finite().any()
    titles = [
        "Update ratio ||ΔW|| / ||W|| (all parameters; markers: precursor verdicts)",
        "Grad norm per optimizer parameter group",
    ]
    if has_v:
        titles.append("Adam second moments: max over parameters of mean(v) / its running median")
    fig = make_subplots(
        rows=len(titles), cols=1, shared_xaxes=True, vertical_spacing=0.1, subplot_titles=titles
    )
    verdicts = events.filter(pl.col("kind") == schema.EV_VERDICT) if events.height else events
    _update_ratio_panel(fig, series.get("update_ratio"), verdicts)
    for k, (g, df) in enumerate(groups.items()):
        _line(fig, df, "grad_norm", f"group {g} grad norm", GROUP_COLORS[k % len(GROUP_COLORS)], row=2)
    ratio = series.get("update_ratio")
    fig.update_yaxes(type="log", title_text="||ΔW|| / ||W||", row=1, col=1, **_ticks([ratio], "update_ratio"))
    fig.update_yaxes(type="log", title_text="grad norm", row=2, col=1, **_ticks(groups.values(), "grad_norm"))
    if has_v:
        _line(fig, series["adam_v_ratio"], "adam_v_ratio", "Adam v ratio", "#bcbd22", row=3)
        v_ticks = _ticks([series["adam_v_ratio"]], "adam_v_ratio")
        fig.update_yaxes(type="log", title_text="ratio", row=3, col=1, **v_ticks)
    fig.update_xaxes(title_text="step", row=len(titles), col=1)
    fig.update_layout(
        title={"text": "Precursors: signals that move before a loss spike", "x": 0, "xanchor": "left"},
        height=260 * len(titles) + 80,
        legend=LEGEND_RIGHT,
        margin={**MARGIN, "t": 80},
    )
    return fig


def _ticks(frames: object, col: str) -> dict[str, object]:
    """1-2-5 log ticks over a column of several frames (plotly's own print bare mantissas)."""
    vals = [f[col].cast(pl.Float64).to_numpy() for f in frames if f is not None and f.height]  # type: ignore[attr-defined]
    return log_ticks(np.concatenate(vals) if vals else [])


def _line(fig: go.Figure, df: pl.DataFrame, col: str, name: str, color: str, *, row: int) -> None:
    x, y = series_xy(df, col)
    fig.add_trace(
        go.Scatter(
            x=x,
            y=y,
            mode="lines",
            name=name,
            line={"color": color, "width": 1.2},
            hovertemplate=f"step %{{x}}<br>{name} %{{y:.3g}}<extra></extra>",
        ),
        row=row,
        col=1,
    )


def _update_ratio_panel(fig: go.Figure, ratio: pl.DataFrame | None, verdicts: pl.DataFrame) -> None:
    """The total update ratio, a marker per precursor verdict (at the layer ratio that fired, the
    layers in the hover) and a dotted line where each loss-spike episode starts (a verdict with
    none the step before): the lead time is the gap."""
    if ratio is not None and ratio.height:
        _line(fig, ratio, "update_ratio", "update ratio", "#555555", row=1)
    if not verdicts.height:
        return
    pre = verdicts.filter(pl.col("detector") == schema.DET_UPDATE_RATIO)
    if pre.height:
        layers = [guard_events.parse_detail(d).get("layers", []) for d in pre["detail"].to_list()]
        fig.add_trace(
            go.Scatter(
                x=column_values(pre, "step"),
                y=column_values(pre, "value"),
                mode="markers",
                name="precursor: update ratio spike",
                marker={"symbol": "triangle-up", "size": 11, "color": PRECURSOR_COLOR},
                customdata=[", ".join(map(str, ls)) for ls in layers],
                hovertemplate="step %{x}<br>layer update ratio %{y:.3g}<br>layers %{customdata}<extra></extra>",
            ),
            row=1,
            col=1,
        )
    flagged = set(verdicts.filter(pl.col("detector") == schema.DET_LOSS_SPIKE)["step"].to_list())
    spikes = sorted(s for s in flagged if s - 1 not in flagged)
    for s in spikes[:MAX_SPIKE_LINES]:
        fig.add_vline(x=s, line={"color": LOSS_COLOR, "dash": "dot", "width": 1}, opacity=0.7, row=1, col=1)
    if spikes:  # the lines' legend entry
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="lines",
                name="loss spike (episode start)",
                line={"color": LOSS_COLOR, "dash": "dot"},
            ),
            row=1,
            col=1,
        )
