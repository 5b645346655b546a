"""Warm-up spans on a chart: a grey band from the run's first step to the step a detector arms,
named in the legend with the detector and its setting, so a fault inside it reads as "not judged
yet", not as "the guard ignored it" (dashboards/data/warmups.py computes the spans).

The band is clipped to the run's steps (the page's one step axis, style.step_range): a 20-step
run with the collapse detector arming at step 250 is grey from end to end and its legend says the
detector never armed, instead of the axis running to 250. The label is a legend entry, not text on
the plot: text at the top of the loss panel sat on the loss line's first, highest steps."""

from __future__ import annotations

import plotly.graph_objects as go

from dashboards.data.warmups import Span
from dashboards.figures.style import step_range

WARMUP_FILL = "rgba(120, 120, 120, 0.10)"
WARMUP_LINE = "rgba(90, 90, 90, 0.75)"
WARMUP_LEGEND = "warm-up"  # the bands' legend group (tests find them by it)


def warmup_label(s: Span, hi: int) -> str:
    """The span's full text (the chart's caption); one that reaches past the run's last step
    `hi` says so."""
    if s.x1 > hi:
        return f"{s.label}: not armed in this run (last step {hi:,})"
    return s.label


def legend_name(s: Span, hi: int) -> str:
    """The band's short legend entry (the caption under the chart has warmup_label's full text):
    a long entry squeezed a 20-step run's plot to a third of the chart's width."""
    who = s.label.split(" warm-up")[0]
    return f"{who} warm-up: to step {s.x1:,}" + ("<br>(not armed in this run)" if s.x1 > hi else "")


def shade_warmups(
    fig: go.Figure, spans: list[Span], *, steps: tuple[int, int], over_heatmap: bool = False
) -> None:
    """A band per span behind the lines (a dashed outline above a heatmap, which would hide a
    band), spanning every subplot, clipped to `steps` = (first, last) step of the run; each named
    in the legend."""
    lo, hi = steps
    left, right = step_range(lo, hi)
    for s in spans:
        x0, x1 = max(left, s.x0 - 0.5), min(right, s.x1 - 0.5)  # steps x0 .. x1-1 are not judged
        if x1 <= x0:
            continue
        if over_heatmap:
            shape = {
                "fillcolor": "rgba(0,0,0,0)",
                "line": {"color": WARMUP_LINE, "width": 1.5, "dash": "dash"},
            }
        else:
            shape = {"fillcolor": WARMUP_FILL, "line": {"width": 0}, "layer": "below"}
        fig.add_shape(
            type="rect",
            xref="x",
            yref="paper",
            x0=x0,
            x1=x1,
            y0=0,
            y1=1,
            name=legend_name(s, hi),
            showlegend=True,
            legendgroup=WARMUP_LEGEND,
            **shape,
        )
    if over_heatmap and spans:
        # a heatmap's colour bar holds the right and its title the top: the legend goes under the
        # step axis' title, the figure taller by as much
        margin = fig.layout.margin.to_plotly_json()
        height, bottom = (fig.layout.height or 260) + 45, (margin.get("b") or 50) + 45
        plot_px = max(60, height - bottom - (margin.get("t") or 70))
        fig.update_layout(  # legend y is a fraction of the plot's height: 58 px below it
            legend={"orientation": "h", "yanchor": "top", "y": -58 / plot_px, "xanchor": "left", "x": 0},
            margin={**margin, "b": bottom},
            height=height,
        )
