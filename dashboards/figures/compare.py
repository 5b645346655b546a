"""The Compare page's charts: one metric of several runs overlaid, and steady-state MFU and
throughput distributions by environment."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from dashboards.data import compare
from dashboards.figures.mfu_marks import MFU_META, mark_mfu_artefacts
from dashboards.figures.style import (
    LEGEND_RIGHT,
    MARGIN,
    RUN_COLORS,
    log_ticks,
    run_line,
)


def compare_overlay(
    per_run: dict[str, pl.DataFrame], *, metric: str, x_axis: str, window: int = 1
) -> go.Figure:
    """One metric of several runs overlaid (a colour and a dash pattern per run, style.run_line)
    against step, tokens or wall time; `per_run` maps run -> (step, x, y) from compare.overlay_series."""
    label, scale, fmt = compare.OVERLAY_METRICS[metric]
    x_title, x_factor = compare.X_AXES[x_axis], 1.0
    if x_axis == "wall":  # in the unit the longest run reads best in
        span = max((float(df["x"].max() or 0.0) for df in per_run.values() if df.height), default=0.0)
        unit, x_factor = compare.wall_unit(span)
        x_title += f" ({unit})"
    fig = go.Figure()
    first = True
    ys: list[np.ndarray] = []
    for i, (run, df) in enumerate(per_run.items()):
        x = df["x"].to_numpy() * x_factor
        y = df["y"].cast(pl.Float64).fill_null(float("nan")).to_numpy() * scale
        y = np.where(np.isfinite(y), y, np.nan)
        ys.append(y)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                name=run,
                line=run_line(i),
                customdata=df["step"].to_numpy(),
                meta=MFU_META if metric == "mfu" else None,
                hovertemplate=f"{run}<br>{x_title} %{{x:,.4g}} (step %{{customdata}})<br>"
                f"{label} %{{y:{fmt}}}<extra></extra>",
            )
        )
        if metric == "mfu":
            first = not mark_mfu_artefacts(fig, x, y, first=first) and first
    if metric == "mfu" and not any(has_mfu(y) for y in ys):
        fig.add_annotation(
            text=NO_MFU, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font={"size": 14}
        )
        fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False)
        fig.update_yaxes(showticklabels=False, showgrid=False, zeroline=False)
    smooth = f", rolling median over {window} steps" if window > 1 else ""
    fig.update_xaxes(title_text=x_title)
    ytitle: dict[str, Any] = {"title_text": label}
    if metric == "grad_norm":
        ytitle.update(type="log", **log_ticks(np.concatenate(ys) if ys else []))
    fig.update_yaxes(**ytitle)
    title = f"{label[:1].upper()}{label[1:]} by {x_title}, runs overlaid{smooth}"
    fig.update_layout(
        title={"text": title, "x": 0, "xanchor": "left"},
        height=460,
        legend={**LEGEND_RIGHT, "title": {"text": "run"}},
        margin={**MARGIN, "t": 60},
        hovermode="closest",
    )
    return fig


NO_MFU = "no run has MFU (no peak for its device): tokens/s is the measure"


def has_mfu(values: object) -> bool:
    """Whether any MFU value is finite (a run with no peak records NaN)."""
    v = np.asarray(values, dtype=float)
    return bool(np.isfinite(v).any())


def compare_distributions(df: pl.DataFrame, group_key: str, *, caveat: str | None = None) -> go.Figure:
    """Violins (with box) of steady-state MFU and tokens/s per value of `group_key`; tokens/s
    alone, saying why, when no run has MFU (empty MFU axes read as a broken chart). `caveat`: what
    the violins cannot show (run-to-run noise), under the title, so it travels with the chart.

    `df` has columns group, run, mfu, tokens_per_s (one row per steady-state step)."""
    with_mfu = df.height > 0 and has_mfu(df["mfu"].cast(pl.Float64).fill_null(float("nan")).to_numpy())
    panels = [("mfu", 100.0), ("tokens_per_s", 1.0)] if with_mfu else [("tokens_per_s", 1.0)]
    fig = make_subplots(
        rows=1,
        cols=len(panels),
        horizontal_spacing=0.1,
        subplot_titles=(
            ("MFU (%), steady state", "Throughput (tokens/s), steady state")
            if with_mfu
            else (f"Throughput (tokens/s), steady state; {NO_MFU}",)
        ),
    )
    groups = sorted(set(df["group"].to_list())) if df.height else []
    artefacts = False
    for i, g in enumerate(groups):
        sub = df.filter(pl.col("group") == g)
        color = RUN_COLORS[i % len(RUN_COLORS)]
        runs = ", ".join(sorted(set(sub["run"].to_list())))
        for k, (c, scale) in enumerate(panels, 1):
            y = sub[c].cast(pl.Float64).fill_null(float("nan")).to_numpy() * scale
            fig.add_trace(
                go.Violin(
                    y=y,
                    name=str(g),
                    legendgroup=str(g),
                    showlegend=k == 1,
                    box_visible=True,
                    meanline_visible=True,
                    points=False,
                    line_color=color,
                    spanmode="hard",
                    # plotly links violins of one name (scalegroup defaults to it): the tokens/s
                    # densities (per 1e4 tokens/s) were drawn at the MFU ones' scale, as hairlines
                    scalegroup=f"{c}:{g}",
                    meta=MFU_META if c == "mfu" else None,
                    hovertemplate=f"{group_key}={g}<br>runs: {runs}<br>%{{y:.4g}}<extra></extra>",
                ),
                row=1,
                col=k,
            )
            if c == "mfu":
                marked = mark_mfu_artefacts(fig, [str(g)] * len(y), y, row=1, col=1, first=not artefacts)
                artefacts = artefacts or marked > 0
    for k, (c, _) in enumerate(panels, 1):
        fig.update_yaxes(title_text="MFU (%)" if c == "mfu" else "tokens/s", row=1, col=k)
        fig.update_xaxes(title_text=group_key, row=1, col=k)
    what = "MFU and throughput" if with_mfu else "throughput"
    title: dict[str, Any] = {"text": f"Steady-state {what} by {group_key}", "x": 0, "xanchor": "left"}
    if caveat:
        title["subtitle"] = {"text": caveat}
    fig.update_layout(
        title=title,
        height=490 if caveat else 460,
        legend={**LEGEND_RIGHT, "title": {"text": group_key}},
        margin={**MARGIN, "t": 110 if caveat else 80},  # the subtitle above the panels' titles
        violinmode="group",
    )
    return fig
