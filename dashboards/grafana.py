"""Grafana dashboards as code, and `moeguard grafana push|export`.

    moeguard grafana export DIR                 write the dashboards' JSON (and datasource.yml)
    moeguard grafana push --url URL [--folder NAME]   create/overwrite them in Grafana
                                                (token from GRAFANA_TOKEN; user:pass in URL works too)

Three dashboards, built as plain dicts from the metric names in guard/core/schema.py (so a rename
there changes the queries here, and a test checks every queried name exists):
  * run overview  (uid moeguard-run):    loss, grad norm, LR, guard verdicts and actions,
                                          MFU and tokens/s against the run's own baseline,
                                          step time, data wait, memory, heartbeats, stragglers
  * per layer     (uid moeguard-layers): per-layer grad norm, MaxVio, dead experts, load and
                                          router entropy, bias norm, expert load-share heatmap
  * fleet         (uid moeguard-fleet):  every run's environment, MFU, throughput, halts,
                                          lost heartbeats, goodput, collector ingest
dashboards/grafana/*.json are this module's output, committed; a test keeps them in sync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from guard.core import schema

GRAFANA_DIR = Path(__file__).resolve().parent / "grafana"
DATASOURCE_UID = "moeguard-prometheus"
TOKEN_ENV = "GRAFANA_TOKEN"
_DS = {"type": "prometheus", "uid": "${datasource}"}
_RUN = 'run="$run"'
_RUN_LAYER = 'run="$run", layer=~"$layer"'


# ---------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------
class _Layout:
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
    return {"datasource": _DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref, **extra}


def row(lay: _Layout, title: str) -> dict[str, Any]:
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
    lay: _Layout,
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
        "datasource": _DS,
        "gridPos": lay.place(w, h),
        "targets": [_target(e, leg, chr(ord("A") + i)) for i, (e, leg) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    lay: _Layout,
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
        "datasource": _DS,
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
    lay: _Layout, title: str, expr: str, *, description: str = "", w: int = 12, h: int = 9
) -> dict[str, Any]:
    return {
        "type": "heatmap",
        "id": lay.take_id(),
        "title": title,
        "description": description,
        "datasource": _DS,
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
    lay: _Layout,
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
        "datasource": _DS,
        "gridPos": lay.place(w, h),
        "targets": [_target(expr, "", "A", instant=True, format="table")],
        "transformations": [{"id": "organize", "options": {"excludeByName": dict.fromkeys(hide, True)}}],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True},
    }


def _thresholds(steps: list[tuple[float, str]] | None) -> dict[str, Any]:
    base = [{"color": "green", "value": None}]
    return {"mode": "absolute", "steps": base + [{"color": c, "value": v} for v, c in (steps or [])]}


def _var_datasource() -> dict[str, Any]:
    return {
        "type": "datasource",
        "name": "datasource",
        "label": "Prometheus",
        "query": "prometheus",
        "current": {"text": DATASOURCE_UID, "value": DATASOURCE_UID},
        "hide": 0,
    }


def _var_query(
    name: str, query: str, *, label: str, multi: bool = False, include_all: bool = False
) -> dict[str, Any]:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": _DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "multi": multi,
        "includeAll": include_all,
        "hide": 0,
    }


def _dashboard(
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


def _run_var(multi: bool = False) -> dict[str, Any]:
    return _var_query(
        "run", f"label_values({schema.M_STEP}, run)", label="run", multi=multi, include_all=multi
    )


def run_overview() -> dict[str, Any]:
    m = schema
    lay = _Layout()
    p: list[dict[str, Any]] = []
    p.append(row(lay, "Now"))
    p.append(stat(lay, "Step", f"{m.M_STEP}{{{_RUN}}}", decimals=0, w=3))
    p.append(stat(lay, "Loss", f"{m.M_LOSS}{{{_RUN}}}", decimals=4))
    p.append(
        stat(
            lay,
            "MFU",
            f"{m.M_MFU}{{{_RUN}}}",
            unit="percentunit",
            decimals=1,
            thresholds=[(1.0001, "red")],
            description="of the peak in the run's meta (peak_flops_source); red above 100%: not physical, "
            "a measurement artefact (a wrong peak)",
        )
    )
    p.append(stat(lay, "Tokens/s", f"{m.M_TOKENS_PER_S}{{{_RUN}}}", unit="short"))
    p.append(
        stat(
            lay,
            "Goodput",
            f"{m.M_GOODPUT}{{{_RUN}}}",
            unit="percentunit",
            decimals=1,
            description="productive step time / wall time",
        )
    )
    p.append(
        stat(
            lay,
            "Halted",
            f"max({m.M_HALTED}{{{_RUN}}})",
            thresholds=[(1, "red")],
            w=2,
            description="1 when the run halted itself and paged",
        )
    )
    p.append(
        stat(
            lay,
            "Guard actions",
            f"sum({m.M_ACTIONS}{{{_RUN}}}) or vector(0)",
            decimals=0,
            w=3,
            description="since the collector started: skipped / rolled-back / halted steps, bias "
            "corrections and LR cool-downs (guard/core/actions.py; the CLI and the app count the same)",
        )
    )
    p.append(row(lay, "Training"))
    p.append(timeseries(lay, "Loss", [(f"{m.M_LOSS}{{{_RUN}}}", "loss")], unit="none"))
    p.append(
        timeseries(
            lay,
            "Grad norm (total, before clipping)",
            [(f"{m.M_GRAD_NORM}{{{_RUN}}}", "grad norm")],
            unit="none",
            log=True,
        )
    )
    p.append(timeseries(lay, "Learning rate", [(f"{m.M_LR}{{{_RUN}}}", "lr")], unit="none", w=8))
    p.append(
        timeseries(
            lay,
            "Guard verdicts by detector",
            [(f"sum by (detector) (increase({m.M_VERDICTS}{{{_RUN}}}[$__rate_interval]))", "{{detector}}")],
            bars=True,
            stack=True,
            w=8,
            description="detector verdicts per interval",
        )
    )
    p.append(
        timeseries(
            lay,
            "Guard actions",
            [
                (f"sum by (action) (increase({m.M_ACTIONS}{{{_RUN}}}[$__rate_interval]))", "{{action}}"),
                (f"increase({m.M_NONFINITE}{{{_RUN}}}[$__rate_interval])", "non-finite steps"),
            ],
            bars=True,
            stack=True,
            w=8,
            description="skipped / rolled-back / halted steps, bias corrections and LR cool-downs "
            "started, per interval (guard/core/actions.py)",
        )
    )
    p.append(row(lay, "Efficiency"))
    p.append(
        timeseries(
            lay,
            "MFU vs the run's own baseline",
            [(f"{m.M_MFU}{{{_RUN}}}", "MFU"), (f"{m.M_MFU_BASELINE}{{{_RUN}}}", "baseline (first window)")],
            unit="percentunit",
            min_=0,
        )
    )
    p.append(
        timeseries(
            lay,
            "Throughput vs baseline",
            [
                (f"{m.M_TOKENS_PER_S}{{{_RUN}}}", "tokens/s"),
                (f"{m.M_TPS_BASELINE}{{{_RUN}}}", "baseline (first window)"),
            ],
            unit="short",
            min_=0,
        )
    )
    p.append(
        timeseries(
            lay,
            "Step time and data-loader wait",
            [(f"{m.M_STEP_TIME}{{{_RUN}}}", "step"), (f"{m.M_DATA_WAIT}{{{_RUN}}}", "data wait")],
            unit="s",
            w=8,
            min_=0,
        )
    )
    p.append(
        timeseries(lay, "Peak memory", [(f"{m.M_MEM_PEAK}{{{_RUN}}}", "peak")], unit="bytes", w=8, min_=0)
    )
    p.append(
        timeseries(
            lay,
            "Tokens consumed (rate)",
            [(f"rate({m.M_TOKENS}{{{_RUN}}}[$__rate_interval])", "tokens/s")],
            unit="short",
            w=8,
            min_=0,
        )
    )
    p.append(row(lay, "Liveness"))
    p.append(
        timeseries(
            lay,
            "Heartbeat age vs timeout per rank",
            [
                (f"{m.M_HEARTBEAT_AGE}{{{_RUN}}}", "age rank {{rank}}"),
                (f"{m.M_HEARTBEAT_TIMEOUT}{{{_RUN}}}", "timeout rank {{rank}}"),
            ],
            unit="s",
            w=8,
        )
    )
    p.append(
        timeseries(
            lay,
            "Straggler score per rank (below 0.75 is slow)",
            [(f"{m.M_STRAGGLER}{{{_RUN}}}", "rank {{rank}}")],
            unit="none",
            w=8,
            thresholds=[(0.75, "transparent")],
        )
    )
    p.append(
        timeseries(
            lay,
            "Seconds since last report",
            [
                (f"time() - max by (rank) ({m.M_LAST_SEEN}{{{_RUN}}})", "rank {{rank}}"),
                (f"max({m.M_HEARTBEAT_LOST}{{{_RUN}}})", "heartbeat lost (1)"),
            ],
            unit="s",
            w=8,
        )
    )
    annotations = [
        {
            "name": "guard actions",
            "enable": True,
            "iconColor": "orange",
            "datasource": _DS,
            "expr": f"sum by (action) (changes({m.M_ACTIONS}{{{_RUN}}}[1m])) > 0",
            "step": "60s",
            "titleFormat": "guard {{action}}",
            "tagKeys": "action",
            "useValueForTime": False,
        },
        {
            "name": "halted",
            "enable": True,
            "iconColor": "red",
            "datasource": _DS,
            "expr": f"{m.M_HALTED}{{{_RUN}}} == 1",
            "step": "60s",
            "titleFormat": "run halted",
        },
    ]
    return _dashboard(
        "moeguard-run",
        "moeguard / run overview",
        "One run: loss, grad norm, guard verdicts and actions, efficiency, liveness.",
        p,
        [_var_datasource(), _run_var()],
        annotations,
    )


def per_layer() -> dict[str, Any]:
    m = schema
    lay = _Layout()
    p: list[dict[str, Any]] = []
    p.append(
        timeseries(
            lay,
            "Per-layer grad norm",
            [(f"{m.M_LAYER_GRAD_NORM}{{{_RUN_LAYER}}}", "layer {{layer}}")],
            log=True,
        )
    )
    p.append(
        timeseries(
            lay,
            "MaxVio per layer ((max load - mean) / mean)",
            [(f"{m.M_LAYER_MAXVIO}{{{_RUN_LAYER}}}", "layer {{layer}}")],
            unit="none",
            min_=0,
        )
    )
    p.append(
        timeseries(
            lay,
            "Dead experts per layer",
            [(f"{m.M_LAYER_DEAD}{{{_RUN_LAYER}}}", "layer {{layer}}")],
            unit="none",
            min_=0,
            thresholds=[(1, "red")],
        )
    )
    p.append(
        timeseries(
            lay,
            "Load entropy per layer (1 = uniform)",
            [(f"{m.M_LAYER_LOAD_ENTROPY}{{{_RUN_LAYER}}}", "layer {{layer}}")],
            unit="percentunit",
            thresholds=[(0.5, "red")],
        )
    )
    p.append(
        timeseries(
            lay,
            "Router entropy per layer (nats)",
            [(f"{m.M_LAYER_ROUTER_ENTROPY}{{{_RUN_LAYER}}}", "layer {{layer}}")],
            unit="none",
        )
    )
    p.append(
        timeseries(
            lay,
            "Expert-bias L2 norm per layer",
            [(f"{m.M_LAYER_BIAS_NORM}{{{_RUN_LAYER}}}", "layer {{layer}}")],
            unit="none",
        )
    )
    p.append(
        heatmap(
            lay,
            "Expert load share distribution (selected layers)",
            f"sum by (le) (increase({m.M_EXPERT_LOAD_SHARE}_bucket{{{_RUN_LAYER}}}[$__rate_interval]))",
            w=24,
            description="How many experts got which share of tokens. Buckets sit at 1/E, 1.5/E "
            "and 2/E for E = 2..256, so a balanced layer is one band at 1/E; a "
            "collapse moves mass to the top buckets and to 0.",
        )
    )
    layer_var = _var_query(
        "layer",
        f'label_values({m.M_LAYER_GRAD_NORM}{{run="$run"}}, layer)',
        label="layer",
        multi=True,
        include_all=True,
    )
    return _dashboard(
        "moeguard-layers",
        "moeguard / per layer",
        "Per-layer gradient and routing health of one run.",
        p,
        [_var_datasource(), _run_var(), layer_var],
    )


def fleet() -> dict[str, Any]:
    m = schema
    lay = _Layout()
    runs = 'run=~"$run"'
    p: list[dict[str, Any]] = []
    p.append(
        table(
            lay,
            "Runs and their environment",
            f"{m.M_RUN_INFO}{{{runs}}}",
            description="torch, device, attention backend, expert kernel (loop / bmm / grouped_mm) and "
            "compile mode per run: filter or sort by them to compare kernel choices",
        )
    )
    p.append(timeseries(lay, "MFU by run", [(f"{m.M_MFU}{{{runs}}}", "{{run}}")], unit="percentunit", min_=0))
    p.append(
        timeseries(
            lay, "Tokens/s by run", [(f"{m.M_TOKENS_PER_S}{{{runs}}}", "{{run}}")], unit="short", min_=0
        )
    )
    p.append(
        timeseries(
            lay,
            "MFU relative to each run's baseline",
            [(f"{m.M_MFU}{{{runs}}} / on (run) {m.M_MFU_BASELINE}{{{runs}}}", "{{run}}")],
            unit="percentunit",
            w=8,
            thresholds=[(0.9, "transparent")],
        )
    )
    p.append(timeseries(lay, "Step by run", [(f"{m.M_STEP}{{{runs}}}", "{{run}}")], unit="none", w=8))
    p.append(
        timeseries(lay, "Goodput by run", [(f"{m.M_GOODPUT}{{{runs}}}", "{{run}}")], unit="percentunit", w=8)
    )
    p.append(
        stat(lay, "Halted runs", f"count({m.M_HALTED}{{{runs}}} == 1) or vector(0)", thresholds=[(1, "red")])
    )
    p.append(
        stat(
            lay,
            "Ranks with lost heartbeat",
            f"sum({m.M_HEARTBEAT_LOST}{{{runs}}}) or vector(0)",
            thresholds=[(1, "red")],
        )
    )
    p.append(
        stat(
            lay,
            "Slowest straggler score",
            f"min({m.M_STRAGGLER}{{{runs}}})",
            decimals=2,
            thresholds=[(0, "red"), (0.75, "green")],
        )
    )
    p.append(stat(lay, "Guard actions (1h)", f"sum(increase({m.M_ACTIONS}{{{runs}}}[1h]))", decimals=0))
    p.append(
        stat(
            lay,
            "Non-finite steps (1h)",
            f"sum(increase({m.M_NONFINITE}{{{runs}}}[1h]))",
            decimals=0,
            thresholds=[(1, "orange")],
        )
    )
    p.append(stat(lay, "Verdicts (1h)", f"sum(increase({m.M_VERDICTS}{{{runs}}}[1h]))", decimals=0))
    p.append(
        timeseries(
            lay,
            "Collector ingest batches by outcome",
            [(f"sum by (outcome) (rate({m.M_INGEST_BATCHES}[$__rate_interval]))", "{{outcome}}")],
            unit="reqps",
        )
    )
    p.append(
        timeseries(
            lay,
            "Collector ingest values",
            [(f"sum(rate({m.M_INGEST_VALUES}[$__rate_interval]))", "values/s")],
            unit="short",
        )
    )
    return _dashboard(
        "moeguard-fleet",
        "moeguard / fleet",
        "Every run at once: environment, efficiency, trouble.",
        p,
        [_var_datasource(), _run_var(multi=True)],
    )


def build_all() -> list[dict[str, Any]]:
    return [run_overview(), per_layer(), fleet()]


def dashboard_json(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def export(out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in build_all():
        p = out / f"{d['uid']}.json"
        p.write_text(dashboard_json(d))
        paths.append(p)
    for extra in ("datasource.yml", "dashboards.yml"):
        src = GRAFANA_DIR / extra
        if src.is_file() and src.resolve() != (out / extra).resolve():
            shutil.copy(src, out / extra)
            paths.append(out / extra)
    return paths


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="grafana_cmd", metavar="ACTION", required=True)
    push = sub.add_parser(
        "push", help="create or overwrite the dashboards in Grafana (token from $GRAFANA_TOKEN)"
    )
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://localhost:3000")
    push.add_argument("--folder", help="folder title to put them in (created if missing)")
    exp = sub.add_parser("export", help="write the dashboards' JSON and the provisioning files to DIR")
    exp.add_argument("dir", metavar="DIR")


def push(url: str, *, folder: str | None = None, token: str | None = None) -> list[dict[str, Any]]:
    """Upload every dashboard with overwrite; returns Grafana's answers."""
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token or None)
    folder_uid = None
    if folder:
        existing = [f for f in api.folder.get_all_folders() if f.get("title") == folder]
        folder_uid = existing[0]["uid"] if existing else api.folder.create_folder(folder)["uid"]
    answers = []
    for d in build_all():
        payload: dict[str, Any] = {
            "dashboard": {**d, "id": None},
            "overwrite": True,
            "message": "moeguard grafana push",
        }
        if folder_uid:
            payload["folderUid"] = folder_uid
        answers.append(api.dashboard.update_dashboard(payload))
    return answers


def run(args: argparse.Namespace) -> int:
    if args.grafana_cmd == "export":
        for p in export(args.dir):
            print(p)
        return 0
    from grafana_client.client import GrafanaException

    try:
        answers = push(args.url, folder=args.folder, token=os.environ.get(TOKEN_ENV))
    except GrafanaException as e:
        print(f"moeguard grafana: push to {args.url} failed: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"moeguard grafana: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    for d, a in zip(build_all(), answers, strict=True):
        print(f"{d['title']}: {a.get('status', 'ok')} {a.get('url', '')}".rstrip())
    return 0


if __name__ == "__main__":  # regenerate the committed JSON: python -m dashboards.grafana
    for path in export(GRAFANA_DIR):
        print(path)
