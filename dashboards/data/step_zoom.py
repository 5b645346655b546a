"""The Run health page's one step axis and its zoom, as plain values and frames (no streamlit).

Every step chart of the page draws the same x range: the run's steps (`span`, first..last) when
not zoomed, the zoomed `view` when it is. A zoom comes from a box selection on any step chart
(streamlit's plotly selection state: {"box": [{"xref", "yref", "x": [x0, x1], "y": [...]}], ...})
or from the page's step-range slider; it is kept as (first, last) step, both shown, in session
state and in the URL (`?steps=10&steps=40`, the slider's query-param binding)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl

KEY = "steps"  # the slider's session_state key and URL query parameter

Range = tuple[int, int]


def clamp(view: Any, span: Range) -> Range:
    """`view` (a (first, last) pair from session state or the URL) inside `span`; the whole span
    when it is not a pair of numbers or lies wholly outside (another run's zoom, a stale link)."""
    lo, hi = span
    try:
        a, b = sorted(int(v) for v in view)
    except (TypeError, ValueError):
        return span
    if b < lo or a > hi:
        return span
    return max(a, lo), min(b, hi)


def from_selection(selection: Mapping[str, Any] | None, span: Range) -> Range | None:
    """The steps a box selection covers (the union of its boxes, the steps inside them), inside
    `span`; None when there is no box (a click, a lasso, a cleared selection) or it misses the run.
    A box narrower than one step picks the step nearest its middle."""
    boxes = [b for b in (selection or {}).get("box") or () if len(b.get("x") or ()) >= 2]
    xs = [float(x) for b in boxes for x in b["x"] if isinstance(x, int | float) and math.isfinite(x)]
    if len(xs) < 2:
        return None
    x0, x1 = min(xs), max(xs)
    a, b = math.ceil(x0), math.floor(x1)
    if a > b:  # inside one step's cell: the step nearest the middle
        a = b = round((x0 + x1) / 2)
    if b < span[0] or a > span[1]:
        return None
    return clamp((a, b), span)


def is_zoomed(view: Range, span: Range) -> bool:
    return tuple(view) != tuple(span)


def describe(view: Range, span: Range) -> str:
    """'steps 10..40 of 0..299' for the page's caption; the run's range alone when not zoomed."""
    if not is_zoomed(view, span):
        return f"all steps, {span[0]:,}..{span[1]:,}"
    return f"steps {view[0]:,}..{view[1]:,} of {span[0]:,}..{span[1]:,}"


def clip(frames: Any, view: Range) -> Any:
    """A (step, ...) frame, a dict of them or an array of steps, cut to the steps shown: a mark or an evaluation off
    the zoomed range would still set the chart's y-axis (plotly's autorange spans every point)."""
    if isinstance(frames, dict):
        return {k: clip(v, view) for k, v in frames.items()}
    if isinstance(frames, pl.DataFrame) and "step" in frames.columns:
        return frames.filter(pl.col("step").is_between(view[0], view[1]))
    if isinstance(frames, np.ndarray):  # steps
        return frames[(frames >= view[0]) & (frames <= view[1])]
    return frames
