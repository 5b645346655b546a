"""The Run health page's line charts: loss and grad norm with the guard's marks and timeline,
and throughput, efficiency and memory."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from dashboards.data import mfu_peak
from dashboards.figures.mfu_marks import MFU_META, mark_mfu_artefacts
from dashboards.figures.nonfinite_marks import mark_nonfinite_steps, panel_top
from dashboards.figures.style import (
    ACTION_STYLE,
    EVENT_STYLE,
    GRAD_COLOR,
    LEGEND_RIGHT,
    LOSS_COLOR,
    LR_COLOR,
    MARGIN,
    STEP_MARGIN,
    column_values,
    fit_step_axis,
    log_ticks,
    series_xy,
)
from guard.core import schema


def health_timeline(
    series: dict[str, pl.DataFrame],
    marks: pl.DataFrame,
    timeline: pl.DataFrame,
    *,
    title: str = "Loss and grad norm with guard verdicts and actions",
    steps: tuple[int, int] | None = None,
    evals: dict[str, pl.DataFrame] | None = None,
) -> go.Figure:
    """Loss (top), grad norm (log) with a mark per guard action on both, the learning rate as
    the optimizer applied it (when the run recorded it: an LR cool-down shows as a step down
    under the loss), and a timeline lane per detector / event kind (bottom), all on one step
    axis: zooming one panel zooms them all. Hover on a mark shows its evidence. `steps` =
    (first, last) step of the run: the x-axis range (style.step_range). `evals`: evaluation
    losses (name -> (step, name) rows: dashboards/data/side_tables.py), drawn over the train loss
    as dots joined by a dashed line; none: nothing is added."""
    has_lr = "lr" in series and bool(series["lr"]["lr"].cast(pl.Float64).is_finite().any())
    titles = ["Loss", "Grad norm (total L2 before clipping, log scale)"]
    heights = [0.38, 0.38]
    if has_lr:
        titles.append("Learning rate (as the optimizer applied it)")
        heights = [0.32, 0.32, 0.14]
    titles.append("Guard timeline: verdicts by detector, other events by kind")
    heights.append(1 - sum(heights))
    lane_row = len(titles)
    fig = make_subplots(
        rows=lane_row,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06 if has_lr else 0.07,
        row_heights=heights,
        subplot_titles=titles,
    )
    gn_ticks = _add_lines(fig, series)
    _add_evals(fig, evals or {})
    _add_nonfinite_steps(fig, series)
    _add_action_marks(fig, marks)
    if has_lr:
        x, y = series_xy(series["lr"], "lr")
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                name="learning rate",
                line={"color": LR_COLOR, "width": 1.2},
                showlegend=False,
                hovertemplate="step %{x}<br>LR %{y:.3g}<extra></extra>",
            ),
            row=3,
            col=1,
        )
        top = float(np.nanmax(y)) if np.isfinite(y).any() else 1.0
        # headroom: a constant LR ran along the panel's top edge, under its title
        fig.update_yaxes(title_text="LR", exponentformat="e", range=[0, 1.2 * top], row=3, col=1)
    _add_timeline(fig, timeline, row=lane_row)
    fig.update_yaxes(title_text="loss (nats/token)", row=1, col=1)
    fig.update_yaxes(title_text="grad norm", type="log", row=2, col=1, **gn_ticks)
    fig.update_yaxes(title_text="lane", row=lane_row, col=1)
    fig.update_xaxes(title_text="step", row=lane_row, col=1)
    fig.update_layout(
        title={"text": title, "x": 0, "xanchor": "left"},
        height=940 if has_lr else 820,
        legend={**LEGEND_RIGHT, "title": {"text": "marks (hover for evidence)"}},
        margin=STEP_MARGIN,
        hovermode="closest",
    )
    if steps is not None:
        fit_step_axis(fig, *steps)
    return fig


def _add_lines(fig: go.Figure, series: dict[str, pl.DataFrame]) -> dict[str, Any]:
    """Loss (row 1) and grad norm (row 2) as lines; returns the grad-norm axis' log ticks."""
    if "loss" in series:
        x, y = series_xy(series["loss"], "loss")
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                name="loss",
                line={"color": LOSS_COLOR, "width": 1.2},
                hovertemplate="step %{x}<br>loss %{y:.4f}<extra></extra>",
            ),
            row=1,
            col=1,
        )
    gn_ticks: dict[str, Any] = {}
    if "grad_norm" in series:
        x, y = series_xy(series["grad_norm"], "grad_norm")
        gn_ticks = log_ticks(y)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                name="grad norm",
                line={"color": GRAD_COLOR, "width": 1.2},
                hovertemplate="step %{x}<br>grad norm %{y:.4g}<extra></extra>",
            ),
            row=2,
            col=1,
        )
    return gn_ticks


