"""Plotly figure builders for the app. Pure: data in (from dashboards.data), figure out.

Conventions every chart follows: a title that says what and how it was aggregated, axis
titles with units, a legend when there is more than one trace, and guard actions always
drawn with the same symbol and colour (ACTION_STYLE) so a reader learns them once.
Trace names are stable ("action: skip", "event: verdict", ...): tests look them up.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from dashboards.data import compare, mfu_peak
from guard.core import schema

# action -> (marker symbol, colour); distinct shapes so they read in grey-scale too
ACTION_STYLE: dict[str, tuple[str, str]] = {
    schema.ACT_SKIP: ("x", "#d62728"),
    schema.ACT_ROLLBACK: ("diamond", "#9467bd"),
    schema.ACT_BIAS_CORRECT: ("square", "#2ca02c"),
    schema.ACT_LR_COOLDOWN: ("triangle-down", "#ff7f0e"),
    schema.ACT_HALT: ("star", "#111111"),
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
RUN_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
_LEGEND = {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0}
_LEGEND_RIGHT = {"orientation": "v", "yanchor": "top", "y": 1.0, "xanchor": "left", "x": 1.01}
_MARGIN = {"l": 60, "r": 20, "t": 70, "b": 50}


def _col(df: pl.DataFrame, c: str) -> np.ndarray | list[Any]:
    """A column for plotly: numeric columns as numpy (validated and serialised as one typed
    array, orders of magnitude faster than lists), strings as lists."""
    s = df[c]
    return s.to_numpy() if s.dtype.is_numeric() else s.to_list()


def _series_xy(df: pl.DataFrame, c: str, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    y = df[c].cast(pl.Float64).fill_null(float("nan")).to_numpy() * scale
    # inf becomes a gap like NaN instead of breaking the axis range
    y = np.where(np.isfinite(y), y, np.nan)
    return df["step"].to_numpy(), y


def _log_ticks(values: np.ndarray | list[Any]) -> dict[str, Any]:
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


MFU_ARTEFACT = "MFU > 100%: measurement artefact"
MFU_META = "mfu"  # trace.meta of every trace that draws MFU in percent (tests find them by it)
_ARTEFACT_HOVER = (
    "<b>MFU %{y:.0f}% at %{x}: above 100% is not physical</b><br>a measurement artefact: the peak "
    "FLOP/s this run divided by was too low<br>(older runs timed their own peak at start-up)"
)


def mark_mfu_artefacts(
    fig: go.Figure,
    x: np.ndarray | list[Any],
    y_pct: np.ndarray | list[Any],
    *,
    row: int | None = None,
    col: int | None = None,
    first: bool = True,
) -> int:
    """Mark every MFU point above 100% as a measurement artefact, and draw the 100% line.

    MFU above 100% is physically impossible; it only happens when the peak was wrong (a CPU run
    that timed its own "peak" on a busy host). It is plotted as it was recorded, never hidden,
    and never without this marker. Returns the number of points marked."""
    yv = np.asarray(y_pct, dtype=float)
    xv = np.asarray(x, dtype=object)
    over = np.isfinite(yv) & (yv > 100.0 * mfu_peak.MFU_LIMIT)
    n = int(over.sum())
    if n == 0:
        return 0
    where = {"row": row, "col": col} if row is not None else {}
    fig.add_trace(
        go.Scatter(
            x=xv[over].tolist(),
            y=yv[over],
            mode="markers",
            name=MFU_ARTEFACT,
            legendgroup=MFU_ARTEFACT,
            showlegend=first,
            marker={"symbol": "x-thin-open", "size": 11, "color": "#d62728", "line": {"width": 2}},
            hovertemplate=_ARTEFACT_HOVER + "<extra></extra>",
        ),
        **where,
    )
    if first:
        fig.add_hline(
            y=100.0 * mfu_peak.MFU_LIMIT,
            line={"color": "#d62728", "dash": "dash", "width": 1},
            annotation_text="100%: physical limit; points above it are measurement artefacts",
            annotation_position="top left",
            annotation_font={"color": "#d62728", "size": 11},
            **where,
        )
    return n


def health_timeline(
    series: dict[str, pl.DataFrame],
    marks: pl.DataFrame,
    timeline: pl.DataFrame,
    *,
    title: str = "Loss and grad norm with guard verdicts and actions",
) -> go.Figure:
    """Loss (top), grad norm (middle, log) with a mark per guard action on both, and a
    timeline lane per detector / event kind (bottom). Hover on a mark shows its evidence."""
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.07,
        row_heights=[0.38, 0.38, 0.24],
        subplot_titles=(
            "Loss",
            "Grad norm (total L2 before clipping, log scale)",
            "Guard timeline: verdicts by detector, other events by kind",
        ),
    )
    if "loss" in series:
        x, y = _series_xy(series["loss"], "loss")
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
        x, y = _series_xy(series["grad_norm"], "grad_norm")
        gn_ticks = _log_ticks(y)
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
    for action, (symbol, color) in ACTION_STYLE.items():
        m = marks.filter(pl.col("action") == action) if marks.height else marks
        if m.height == 0:
            continue
        marker = {"symbol": symbol, "color": color, "size": 13, "line": {"width": 1.5, "color": color}}
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
                    x=_col(m, "step"),
                    y=_col(m, ycol),
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
                        x=_col(nf, "step"),
                        y=_col(nf, ycol),
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
    if timeline.height:
        lanes = sorted(set(timeline["lane"].to_list()))
        for kind, (symbol, color) in EVENT_STYLE.items():
            t = timeline.filter(pl.col("kind") == kind)
            if t.height == 0:
                continue
            fig.add_trace(
                go.Scatter(
                    x=_col(t, "step"),
                    y=_col(t, "lane"),
                    mode="markers",
                    name=f"event: {kind}",
                    marker={
                        "symbol": symbol,
                        "color": color,
                        "size": 10,
                        "line": {"width": 1.5, "color": color},
                    },
                    hovertext=_col(t, "hover"),
                    hoverinfo="text",
                ),
                row=3,
                col=1,
            )
        fig.update_yaxes(categoryorder="array", categoryarray=lanes, row=3, col=1)
        for s in timeline.filter(pl.col("kind") == schema.EV_HALT)["step"].to_list():
            fig.add_vline(x=s, line={"color": "#111111", "dash": "dash", "width": 1})
    fig.update_yaxes(title_text="loss (nats/token)", row=1, col=1)
    fig.update_yaxes(title_text="grad norm", type="log", row=2, col=1, **gn_ticks)
    fig.update_yaxes(title_text="lane", row=3, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_layout(
        title={"text": title, "x": 0, "xanchor": "left"},
        height=820,
        legend={**_LEGEND_RIGHT, "title": {"text": "marks (hover for evidence)"}},
        margin={**_MARGIN, "t": 80},
        hovermode="closest",
    )
    return fig


def heatmap(
    h: dict[str, Any],
    *,
    title: str,
    x_title: str,
    y_title: str,
    z_title: str,
    colorscale: str = "Viridis",
    zmid: float | None = None,
    log: bool = False,
    height: int | None = None,
    z_scale: float = 1.0,
    hover_z: str = "%{z:.3g}",
    zmin: float | None = None,
    zmax: float | None = None,
) -> go.Figure:
    """A heatmap from {"x", "y", "z"} (dashboards.data.shaping.long_to_heat); `log` plots log10(z)."""
    z = np.asarray(h["z"], dtype=float) * z_scale
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(z > 0, np.log10(z), np.nan)
        z_title = f"log10 {z_title}"
    width = h.get("width")
    xlabel = f"steps %{{x}}..+{width - 1}" if width and width > 1 else "step %{x}"
    fig = go.Figure(
        go.Heatmap(
            x=np.asarray(h["x"]),
            y=np.asarray(h["y"]),
            z=z,
            colorscale=colorscale,
            zmid=zmid,
            zmin=zmin,
            zmax=zmax,
            colorbar={"title": {"text": z_title, "side": "right"}},
            hovertemplate=f"{xlabel}<br>{y_title} %{{y}}<br>{z_title} {hover_z}<extra></extra>",
            hoverongaps=False,
        )
    )
    if h.get("marks") and len(h["marks"][0]):  # cells to call out, e.g. non-finite values
        mx, my, label = h["marks"]
        fig.add_trace(
            go.Scatter(
                x=mx,
                y=my,
                mode="markers",
                name=label,
                showlegend=True,
                marker={
                    "symbol": "x",
                    "size": 11,
                    "color": "#d62728",
                    "line": {"width": 1, "color": "white"},
                },
                hovertemplate=f"{label}<br>step %{{x}}<br>{y_title} %{{y}}<extra></extra>",
            )
        )
        fig.update_layout(
            legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1}
        )
    n_y = len(h["y"])
    fig.update_layout(
        title={"text": title, "x": 0, "xanchor": "left"},
        xaxis_title=x_title,
        yaxis_title=y_title,
        height=height or max(260, min(620, 120 + 12 * n_y)),
        margin=_MARGIN,
    )
    if n_y <= 40:
        fig.update_yaxes(dtick=1 if n_y <= 16 else 4)
    return fig


def perf_figure(series: dict[str, pl.DataFrame], peak: mfu_peak.Peak | None = None) -> go.Figure:
    """MFU, tokens/s, step time vs data wait, peak memory: 2 x 2, shared step axis. The MFU
    panel names the peak it divides by; points above 100% are marked as artefacts."""
    mfu_title = "MFU (%)"
    if peak is not None:
        mfu_title = (
            f"MFU (%) of peak {peak.label()}" if peak.flops else "MFU: no peak (tokens/s is the measure)"
        )
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
        x, y = _series_xy(series[c], c, scale)
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
                hovertemplate=f"step %{{x}}<br>{name} {fmt}<extra></extra>",
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
        legend=_LEGEND_RIGHT,
        margin={**_MARGIN, "t": 80},
    )
    return fig


def compare_overlay(
    per_run: dict[str, pl.DataFrame], *, metric: str, x_axis: str, window: int = 1
) -> go.Figure:
    """One metric of several runs overlaid (one colour per run) against step, tokens or wall
    time; `per_run` maps run -> (step, x, y) from compare.overlay_series."""
    label, scale, fmt = compare.OVERLAY_METRICS[metric]
    x_title = compare.X_AXES[x_axis]
    fig = go.Figure()
    first = True
    ys: list[np.ndarray] = []
    for i, (run, df) in enumerate(per_run.items()):
        color = RUN_COLORS[i % len(RUN_COLORS)]
        x = df["x"].to_numpy()
        y = df["y"].cast(pl.Float64).fill_null(float("nan")).to_numpy() * scale
        y = np.where(np.isfinite(y), y, np.nan)
        ys.append(y)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                name=run,
                line={"color": color, "width": 1.3},
                customdata=df["step"].to_numpy(),
                meta=MFU_META if metric == "mfu" else None,
                hovertemplate=f"{run}<br>{x_title} %{{x:,.4g}} (step %{{customdata}})<br>"
                f"{label} %{{y:{fmt}}}<extra></extra>",
            )
        )
        if metric == "mfu":
            first = not mark_mfu_artefacts(fig, x, y, first=first) and first
    smooth = f", rolling median over {window} steps" if window > 1 else ""
    fig.update_xaxes(title_text=x_title)
    ytitle: dict[str, Any] = {"title_text": label}
    if metric == "grad_norm":
        ytitle.update(type="log", **_log_ticks(np.concatenate(ys) if ys else []))
    fig.update_yaxes(**ytitle)
    title = f"{label[:1].upper()}{label[1:]} by {x_title}, runs overlaid{smooth}"
    fig.update_layout(
        title={"text": title, "x": 0, "xanchor": "left"},
        height=460,
        legend={**_LEGEND_RIGHT, "title": {"text": "run"}},
        margin={**_MARGIN, "t": 60},
        hovermode="closest",
    )
    return fig


def compare_curves(per_run: dict[str, dict[str, pl.DataFrame]]) -> go.Figure:
    """Loss and grad norm of several runs overlaid (one colour per run)."""
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1,
        subplot_titles=("Loss", "Grad norm (log scale)"),
    )
    all_gn: list[np.ndarray] = []
    for i, (run, series) in enumerate(per_run.items()):
        color = RUN_COLORS[i % len(RUN_COLORS)]
        for row, c in ((1, "loss"), (2, "grad_norm")):
            if c not in series:
                continue
            x, y = _series_xy(series[c], c)
            if c == "grad_norm":
                all_gn.append(y)
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y,
                    mode="lines",
                    name=run,
                    legendgroup=run,
                    showlegend=row == 1,
                    line={"color": color, "width": 1.2},
                    hovertemplate=f"{run}<br>step %{{x}}<br>{c} %{{y:.4g}}<extra></extra>",
                ),
                row=row,
                col=1,
            )
    fig.update_yaxes(title_text="loss (nats/token)", row=1, col=1)
    fig.update_yaxes(
        title_text="grad norm",
        type="log",
        row=2,
        col=1,
        **_log_ticks(np.concatenate(all_gn) if all_gn else []),
    )
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(
        title={"text": "Loss and grad norm, runs overlaid", "x": 0, "xanchor": "left"},
        height=600,
        legend={**_LEGEND_RIGHT, "title": {"text": "run"}},
        margin={**_MARGIN, "t": 80},
    )
    return fig


def compare_distributions(df: pl.DataFrame, group_key: str) -> go.Figure:
    """Violins (with box) of steady-state MFU and tokens/s per value of `group_key`.

    `df` has columns group, run, mfu, tokens_per_s (one row per steady-state step)."""
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.1,
        subplot_titles=("MFU (%), steady state", "Throughput (tokens/s), steady state"),
    )
    groups = sorted(set(df["group"].to_list())) if df.height else []
    artefacts = False
    for i, g in enumerate(groups):
        sub = df.filter(pl.col("group") == g)
        color = RUN_COLORS[i % len(RUN_COLORS)]
        runs = ", ".join(sorted(set(sub["run"].to_list())))
        for k, (c, scale) in enumerate((("mfu", 100.0), ("tokens_per_s", 1.0)), 1):
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
                    meta=MFU_META if c == "mfu" else None,
                    hovertemplate=f"{group_key}={g}<br>runs: {runs}<br>%{{y:.4g}}<extra></extra>",
                ),
                row=1,
                col=k,
            )
            if c == "mfu":
                marked = mark_mfu_artefacts(fig, [str(g)] * len(y), y, row=1, col=1, first=not artefacts)
                artefacts = artefacts or marked > 0
    fig.update_yaxes(title_text="MFU (%)", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s", row=1, col=2)
    fig.update_xaxes(title_text=group_key, row=1, col=1)
    fig.update_xaxes(title_text=group_key, row=1, col=2)
    fig.update_layout(
        title={"text": f"Steady-state MFU and throughput by {group_key}", "x": 0, "xanchor": "left"},
        height=460,
        legend={**_LEGEND_RIGHT, "title": {"text": group_key}},
        margin={**_MARGIN, "t": 80},
        violinmode="group",
    )
    return fig


def canary_figure(df: pl.DataFrame, gate: dict[str, float | None], *, fingerprint: str) -> go.Figure:
    """MFU p50 per canary run in history order, the gate band around the baseline median,
    each verdict marked (failures as large red crosses)."""
    fig = go.Figure()
    x = df["n"].to_list()
    labels = [s[:7] for s in df["git_sha"].to_list()]
    hover = [
        f"#{n} {s}<br>torch {t}<br>{tm}<br>MFU p50 {m * 100:.2f}%<br>tokens/s p50 {tps if tps is None else f'{tps:,.0f}'}"
        f"<br>verdict <b>{v}</b>{' (baseline)' if b else ''}<br>config {c[:80]}"
        for n, s, t, tm, m, tps, v, b, c in df.select(
            "n", "git_sha", "torch", "time", "mfu_p50", "tokens_per_s_p50", "verdict", "baseline", "config"
        ).iter_rows()
    ]
    base = gate.get("baseline")
    if base is not None and x:
        x0, x1 = min(x) - 0.5, max(x) + 0.5
        fig.add_shape(
            type="rect",
            x0=x0,
            x1=x1,
            y0=gate["warn_lo"] * 100,
            y1=gate["warn_hi"] * 100,  # type: ignore[operator]
            fillcolor="rgba(44,160,44,0.15)",
            line={"width": 0},
            layer="below",
        )
        for y, name, dash, color in (
            (base, "baseline median", "solid", "#2ca02c"),
            (gate["warn_lo"], "warn threshold", "dot", "#ff7f0e"),
            (gate["fail_lo"], "fail threshold", "dash", "#d62728"),
        ):
            fig.add_trace(
                go.Scatter(
                    x=[x0, x1],
                    y=[y * 100, y * 100],
                    mode="lines",
                    name=name,  # type: ignore[operator]
                    line={"dash": dash, "color": color, "width": 1.5},
                    hoverinfo="skip",
                )
            )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=(df["mfu_p50"] * 100).to_list(),
            mode="lines",
            name="MFU p50",
            line={"color": "#1f77b4", "width": 1},
            hoverinfo="skip",
            meta=MFU_META,
        )
    )
    mark_mfu_artefacts(fig, x, (df["mfu_p50"] * 100).to_numpy())
    styles = {
        "pass": ("circle", "#1f77b4", 8),
        "warn": ("triangle-down", "#ff7f0e", 12),
        "fail": ("x", "#d62728", 15),
        "unknown": ("circle-open", "#7f7f7f", 8),
    }
    for verdict, (symbol, color, size) in styles.items():
        idx = [i for i, v in enumerate(df["verdict"].to_list()) if v == verdict]
        if not idx:
            continue
        fig.add_trace(
            go.Scatter(
                x=[x[i] for i in idx],
                y=[df["mfu_p50"][i] * 100 for i in idx],
                mode="markers",
                name=f"canary: {verdict}",
                marker={"symbol": symbol, "color": color, "size": size, "line": {"width": 2, "color": color}},
                hovertext=[hover[i] for i in idx],
                hoverinfo="text",
            )
        )
    bl = [i for i, b in enumerate(df["baseline"].to_list()) if b]
    if bl:
        fig.add_trace(
            go.Scatter(
                x=[x[i] for i in bl],
                y=[df["mfu_p50"][i] * 100 for i in bl],
                mode="markers",
                name="baseline run",
                marker={"symbol": "circle-open", "size": 16, "color": "#2ca02c", "line": {"width": 2}},
                hoverinfo="skip",
            )
        )
    torches = df["torch"].to_list()
    for i in range(1, len(torches)):
        if torches[i] != torches[i - 1]:  # the usual suspect for a step change: say where it happened
            fig.add_vline(
                x=x[i] - 0.5,
                line={"color": "#7f7f7f", "dash": "dot", "width": 1},
                annotation_text=f"torch {torches[i]}",
                annotation_position="top right",
            )
    step = max(1, -(-len(x) // 20))
    fig.update_xaxes(
        tickvals=x[::step],
        ticktext=labels[::step],
        tickangle=-45,
        title_text="canary run (git sha), oldest first",
    )
    fig.update_yaxes(title_text="MFU p50 (%)")
    fig.update_layout(
        title={"text": f"Canary MFU history: {fingerprint}", "x": 0, "xanchor": "left"},
        height=480,
        legend=_LEGEND,
        margin={**_MARGIN, "t": 100, "b": 80},
    )
    return fig
