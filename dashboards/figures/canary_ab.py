"""The Canaries page's A/B chart: each pair's B/A ratio in the order the pairs ran, with the
median, its sign-test interval as a band, the fail line and 1 (no change)."""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl

from dashboards.figures.style import LEGEND, MARGIN
from guard.canary.ab_format import Report

ORDER_STYLE = {"AB": ("circle", "#1f77b4"), "BA": ("diamond", "#9467bd")}  # which side ran first
VERDICT_COLOR = {"pass": "#2ca02c", "warn": "#ff7f0e", "fail": "#d62728"}


def ab_pairs_figure(rep: Report, pairs: pl.DataFrame) -> go.Figure:
    """B/A per pair (gated ratio, filled; raw tokens/s, open grey), the verdict's lines and band.

    pairs: dashboards.data.canary_ab.pairs_table(rep)."""
    st = rep["statistic"]
    fig = go.Figure()
    x0, x1 = 0.5, max(pairs["pair"].max() or 1, 1) + 0.5
    lo, hi = st["ci"]
    if lo is not None and hi is not None:
        fig.add_shape(
            type="rect",
            x0=x0,
            x1=x1,
            y0=lo,
            y1=hi,
            fillcolor="rgba(31,119,180,0.12)",
            line={"width": 0},
            layer="below",
        )
    lines = [
        (1.0, "no change (1)", "dot", "#7f7f7f"),
        (st["fail_below"], f"fail line ({st['fail_below']:.3f})", "dash", "#d62728"),
    ]
    if st["median"] is not None:
        lines.append((st["median"], f"median {st['median']:.4f}", "solid", VERDICT_COLOR[rep["verdict"]]))
    for y, name, dash, color in lines:
        fig.add_trace(
            go.Scatter(
                x=[x0, x1],
                y=[y, y],
                mode="lines",
                name=name,
                line={"dash": dash, "color": color, "width": 1.5},
                hoverinfo="skip",
            )
        )
    if lo is not None and hi is not None:  # a legend entry for the band
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=f"interval [{lo:.4f}, {hi:.4f}]",
                marker={"symbol": "square", "size": 12, "color": "rgba(31,119,180,0.25)"},
            )
        )
    fig.add_trace(
        go.Scatter(
            x=pairs["pair"].to_list(),
            y=pairs["B/A tokens/s raw"].to_list(),
            mode="markers",
            name="B/A tokens/s, not normalised",
            marker={"symbol": "circle-open", "size": 9, "color": "#9e9e9e", "line": {"width": 1.5}},
            hovertemplate="pair %{x}: raw B/A %{y:.4f}<extra></extra>",
        )
    )
    for order, (symbol, color) in ORDER_STYLE.items():
        sub = pairs.filter(pl.col("order") == order)
        if sub.height == 0:
            continue
        fig.add_trace(
            go.Scatter(
                x=sub["pair"].to_list(),
                y=sub["B/A (gated)"].to_list(),
                mode="markers",
                name=f"B/A, {order[0]} ran first",
                marker={"symbol": symbol, "size": 12, "color": color},
                hovertext=[
                    f"pair {p} ({o})<br>B/A {r:.4f}<br>load {ld:.1f}<br>A {a}<br>B {b}"
                    for p, o, r, ld, a, b in sub.select(
                        "pair", "order", "B/A (gated)", "load", "A run", "B run"
                    ).iter_rows()
                ],
                hoverinfo="text",
            )
        )
    fig.update_xaxes(
        title_text="pair, in the order measured",
        tickvals=pairs["pair"].to_list(),
        range=[x0, x1],
    )
    fig.update_yaxes(title_text="B / A", tickformat=".3f")
    fig.update_layout(
        title={
            "text": f"A/B canary: B/A per pair ({rep['verdict'].upper()})",
            "x": 0,
            "xanchor": "left",
        },
        height=440,
        legend=LEGEND,
        margin={**MARGIN, "t": 110},
    )
    return fig
