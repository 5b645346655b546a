"""Run health's linked step zoom in streamlit: a box selection on any step chart, or the
sidebar's step-range slider, sets one step range that every step chart of the page draws.

Streamlit cannot link plotly's own zoom across separate `st.plotly_chart`s, so a step chart's
drag is a horizontal box selection (`on_select`): its callback turns the box into (first, last)
step (dashboards/data/step_zoom.py) and writes it to the slider's session state before the page
reruns, so every chart of that rerun, above the dragged one too, has the new x range. The slider
is bound to the URL (`?steps=10&steps=40`); at the run's whole range the parameter is dropped."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
import streamlit as st

from dashboards.data import step_zoom
from dashboards.data.step_zoom import Range

HELP = (
    "Drag across any step chart of the page (loss, precursors, heatmaps, throughput, host) to zoom "
    "all of them to those steps; or set the range here. The range is in the URL, so a zoomed view "
    "can be shared."
)


def control(span: Range) -> Range:
    """The sidebar's step-range slider and "Reset zoom" button; returns the steps to draw."""
    lo, hi = span
    if lo >= hi:  # one step: nothing to zoom
        return span
    have = st.session_state.get(step_zoom.KEY)
    if have is not None and tuple(have) != step_zoom.clamp(have, span):
        st.session_state[step_zoom.KEY] = step_zoom.clamp(have, span)  # another run's zoom, a grown run
    with st.sidebar:
        view = st.slider(
            "Steps shown",
            min_value=lo,
            max_value=hi,
            value=(lo, hi),
            key=step_zoom.KEY,
            bind="query-params",
            help=HELP,
        )
        view = step_zoom.clamp(view, span)
        st.button(
            "Reset zoom",
            key="reset_zoom",
            on_click=_set,
            args=(span,),
            disabled=not step_zoom.is_zoomed(view, span),
            help="Show every step of the run again",
        )
    return view


def chart(fig: go.Figure, *, key: str, span: Range, where: Any = st) -> None:
    """`fig` (x = step) with a drag that zooms every step chart of the page (a horizontal box
    selection) instead of this chart alone."""
    fig.update_layout(dragmode="select", selectdirection="h")
    where.plotly_chart(
        fig,
        key=key,
        on_select=lambda: _on_select(key, span),
        selection_mode="box",
    )


def _on_select(key: str, span: Range) -> None:
    state = st.session_state.get(key)
    view = step_zoom.from_selection(state.get("selection") if state else None, span)
    if view is not None and span[0] < span[1]:
        _set(view)


def _set(view: Range) -> None:
    st.session_state[step_zoom.KEY] = tuple(view)
