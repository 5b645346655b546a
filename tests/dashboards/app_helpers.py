"""Helpers to read what an AppTest run put on the page."""

from __future__ import annotations

import json
from typing import Any

from streamlit.testing.v1 import AppTest


def charts(at: AppTest) -> list[dict[str, Any]]:
    """The plotly figures on the page, as the JSON the browser receives."""
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def chart_titled(at: AppTest, prefix: str) -> dict[str, Any]:
    for fig in charts(at):
        if str(fig["layout"].get("title", {}).get("text", "")).startswith(prefix):
            return fig
    raise AssertionError(f"no chart titled {prefix!r}; have {[f['layout'].get('title') for f in charts(at)]}")


def traces(fig: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [t for t in fig["data"] if t.get("name") == name]


def messages(at: AppTest) -> list[str]:
    return [e.value for kind in ("error", "warning", "info", "success") for e in getattr(at, kind)]
