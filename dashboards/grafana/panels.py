"""Grafana panel and dashboard builders: plain dicts on Grafana's 24-column grid.

`Layout` hands out panel ids and grid positions in the order panels are built, so a board's
JSON is the same every time it is built (the committed files are compared with a fresh build).
"""

from __future__ import annotations

from typing import Any

from guard.core import schema

DATASOURCE_UID = "moeguard-prometheus"
DS = {"type": "prometheus", "uid": "${datasource}"}


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping rows."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def newline(self) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0

    def take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _target(expr: str, legend: str = "", ref: str = "A", **extra: Any) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref, **extra}


def row(lay: Layout, title: str) -> dict[str, Any]:
    lay.newline()
    return {
        "type": "row",
        "id": lay.take_id(),
        "title": title,
        "collapsed": False,
        "panels": [],
        "gridPos": lay.place(24, 1),
    }


def timeseries(
    lay: Layout,
    title: str,
    targets: list[tuple[str, str]],
    *,
    unit: str = "short",
    description: str = "",
    w: int = 12,
    h: int = 8,
    log: bool = False,
    thresholds: list[tuple[float, str]] | None = None,
    stack: bool = False,
    bars: bool = False,
    min_: float | None = None,
) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 30 if bars else 0,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none"},
    }
    if log:
        custom["scaleDistribution"] = {"type": "log", "log": 10}
    if thresholds:
        custom["thresholdsStyle"] = {"mode": "dashed"}
    defaults: dict[str, Any] = {"unit": unit, "custom": custom, "thresholds": _thresholds(thresholds)}
    if min_ is not None:
        defaults["min"] = min_
    return {
        "type": "timeseries",
        "id": lay.take_id(),
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": lay.place(w, h),
        "targets": [_target(e, leg, chr(ord("A") + i)) for i, (e, leg) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    lay: Layout,
    title: str,
    expr: str,
    *,
    unit: str = "short",
    description: str = "",
    w: int = 4,
    h: int = 4,
    thresholds: list[tuple[float, str]] | None = None,
    decimals: int | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "thresholds": _thresholds(thresholds)}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "id": lay.take_id(),
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": lay.place(w, h),
        "targets": [_target(expr, "", "A", instant=True)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background" if thresholds else "value",
            "graphMode": "area",
            "textMode": "auto",
        },
    }


def heatmap(
    lay: Layout, title: str, expr: str, *, description: str = "", w: int = 12, h: int = 9
) -> dict[str, Any]:
    return {
        "type": "heatmap",
        "id": lay.take_id(),
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": lay.place(w, h),
        "targets": [_target(expr, "{{le}}", "A", format="heatmap")],
        "options": {
            "calculate": False,
            "yAxis": {"unit": "percentunit"},
            "color": {"scheme": "Oranges", "mode": "scheme"},
            "cellGap": 1,
            "tooltip": {"show": True, "yHistogram": True},
        },
    }


def table(
    lay: Layout,
    title: str,
    expr: str,
    *,
    description: str = "",
    w: int = 24,
    h: int = 8,
    hide: tuple[str, ...] = ("Time", "Value", "__name__", "instance", "job"),
) -> dict[str, Any]:
    return {
        "type": "table",
        "id": lay.take_id(),
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": lay.place(w, h),
        "targets": [_target(expr, "", "A", instant=True, format="table")],
        "transformations": [{"id": "organize", "options": {"excludeByName": dict.fromkeys(hide, True)}}],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True},
    }


def _thresholds(steps: list[tuple[float, str]] | None) -> dict[str, Any]:
    base = [{"color": "green", "value": None}]
    return {"mode": "absolute", "steps": base + [{"color": c, "value": v} for v, c in (steps or [])]}


def datasource_var() -> dict[str, Any]:
    return {
        "type": "datasource",
        "name": "datasource",
        "label": "Prometheus",
        "query": "prometheus",
        "current": {"text": DATASOURCE_UID, "value": DATASOURCE_UID},
        "hide": 0,
    }


def query_var(
    name: str, query: str, *, label: str, multi: bool = False, include_all: bool = False
) -> dict[str, Any]:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "multi": multi,
        "includeAll": include_all,
        "hide": 0,
    }


def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: list[dict[str, Any]],
    variables: list[dict[str, Any]],
    annotations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["moeguard"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": variables},
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
            + (annotations or [])
        },
        "links": [
            {
                "title": "moeguard dashboards",
                "type": "dashboards",
                "tags": ["moeguard"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "panels": panels,
    }


def run_var(multi: bool = False) -> dict[str, Any]:
    return query_var(
        "run", f"label_values({schema.M_STEP}, run)", label="run", multi=multi, include_all=multi
    )
