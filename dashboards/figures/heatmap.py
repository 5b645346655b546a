"""One heatmap from a {"x", "y", "z"} matrix (per-layer signals, expert load shares), with
cells to call out (non-finite values) marked."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import plotly.colors as pcolors
import plotly.graph_objects as go

from dashboards.figures.style import MARGIN, fit_step_axis

# Streamlit's plotly theme sends its own colours as placeholders #000001..#000040 and its frontend
# swaps every such string in the figure for a theme colour: Magma's first stop, #000004, came out
# light red, so the smallest update ratios (Run health) were drawn pink under a black colour bar end
_STREAMLIT_PLACEHOLDER = re.compile(r"#0000[0-9]{2}")


def safe_colorscale(scale: str | list[Any]) -> list[list[Any]]:
    """`scale` (a plotly name or [[pos, colour], ...]) with its colours as rgb() strings, so no stop
    can be one of Streamlit's placeholder colours."""
    out = []
    for pos, color in pcolors.get_colorscale(scale) if isinstance(scale, str) else scale:
        c = str(color)
        if _STREAMLIT_PLACEHOLDER.fullmatch(c.lower()):
            c = "rgb({},{},{})".format(*pcolors.hex_to_rgb(c))
        out.append([pos, c])
    return out


def heatmap(
    h: dict[str, Any],
    *,
    title: str,
    x_title: str,
    y_title: str,
    z_title: str,
    colorscale: str | list[Any] = "Viridis",
    zmid: float | None = None,
    log: bool = False,
    height: int | None = None,
    z_scale: float = 1.0,
    hover_z: str = "%{z:.3g}",
    zmin: float | None = None,
    zmax: float | None = None,
    steps: tuple[int, int] | None = None,
    colorbar: dict[str, Any] | None = None,
) -> go.Figure:
    """A heatmap from {"x", "y", "z"} (dashboards.data.shaping.long_to_heat); `log` plots log10(z).

    `steps` = (first, last) step of the run when x is the step: the x-axis is the run's step
    range (style.step_range), the one every chart of the page has. A column of `width` > 1 steps
    (x its first step) is drawn over the steps it covers, not centred on its first step."""
    z = np.asarray(h["z"], dtype=float) * z_scale
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(z > 0, np.log10(z), np.nan)
        z_title = f"log10 {z_title}"
    width = h.get("width") or 1
    shift = (width - 1) / 2  # a column's centre from its first step
    x = np.asarray(h["x"])
    xlabel = f"steps %{{customdata}}..+{width - 1}" if width > 1 else "step %{x}"
    fig = go.Figure(
        go.Heatmap(
            x=x + shift if width > 1 else x,
            y=np.asarray(h["y"]),
            z=z,
            customdata=np.broadcast_to(x, z.shape) if width > 1 and z.size else None,
            colorscale=safe_colorscale(colorscale),
            zmid=zmid,
            zmin=zmin,
            zmax=zmax,
            colorbar={"title": {"text": z_title, "side": "right"}, **(colorbar or {})},
            hovertemplate=f"{xlabel}<br>{y_title} %{{y}}<br>{z_title} {hover_z}<extra></extra>",
            hoverongaps=False,
        )
    )
    if h.get("marks") and len(h["marks"][0]):  # cells to call out, e.g. non-finite values
        mx, my, label = h["marks"]
        fig.add_trace(
            go.Scatter(
                x=np.asarray(mx) + shift if width > 1 else mx,
                y=my,
                customdata=mx,
                mode="markers",
                name=label,
                showlegend=True,
                marker={
                    "symbol": "x",
                    "size": 11,
                    "color": "#d62728",
                    "line": {"width": 1, "color": "white"},
                },
                hovertemplate=f"{label}<br>{xlabel}<br>{y_title} %{{y}}<extra></extra>",
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
    if steps is not None:
        fit_step_axis(fig, *steps)
    return fig


SHARE_BLUE, SHARE_WHITE, SHARE_RED = "#053061", "#f7f7f7", "#67001f"  # RdBu_r's ends and middle


def share_colors(z_pct: Any, n_experts: int) -> dict[str, Any]:
    """The one colour rule of every expert load-share chart (share in %, fixed meaning): 0% (an
    expert that got no tokens) is dark blue, the uniform share 100 / n_experts is white, the
    largest share drawn (at least twice uniform) dark red. The scale never runs below 0 (a
    diverging scale centred on uniform ran to -20 "share %") and is not auto-fitted to the
    values (a window whose shares were 11-14% coloured a 12% expert dark blue, the caption's
    colour for no tokens). Returns heatmap() keyword arguments."""
    uniform = 100.0 / max(1, n_experts)
    z = np.asarray(z_pct, dtype=float)
    top = float(np.nanmax(z)) if z.size and np.isfinite(z).any() else 0.0
    zmax = max(2 * uniform, top)
    mid = uniform / zmax
    ticks = sorted({0.0, uniform, zmax})
    return {
        "colorscale": [
            [0.0, SHARE_BLUE],
            [mid / 2, "#4393c3"],
            [mid, SHARE_WHITE],
            [(1 + mid) / 2, "#d6604d"],
            [1.0, SHARE_RED],
        ],
        "zmin": 0.0,
        "zmax": zmax,
        "zmid": None,
        "colorbar": {
            "tickvals": ticks,
            "ticktext": [
                "0 (no tokens)" if t == 0 else f"{t:.1f} (uniform)" if t == uniform else f"{t:.1f}"
                for t in ticks
            ],
        },
    }
