"""Helpers to read what an AppTest run put on the page."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from streamlit.testing.v1 import AppTest


def charts(at: AppTest) -> list[dict[str, Any]]:
    """The plotly figures on the page, as the JSON the browser receives, with plotly's
    base64 typed arrays ({"dtype", "bdata"}) decoded to lists (NaN -> None) for asserting."""
    return [_decode(json.loads(el.proto.spec)) for el in at.get("plotly_chart")]


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    if isinstance(v.get("bdata"), str) and isinstance(v.get("dtype"), str):
        arr = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]).newbyteorder("<"))
        if shape := v.get("shape"):
            dims = shape if isinstance(shape, list) else str(shape).split(",")
            arr = arr.reshape([int(d) for d in dims])
        return (
            [[_nan_none(x) for x in row] for row in arr.tolist()]
            if arr.ndim == 2
            else [_nan_none(x) for x in arr.tolist()]
        )
    return {k: _decode(x) for k, x in v.items()}


def _nan_none(x: Any) -> Any:
    return None if isinstance(x, float) and x != x else x


def chart_titled(at: AppTest, prefix: str) -> dict[str, Any]:
    for fig in charts(at):
        if str(fig["layout"].get("title", {}).get("text", "")).startswith(prefix):
            return fig
    raise AssertionError(f"no chart titled {prefix!r}; have {[f['layout'].get('title') for f in charts(at)]}")


def traces(fig: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [t for t in fig["data"] if t.get("name") == name]


def messages(at: AppTest) -> list[str]:
    return [e.value for kind in ("error", "warning", "info", "success") for e in getattr(at, kind)]