EVAL_COLORS = ("#ff7f0e", "#17becf", "#e377c2", "#bcbd22")


def _add_evals(fig: go.Figure, evals: dict[str, pl.DataFrame]) -> None:
    """Each evaluation loss on the loss panel (row 1): a dot per evaluation, a dashed line between."""
    for i, (name, df) in enumerate(sorted(evals.items())):
        x, y = series_xy(df, name)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines+markers",
                name=name,
                line={"color": EVAL_COLORS[i % len(EVAL_COLORS)], "width": 1.2, "dash": "dash"},
                marker={"size": 7},
                hovertemplate=f"evaluated after step %{{x}}<br>{name} %{{y:.4f}}<extra></extra>",
            ),
            row=1,
            col=1,
        )


def _add_nonfinite_steps(fig: go.Figure, series: dict[str, pl.DataFrame]) -> None:
    """A tick pinned to the top of the loss and grad-norm panels at every step whose value is
    NaN/Inf (dashboards/figures/nonfinite_marks.py)."""
    first = True
    for row, col, what in ((1, "loss", "loss"), (2, "grad_norm", "grad norm")):
        if col not in series:
            continue
        x, y = series_xy(series[col], col)
        bad = ~np.isfinite(y)
        if bad.any():
            hover = f"{what} non-finite (no point on the line)"
            mark_nonfinite_steps(fig, x[bad], panel_top([y]), hover=hover, row=row, first=first)
            first = False


def _add_action_marks(fig: go.Figure, marks: pl.DataFrame) -> None:
    """A mark per guard action on both lines; a mark on a non-finite step floats at the top, labelled."""
    for action, (symbol, color) in ACTION_STYLE.items():
        m = marks.filter(pl.col("action") == action) if marks.height else marks
        if m.height == 0:
            continue
        # a step's decision (skip, rollback, halt) drawn larger than the corrections that can share
        # its step (bias_correct, lr_cooldown), so it shows around them instead of under them
        size = 17 if action in (schema.ACT_SKIP, schema.ACT_ROLLBACK, schema.ACT_HALT) else 11
        marker = {"symbol": symbol, "color": color, "size": size, "line": {"width": 1.5, "color": color}}
        for row, ycol, nfcol, what in (
            (1, "y_loss", "nf_loss", "loss"),
            (2, "y_grad_norm", "nf_grad_norm", "grad norm"),
        ):
            hover = [
                h + (f"<br><i>{what} non-finite at this step: mark pinned to the top</i>" if nf else "")
                for h, nf in zip(m["hover"].to_list(), m[nfcol].to_list(), strict=True)
            ]
            fig.add_trace(
                go.Scatter(
                    x=column_values(m, "step"),
                    y=column_values(m, ycol),
                    mode="markers",
                    name=f"action: {action}",
                    legendgroup=action,
                    showlegend=row == 1,
                    marker=marker,
                    hovertext=hover,
                    hoverinfo="text",
                ),
                row=row,
                col=1,
            )
            nf = m.filter(pl.col(nfcol))
            if nf.height:  # the series has a gap there; say why the mark floats
                fig.add_trace(
                    go.Scatter(
                        x=column_values(nf, "step"),
                        y=column_values(nf, ycol),
                        mode="markers+text",
                        text=["non-finite"] * nf.height,
                        marker={"size": 16, "opacity": 0},
                        textposition="top center",
                        textfont={"color": color, "size": 11},
                        showlegend=False,
                        legendgroup=action,
                        hoverinfo="skip",
                        name=f"label: {action}",
                    ),
                    row=row,
                    col=1,
                )


def _add_timeline(fig: go.Figure, timeline: pl.DataFrame, *, row: int) -> None:
    """A lane per detector / event kind (the bottom row), and a dashed line at every halt."""
    if timeline.height == 0:
        return
    lanes = sorted(set(timeline["lane"].to_list()))
    for kind, (symbol, color) in EVENT_STYLE.items():
        t = timeline.filter(pl.col("kind") == kind)
        if t.height == 0:
            continue
        fig.add_trace(
            go.Scatter(
                x=column_values(t, "step"),
                y=column_values(t, "lane"),
                mode="markers",
                name=f"event: {kind}",
                marker={
                    "symbol": symbol,
                    "color": color,
                    "size": 10,
                    "line": {"width": 1.5, "color": color},
                },
                hovertext=column_values(t, "hover"),
                hoverinfo="text",
            ),
            row=row,
            col=1,
        )
    # the lane names fit in STEP_MARGIN's left margin; plotly's automargin widened it for a long
    # one (collapse_not_recovered) and moved this chart's step axis off the other step charts'.
    # Every lane named: with 7 lanes plotly's own ticks dropped one (a demo run's maxvio dot sat
    # on an unlabelled row between nonfinite and lr_spike)
    fig.update_yaxes(
        categoryorder="array",
        categoryarray=lanes,
        tickmode="array",
        tickvals=lanes,
        ticktext=lanes,
        automargin=False,
        row=row,
        col=1,
    )
    for s in timeline.filter(pl.col("kind") == schema.EV_HALT)["step"].to_list():
        fig.add_vline(x=s, line={"color": "#111111", "dash": "dash", "width": 1})


