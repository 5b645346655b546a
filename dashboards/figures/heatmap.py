"""One heatmap from a {"x", "y", "z"} matrix (per-layer signals, expert load shares), with
cells to call out (non-finite values) marked."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from dashboards.figures.style import (
    MARGIN,
)


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
        margin=MARGIN,
    )
    if n_y <= 40:
        fig.update_yaxes(dtick=1 if n_y <= 16 else 4)
    return fig
