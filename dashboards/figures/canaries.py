"""The Canaries page's chart: MFU (CPU efficiency on a CPU class) p50 per canary run in history order, the gate's band around
the baseline median, each verdict marked, torch changes called out."""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl

from dashboards.figures.mfu_marks import MFU_META, mark_mfu_artefacts
from dashboards.figures.style import (
    LEGEND,
    MARGIN,
)


def canary_figure(
    df: pl.DataFrame, gate: dict[str, float | None], *, fingerprint: str, measure: str = "MFU"
) -> go.Figure:
    """`measure` p50 per canary run in history order, the gate band around the baseline median,
    each verdict marked (failures as large red crosses). `measure` names what the history's
    mfu_p50 holds: MFU against a datasheet peak, or on a CPU class (no peak) the CPU efficiency
    the canary gates (guard/canary/keys.py); title, axis, legend and hover say it."""
    fig = go.Figure()
    x = df["n"].to_list()
    # sha and day/time: baselines and re-runs of one build share a sha, and ten identical ticks say nothing
    times = df["time"].to_list() if "time" in df.columns else [None] * df.height
    labels = [
        f"{str(sha)[:7]}<br>{t:%m-%d %H:%M}" if t is not None else str(sha)[:7]
        for sha, t in zip(df["git_sha"].to_list(), times, strict=True)
    ]
    _gate_band(fig, gate, x)
    fig.add_trace(
        go.Scatter(
            x=x,
            y=(df["mfu_p50"] * 100).to_list(),
            mode="lines",
            name=f"{measure} p50",
            line={"color": "#1f77b4", "width": 1},
            hoverinfo="skip",
            meta=MFU_META,
        )
    )
    mark_mfu_artefacts(fig, x, (df["mfu_p50"] * 100).to_numpy())
    _verdict_marks(fig, df, x, measure)
    _torch_changes(fig, df, x)
    step = max(1, -(-len(x) // 20))
    fig.update_xaxes(
        tickvals=x[::step],
        ticktext=labels[::step],
        tickangle=-45,
        title_text="canary run (git sha, UTC time), oldest first",
    )
    fig.update_yaxes(title_text=f"{measure} p50 (%)")
    fig.update_layout(
        title={"text": f"Canary {measure} history: {fingerprint}", "x": 0, "xanchor": "left"},
        height=480,
        legend=LEGEND,
        margin={**MARGIN, "t": 100, "b": 80},
    )
    return fig


def _hover(df: pl.DataFrame, measure: str) -> list[str]:
    """Each canary run's hover text: commit, torch, time, measure and tokens/s p50, verdict, config."""
    return [
        f"#{n} {s}<br>torch {t}<br>{tm}<br>{measure} p50 {m * 100:.2f}%<br>tokens/s p50 {tps if tps is None else f'{tps:,.0f}'}"
        f"<br>verdict <b>{v}</b>{' (baseline)' if b else ''}<br>config {c[:80]}"
        for n, s, t, tm, m, tps, v, b, c in df.select(
            "n", "git_sha", "torch", "time", "mfu_p50", "tokens_per_s_p50", "verdict", "baseline", "config"
        ).iter_rows()
    ]


def _gate_band(fig: go.Figure, gate: dict[str, float | None], x: list[int]) -> None:
    """The band between the warn lines, and the baseline, warn and fail lines (when there is a baseline)."""
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


def _verdict_marks(fig: go.Figure, df: pl.DataFrame, x: list[int], measure: str) -> None:
    """A marker per canary run by its verdict (failures as large red crosses); baseline runs ringed."""
    hover = _hover(df, measure)
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


def _torch_changes(fig: go.Figure, df: pl.DataFrame, x: list[int]) -> None:
    """A dotted line where the torch version changes, the usual suspect for a step change."""
    torches = df["torch"].to_list()
    for i in range(1, len(torches)):
        if torches[i] != torches[i - 1]:  # the usual suspect for a step change: say where it happened
            fig.add_vline(
                x=x[i] - 0.5,
                line={"color": "#7f7f7f", "dash": "dot", "width": 1},
                annotation_text=f"torch {torches[i]}",
                annotation_position="top right",
            )