def perf_figure(
    series: dict[str, pl.DataFrame],
    peak: mfu_peak.Peak | None = None,
    *,
    steps: tuple[int, int] | None = None,
) -> go.Figure:
    """MFU, tokens/s, step time vs data wait, peak memory: 2 x 2, shared step axis (`steps`:
    the run's range, style.step_range). The MFU panel names the peak it divides by (mfu_title;
    the peak's key in the MFU line's hover); points above 100% are marked as artefacts."""
    mfu_title = panel_mfu_title(peak)
    peak_hover = f"<br>of peak {peak.label()}" if peak is not None and peak.flops else ""
    fig = make_subplots(
        rows=2,
        cols=2,
        shared_xaxes=True,
        vertical_spacing=0.14,
        horizontal_spacing=0.08,
        subplot_titles=(
            mfu_title,
            "Throughput (tokens/s, all ranks)",
            "Step time and data-loader wait (s)",
            "Peak memory (GiB, rank 0)",
        ),
    )
    specs = [
        ("mfu", 1, 1, 100.0, "MFU", "%{y:.1f}%", "#1f77b4"),
        ("tokens_per_s", 1, 2, 1.0, "tokens/s", "%{y:,.0f}", "#2ca02c"),
        ("step_time_s", 2, 1, 1.0, "step time", "%{y:.3f} s", "#555555"),
        ("data_wait_s", 2, 1, 1.0, "data wait", "%{y:.3f} s", "#ff7f0e"),
        ("mem_peak_bytes", 2, 2, 1 / 2**30, "peak memory", "%{y:.2f} GiB", "#9467bd"),
    ]
    for c, r, k, scale, name, fmt, color in specs:
        if c not in series or series[c].height == 0 or series[c][c].null_count() == series[c].height:
            continue
        x, y = series_xy(series[c], c, scale)
        if c == "mfu" and not np.isfinite(y).any():
            continue  # no peak: nothing to draw (a NaN line reads as a broken chart)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                name=name,
                line={"color": color, "width": 1.2},
                meta=MFU_META if c == "mfu" else None,
                hovertemplate=f"step %{{x}}<br>{name} {fmt}{peak_hover if c == 'mfu' else ''}<extra></extra>",
            ),
            row=r,
            col=k,
        )
        if c == "mfu":
            mark_mfu_artefacts(fig, x, y, row=r, col=k)
    fig.update_yaxes(title_text="MFU (%)", row=1, col=1, rangemode="tozero")
    fig.update_yaxes(title_text="tokens/s", row=1, col=2, rangemode="tozero")
    fig.update_yaxes(title_text="seconds", row=2, col=1, rangemode="tozero")
    fig.update_yaxes(title_text="GiB", row=2, col=2, rangemode="tozero")
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=2)
    fig.update_layout(
        title={"text": "Throughput, efficiency and memory", "x": 0, "xanchor": "left"},
        height=560,
        legend=LEGEND_RIGHT,
        margin=STEP_MARGIN,
    )
    fig.update_xaxes(matches="x")  # 2 x 2: shared_xaxes links columns only, so zoom links all four
    if steps is not None:
        fit_step_axis(fig, *steps)
    return fig


PEAK_WORDS = {
    mfu_peak.PEAK_TABLE: "datasheet",
    mfu_peak.PEAK_PINNED: "pinned",
    mfu_peak.PEAK_SELF: "self-measured",
}


def panel_mfu_title(peak: mfu_peak.Peak | None) -> str:
    """The MFU panel's title: the peak's size and kind only ("MFU (%) of peak 107 GFLOP/s, pinned").
    Its key (the CPU class and dtype, the datasheet row) is in the line's hover and the caption: a
    pinned CPU peak's full label outgrew the half-width panel and was cut at its left edge."""
    if peak is None:
        return "MFU (%)"
    if not peak.flops:
        return "MFU: no peak (tokens/s is the measure)"
    return f"MFU (%) of peak {mfu_peak.fmt_flops(peak.flops)}, {PEAK_WORDS.get(peak.kind, peak.kind)}"


HOST_SPECS = (
    # column, row, scale, name, hover format, colour
    ("cpu_pct", 1, 1.0, "process CPU", "%{y:.0f}%", "#2ca02c"),
    ("gpu_util_pct", 1, 1.0, "GPU utilisation", "%{y:.0f}%", "#d62728"),
    ("rss_bytes", 2, 1 / 2**30, "process RSS", "%{y:.2f} GiB", "#9467bd"),
    ("host_mem_used_bytes", 2, 1 / 2**30, "host memory used", "%{y:.2f} GiB", "#8c564b"),
    ("gpu_mem_used_bytes", 2, 1 / 2**30, "GPU memory used", "%{y:.2f} GiB", "#e377c2"),
)


