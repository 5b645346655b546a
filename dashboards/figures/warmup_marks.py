"""Warm-up spans on a chart: a grey band from the run's first step to the step a detector arms,
labelled with the detector and its setting, so a fault inside it reads as "not judged yet", not
as "the guard ignored it" (dashboards/data/warmups.py computes the spans)."""

from __future__ import annotations

import plotly.graph_objects as go

from dashboards.data.warmups import Span

WARMUP_FILL = "rgba(120, 120, 120, 0.10)"
WARMUP_LINE = "rgba(90, 90, 90, 0.75)"


def shade_warmups(fig: go.Figure, spans: list[Span], *, over_heatmap: bool = False) -> None:
    """A band per span behind the lines (a dashed outline above a heatmap, which would hide a
    band), spanning every subplot; its label at the top, from the band's left edge rightwards (a
    label that reached left of the first step would widen the axis to negative steps)."""
    for i, s in enumerate(spans):
        if over_heatmap:
            shape = {
                "fillcolor": "rgba(0,0,0,0)",
                "line": {"color": WARMUP_LINE, "width": 1.5, "dash": "dash"},
            }
        else:
            shape = {"fillcolor": WARMUP_FILL, "line": {"width": 0}, "layer": "below"}
        fig.add_shape(
            type="rect", xref="x", yref="paper", x0=s.x0, x1=s.x1, y0=0, y1=1, name=s.label, **shape
        )
        fig.add_annotation(
            x=s.x0,
            xref="x",
            y=1 - 0.045 * i,
            yref="paper",
            xanchor="left",
            yanchor="top",
            text=s.label,
            showarrow=False,
            font={"size": 10, "color": "#444"},
            bgcolor="rgba(255,255,255,0.7)",
        )
