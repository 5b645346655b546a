"""The three Grafana dashboards, built from the metric names in guard/core/schema.py.

A rename there changes the queries here, and a test checks every queried name exists:
  * run overview  (uid moeguard-run):    loss, grad norm, LR, guard verdicts and actions,
                                          MFU and tokens/s against the run's own baseline,
                                          step time, data wait, memory, heartbeats, stragglers
  * per layer     (uid moeguard-layers): per-layer grad norm, MaxVio, dead experts, load and
                                          router entropy, bias norm, expert load-share heatmap
  * fleet         (uid moeguard-fleet):  every run's environment, MFU, throughput, halts,
                                          lost heartbeats, goodput, collector ingest
Each board is built section by section on one Layout, so panel ids follow the page order.
"""

from __future__ import annotations

import json
from typing import Any

from dashboards.grafana.panels import (
    DS,
    Layout,
    dashboard,
    datasource_var,
    heatmap,
    query_var,
    row,
    run_var,
    stat,
    table,
    timeseries,
)
from guard.core import schema

_RUN = 'run="$run"'
_RUN_LAYER = 'run="$run", layer=~"$layer"'
_RUNS = 'run=~"$run"'  # the fleet board: every selected run


def run_overview() -> dict[str, Any]:
    lay = Layout()
    panels = [*_run_now(lay), *_run_training(lay), *_run_efficiency(lay), *_run_liveness(lay)]
    return dashboard(
        "moeguard-run",
        "moeguard / run overview",
        "One run: loss, grad norm, guard verdicts and actions, efficiency, liveness.",
        panels,
        [datasource_var(), run_var()],
        _run_annotations(),
    )


def _run_now(lay: Layout) -> list[dict[str, Any]]:
    """The headline stats: step, loss, MFU, tokens/s, goodput, halted, guard actions."""
    m = schema
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
    return p


def _run_training(lay: Layout) -> list[dict[str, Any]]:
    """Loss, grad norm, LR, and what the guard said and did."""
    m = schema
    p: list[dict[str, Any]] = []
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
    return p


def _run_efficiency(lay: Layout) -> list[dict[str, Any]]:
    """MFU and throughput against the run's own baseline, step time, memory."""
    m = schema
    p: list[dict[str, Any]] = []
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
    return p


def _run_liveness(lay: Layout) -> list[dict[str, Any]]:
    """Heartbeats, stragglers, and how long since each rank reported."""
    m = schema
    p: list[dict[str, Any]] = []
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
    return p


def _run_annotations() -> list[dict[str, Any]]:
    """Guard actions and halts marked on every time series of the run overview."""
    m = schema
    return [
        {
            "name": "guard actions",
            "enable": True,
            "iconColor": "orange",
            "datasource": DS,
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
            "datasource": DS,
            "expr": f"{m.M_HALTED}{{{_RUN}}} == 1",
            "step": "60s",
            "titleFormat": "run halted",
        },
    ]


def per_layer() -> dict[str, Any]:
    lay = Layout()
    panels = [*_layer_gradients_and_balance(lay), *_layer_routing(lay)]
    layer_var = query_var(
        "layer",
        f'label_values({schema.M_LAYER_GRAD_NORM}{{run="$run"}}, layer)',
        label="layer",
        multi=True,
        include_all=True,
    )
    return dashboard(
        "moeguard-layers",
        "moeguard / per layer",
        "Per-layer gradient and routing health of one run.",
        panels,
        [datasource_var(), run_var(), layer_var],
    )


def _layer_gradients_and_balance(lay: Layout) -> list[dict[str, Any]]:
    """Per-layer grad norm, MaxVio and dead experts."""
    m = schema
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
    return p


def _layer_routing(lay: Layout) -> list[dict[str, Any]]:
    """Load and router entropy, expert-bias norm, and the load-share distribution."""
    m = schema
    p: list[dict[str, Any]] = []
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
    return p


def fleet() -> dict[str, Any]:
    lay = Layout()
    panels = [*_fleet_runs(lay), *_fleet_trouble(lay)]
    return dashboard(
        "moeguard-fleet",
        "moeguard / fleet",
        "Every run at once: environment, efficiency, trouble.",
        panels,
        [datasource_var(), run_var(multi=True)],
    )


def _fleet_runs(lay: Layout) -> list[dict[str, Any]]:
    """Every run's environment, efficiency, progress and goodput."""
    m = schema
    p: list[dict[str, Any]] = []
    p.append(
        table(
            lay,
            "Runs and their environment",
            f"{m.M_RUN_INFO}{{{_RUNS}}}",
            description="torch, device, attention backend, expert kernel (loop / bmm / grouped_mm) and "
            "compile mode per run: filter or sort by them to compare kernel choices",
        )
    )
    p.append(
        timeseries(lay, "MFU by run", [(f"{m.M_MFU}{{{_RUNS}}}", "{{run}}")], unit="percentunit", min_=0)
    )
    p.append(
        timeseries(
            lay, "Tokens/s by run", [(f"{m.M_TOKENS_PER_S}{{{_RUNS}}}", "{{run}}")], unit="short", min_=0
        )
    )
    p.append(
        timeseries(
            lay,
            "MFU relative to each run's baseline",
            [(f"{m.M_MFU}{{{_RUNS}}} / on (run) {m.M_MFU_BASELINE}{{{_RUNS}}}", "{{run}}")],
            unit="percentunit",
            w=8,
            thresholds=[(0.9, "transparent")],
        )
    )
    p.append(timeseries(lay, "Step by run", [(f"{m.M_STEP}{{{_RUNS}}}", "{{run}}")], unit="none", w=8))
    p.append(
        timeseries(lay, "Goodput by run", [(f"{m.M_GOODPUT}{{{_RUNS}}}", "{{run}}")], unit="percentunit", w=8)
    )
    return p


def _fleet_trouble(lay: Layout) -> list[dict[str, Any]]:
    """Halts, lost heartbeats, stragglers, guard activity, and the collector's ingest."""
    m = schema
    p: list[dict[str, Any]] = []
    p.append(
        stat(lay, "Halted runs", f"count({m.M_HALTED}{{{_RUNS}}} == 1) or vector(0)", thresholds=[(1, "red")])
    )
    p.append(
        stat(
            lay,
            "Ranks with lost heartbeat",
            f"sum({m.M_HEARTBEAT_LOST}{{{_RUNS}}}) or vector(0)",
            thresholds=[(1, "red")],
        )
    )
    p.append(
        stat(
            lay,
            "Slowest straggler score",
            f"min({m.M_STRAGGLER}{{{_RUNS}}})",
            decimals=2,
            thresholds=[(0, "red"), (0.75, "green")],
        )
    )
    p.append(stat(lay, "Guard actions (1h)", f"sum(increase({m.M_ACTIONS}{{{_RUNS}}}[1h]))", decimals=0))
    p.append(
        stat(
            lay,
            "Non-finite steps (1h)",
            f"sum(increase({m.M_NONFINITE}{{{_RUNS}}}[1h]))",
            decimals=0,
            thresholds=[(1, "orange")],
        )
    )
    p.append(stat(lay, "Verdicts (1h)", f"sum(increase({m.M_VERDICTS}{{{_RUNS}}}[1h]))", decimals=0))
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
    return p


def build_all() -> list[dict[str, Any]]:
    return [run_overview(), per_layer(), fleet()]


def dashboard_json(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2, sort_keys=True) + "\n"