def host_figure(host: pl.DataFrame, *, steps: tuple[int, int] | None = None) -> go.Figure:
    """Host utilisation sampled beside the steps (the host table, rank 0's host): CPU and GPU
    utilisation (%) over memory (GiB), on the page's step axis. A column with no value (no GPU, no
    pynvml) draws no line."""
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_xaxes=True,
        horizontal_spacing=0.08,
        subplot_titles=("Utilisation (% of one core / of the GPU)", "Memory (GiB)"),
    )
    total = host["host_mem_total_bytes"].drop_nulls() if "host_mem_total_bytes" in host.columns else None
    for c, col, scale, name, fmt, color in HOST_SPECS:
        if c not in host.columns or not host[c].cast(pl.Float64).drop_nulls().drop_nans().len():
            continue
        x, y = series_xy(host, c, scale)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines+markers" if host.height <= 60 else "lines",
                marker={"size": 4},
                name=name,
                line={"color": color, "width": 1.2},
                hovertemplate=f"step %{{x}}<br>{name} {fmt}<extra></extra>",
            ),
            row=1,
            col=col,
        )
    mem_title = "GiB"
    if total is not None and total.len():
        mem_title = f"GiB (host has {float(total[-1]) / 2**30:.0f})"
    fig.update_yaxes(title_text="%", row=1, col=1, rangemode="tozero")
    fig.update_yaxes(title_text=mem_title, row=1, col=2, rangemode="tozero")
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_layout(
        title={
            "text": "Host utilisation (rank 0's host, sampled off the step's path)",
            "x": 0,
            "xanchor": "left",
        },
        height=340,
        legend=LEGEND_RIGHT,
        margin=STEP_MARGIN,
    )
    fig.update_xaxes(matches="x")
    if steps is not None:
        fit_step_axis(fig, *steps)
    return fig


# where the wall time went (guard/core/goodput.py's split), productive first, in its colour
GOODPUT_PARTS: tuple[tuple[str, str, str], ...] = (
    ("productive_s", "productive (goodput)", "#2ca02c"),
    ("startup_s", "start-up", "#9edae5"),
    ("data_wait_s", "data wait", "#ff7f0e"),
    ("checkpoint_s", "checkpoints", "#7f7f7f"),
    ("skipped_s", "skipped by the guard", "#d62728"),
    ("nonfinite_s", "non-finite, applied", "#b2182b"),
    ("rolled_back_s", "rolled back", "#9467bd"),
    ("restarts_s", "restarts", "#17becf"),
    ("other_s", "other (logging, telemetry, rounding)", "#c7c7c7"),
)


def goodput_figure(gp: dict[str, Any]) -> go.Figure:
    """One bar of the run's wall time split into goodput and badput by cause (meta.json
    "goodput", guard/core/goodput.py), each part's seconds and share in its hover and, when wide
    enough, on the bar."""
    wall = float(gp.get("wall_s") or 0.0)
    fig = go.Figure()
    for key, label, color in GOODPUT_PARTS:
        v = gp.get(key)
        if not isinstance(v, int | float) or v <= 0 or wall <= 0:
            continue
        share = v / wall
        fig.add_trace(
            go.Bar(
                x=[100 * share],
                y=["wall time"],
                orientation="h",
                name=f"{label} {100 * share:.1f}%",
                marker={"color": color},
                text=[f"{label.split(' (')[0]} {100 * share:.0f}%" if share >= 0.08 else ""],
                textposition="inside",
                insidetextanchor="middle",
                hovertemplate=f"{label}<br>{v:,.1f} s = {100 * share:.1f}% of {wall:,.1f} s<extra></extra>",
            )
        )
    g = gp.get("goodput")
    head = f"Goodput {100 * g:.1f}%" if isinstance(g, int | float) else "Goodput"
    fig.update_layout(
        title={
            "text": f"{head}: where the run's {_duration(wall)} of wall time went",
            "x": 0,
            "xanchor": "left",
        },
        barmode="stack",
        height=300,
        # the parts in the bar's order (a horizontal legend of stacked bars runs backwards), below
        # the axis title
        legend={
            "orientation": "h",
            "yanchor": "top",
            "y": -0.6,
            "xanchor": "left",
            "x": 0,
            "traceorder": "normal",
        },
        margin={**MARGIN, "t": 50, "b": 110},
        xaxis={"range": [0, 100], "title": {"text": "% of wall time since the run's first start"}},
        yaxis={"showticklabels": False},
    )
    return fig


def _duration(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.0f} s"
