"""MFU above 100% is not physical: every chart that draws MFU marks those points as
measurement artefacts (plotted as recorded, never hidden, never without the marker)."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from dashboards.data import mfu_peak

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
