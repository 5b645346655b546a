"""The app's one data module: run discovery, cached loaders, downsampling, aggregation.

Pages stay thin: they call the `load_*` functions here and hand the results to
`dashboards.figures`. Every loader is `st.cache_data`, keyed by the run folder plus
`run_signature()` (the newest modification time of meta.json and of each table folder; a
new part file is an atomic rename into its table folder, which moves that folder's mtime),
so a live run refreshes on the next rerun and a finished one is read once.

Reads are lazy polars scans with projection. Big runs stay fast because nothing per-step
reaches the browser: line charts are downsampled keeping each bucket's first, last, min and
max point plus every non-finite step and every step with an event (spikes survive), and
heatmaps are bucketed (integer step buckets, a max or min per bucket as the signal needs).

Nothing here imports torch; nothing here draws.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import streamlit as st

from guard.canary import keys as ck
from guard.canary.config import CanaryConfig
from guard.canary.gate import baseline_median, line_value, relative_delta
from guard.canary.history import baseline_before, entry_time, is_number, parse_history
from guard.core import actions, schema
from guard.store import reader
from guard.store.reader import count_actions, list_runs, read_meta
from guard.wire.runs import RunListing, parse_runs

# Actions marked on the charts (every event that names one, evidence merged per step and action).
# Counting them is guard/core/actions.py's job: one definition for the CLI, meta.json, app and /metrics.
ACTIVE_ACTIONS = (
    schema.ACT_SKIP,
    schema.ACT_ROLLBACK,
    schema.ACT_BIAS_CORRECT,
    schema.ACT_LR_COOLDOWN,
    schema.ACT_HALT,
)
ENV_KEYS = ("torch", "attention_backend", "expert_kernel", "compile")
DEFAULT_STALE_S = 300.0
MAX_LINE_POINTS = 2000  # per series sent to the browser
HEAT_BUCKETS = 300  # columns of a step heatmap
# Expert rows scanned for one over-time heatmap before reading evenly spaced parts only. 50M
# rows is ~0.3-0.6 s of scanning; a 100k-step x 32 x 64 run has 205M. Load shares drift over
# hundreds of steps, so a quarter of the steps in every bucket estimates the bucket's mean
# share to well under a percent; one-step events are in the layers table, read in full.
EXPERT_ROW_BUDGET = 50_000_000
ENV_RUNS = "MOEGUARD_APP_RUNS"
ENV_HISTORY = "MOEGUARD_APP_HISTORY"
ENV_COLLECTOR = "MOEGUARD_APP_COLLECTOR"


# ---------------------------------------------------------------------------------------
# Configuration: `streamlit run app.py -- --runs DIR ...`, else environment variables
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AppConfig:
    runs_dir: Path
    history: Path | None = None
    collector: str | None = None


def app_config(argv: list[str] | None = None) -> AppConfig:
    """The app's settings from its command line (after `--`), falling back to env vars."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--runs")
    p.add_argument("--history")
    p.add_argument("--collector")
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    runs = args.runs or os.environ.get(ENV_RUNS) or "runs"
    history = args.history or os.environ.get(ENV_HISTORY) or None
    collector = args.collector or os.environ.get(ENV_COLLECTOR) or None
    return AppConfig(runs_dir=Path(runs), history=Path(history) if history else None, collector=collector)


# ---------------------------------------------------------------------------------------
# Run discovery and compatibility
# ---------------------------------------------------------------------------------------
COMPAT_OK = "ok"
COMPAT_OLDER = "older"
COMPAT_NEWER = "newer"
COMPAT_UNREADABLE = "unreadable"


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What the app knows about a run before reading any table."""

    run_id: str  # the run folder's name (unique under the run store; meta.json may repeat it)
    path: str
    meta: dict[str, Any]
    status: str  # RUN_STATUSES, "stale" derived here
    compat: str  # COMPAT_*
    schema_version: int | None
    updated_at: float | None
    tables: dict[str, bool] = field(default_factory=dict)  # table -> has at least one part

    @property
    def env(self) -> dict[str, Any]:
        env = self.meta.get("env")
        return env if isinstance(env, dict) else {}

    @property
    def readable(self) -> bool:
        return self.compat in (COMPAT_OK, COMPAT_OLDER)

    @property
    def has_steps(self) -> bool:
        return self.tables.get(schema.TABLE_STEPS, False)

    @property
    def note(self) -> str:
        """A few words for the runs table ("" when all is well)."""
        if self.compat == COMPAT_UNREADABLE:
            return "meta.json unreadable"
        if self.compat == COMPAT_NEWER:
            return f"newer schema {self.schema_version}: upgrade moeguard"
        if not self.has_steps:
            return "no steps yet (meta.json only)"
        missing = [t for t in (schema.TABLE_LAYERS, schema.TABLE_EXPERTS) if not self.tables.get(t)]
        if self.compat == COMPAT_OLDER:
            return f"older schema {self.schema_version}"
        if missing:
            return "no " + "/".join(missing) + " table"
        return ""

    def problem(self) -> tuple[str, str] | None:
        """(level, message) for a run the app can only partly show; None when all is well."""
        if self.compat == COMPAT_UNREADABLE:
            return "warning", f"Run `{self.run_id}`: meta.json could not be parsed; its tables are not shown."
        if self.compat == COMPAT_NEWER:
            return "warning", (
                f"Run `{self.run_id}` was written by a newer moeguard (run-store schema "
                f"{self.schema_version}; this app reads up to {schema.SCHEMA_VERSION}). "
                "Upgrade moeguard to view it."
            )
        if not self.has_steps:
            return "info", (
                f"Run `{self.run_id}` has no steps on disk yet (meta.json only): the trainer writes "
                "its first chunk after `flush_every` steps, or it stopped before that."
            )
        if self.compat == COMPAT_OLDER:
            return "info", (
                f"Run `{self.run_id}` uses an older run-store schema ({self.schema_version}; current "
                f"{schema.SCHEMA_VERSION}). Columns added since are shown as empty."
            )
        return None


def run_signature(run_dir: str | Path) -> tuple[int, ...]:
    """Changes whenever the run gains a part file or rewrites meta.json (cache key)."""
    d = Path(run_dir)
    sig = []
    for name in (schema.META_FILE, *schema.TABLES):
        try:
            sig.append(os.stat(d / name).st_mtime_ns)
        except OSError:
            sig.append(0)
    return tuple(sig)


def run_info(
    run_dir: str | Path, *, stale_after_s: float = DEFAULT_STALE_S, now: float | None = None
) -> RunInfo:
    d = Path(run_dir)
    meta = read_meta(d)
    tables = {t: reader.has_part(d, t) for t in schema.TABLES}
    if meta is None or not isinstance(meta, dict):
        return RunInfo(
            run_id=d.name,
            path=str(d),
            meta={},
            status=schema.STATUS_CRASHED,
            compat=COMPAT_UNREADABLE,
            schema_version=None,
            updated_at=None,
            tables=tables,
        )
    try:
        version = int(meta.get("schema_version", 0))
    except (TypeError, ValueError):
        version = 0
    if version > schema.SCHEMA_VERSION:
        compat = COMPAT_NEWER
    elif version < schema.SCHEMA_VERSION:
        compat = COMPAT_OLDER
    else:
        compat = COMPAT_OK
    updated = meta.get("updated_at")
    updated = float(updated) if isinstance(updated, int | float) else None
    # the trainer may flush parts without touching meta.json: newest activity counts
    sig_s = max(run_signature(d)) / 1e9
    last_activity = max(updated or 0.0, sig_s) or None
    status = str(meta.get("status", schema.STATUS_RUNNING))
    now = time.time() if now is None else now
    if status == schema.STATUS_RUNNING and last_activity is not None and now - last_activity > stale_after_s:
        status = schema.STATUS_STALE
    return RunInfo(
        run_id=d.name,
        path=str(d),
        meta=meta,
        status=status,
        compat=compat,
        schema_version=version,
        updated_at=last_activity,
        tables=tables,
    )


def discover(runs_dir: str | Path, *, stale_after_s: float = DEFAULT_STALE_S) -> list[RunInfo]:
    """Every run folder (one with meta.json) under `runs_dir`, newest activity first."""
    infos = [run_info(p, stale_after_s=stale_after_s) for p in list_runs(runs_dir)]
    return sorted(infos, key=lambda r: -(r.updated_at or 0.0))


def stray_folders(runs_dir: str | Path) -> list[str]:
    """Folders under runs_dir that are not runs (no meta.json)."""
    d = Path(runs_dir)
    if not d.is_dir():
        return []
    runs = {p.name for p in list_runs(d)}
    return sorted(
        p.name for p in d.iterdir() if p.is_dir() and p.name not in runs and not p.name.startswith(".")
    )


# ---------------------------------------------------------------------------------------
# Scans
# ---------------------------------------------------------------------------------------
# The run store is read through guard/store/reader.py (one listing, one part-name parser, one
# tolerant scan); the app lists parts with its cache (`cached=True`): it re-lists long runs on
# every rerun.


def _finite_or_null(col: str) -> pl.Expr:
    return pl.when(pl.col(col).is_finite()).then(pl.col(col))


# ---------------------------------------------------------------------------------------
# Pure helpers (tested directly; no caching)
# ---------------------------------------------------------------------------------------
def downsample(
    df: pl.DataFrame,
    y: str,
    *,
    max_points: int = MAX_LINE_POINTS,
    keep_steps: tuple[int, ...] | list[int] = (),
) -> pl.DataFrame:
    """Rows (step, y) to draw, at most ~max_points plus the kept ones.

    Per step bucket keeps the first, last, min and max row (so a one-step spike survives any
    zoom level), every non-finite row (drawn as a gap; the marks show where), and every step
    in `keep_steps` (steps with events, so a mark sits on a drawn point).
    """
    df = df.select("step", y).sort("step")
    if df.height <= max_points:
        return df
    lo, hi = df["step"][0], df["step"][-1]
    buckets = max(1, max_points // 4)
    width = max(1, math.ceil((hi - lo + 1) / buckets))
    yy = _finite_or_null(y)
    idx = df.with_row_index("i").with_columns(b=(pl.col("step") - lo) // width)
    picks = idx.group_by("b").agg(
        pl.col("i").first().alias("first"),
        pl.col("i").last().alias("last"),
        pl.col("i").sort_by(yy, nulls_last=True).first().alias("min"),
        pl.col("i").sort_by(yy, descending=True, nulls_last=True).first().alias("max"),
    )
    keep = pl.concat([picks[c] for c in ("first", "last", "min", "max")]).cast(pl.UInt32)
    special = idx.filter(~pl.col(y).is_finite() | pl.col("step").is_in(list(keep_steps)))["i"].cast(pl.UInt32)
    rows = pl.concat([keep, special]).unique()
    return idx.filter(pl.col("i").is_in(rows.implode())).select("step", y)


def bucket_grid(lo: int, hi: int, n_buckets: int = HEAT_BUCKETS) -> int:
    """Width in steps of one heatmap column so that [lo, hi] fits in n_buckets columns."""
    return max(1, math.ceil((hi - lo + 1) / max(1, n_buckets)))


def long_to_heat(
    df: pl.DataFrame,
    *,
    x: str,
    y: str,
    z: str,
    x_values: np.ndarray | None = None,
    y_values: list[int] | None = None,
) -> dict[str, Any]:
    """Long (x, y, z) rows -> {"x", "y", "z"[len(y)][len(x)]} with NaN where nothing was seen."""
    xs = np.asarray(sorted(df[x].unique().to_list()) if x_values is None else x_values)
    ys = sorted(df[y].unique().to_list()) if y_values is None else list(y_values)
    zz = np.full((len(ys), len(xs)), np.nan)
    if df.height:
        xi = np.searchsorted(xs, df[x].to_numpy())
        ypos = {v: i for i, v in enumerate(ys)}
        yi = np.array([ypos.get(v, -1) for v in df[y].to_list()])
        ok = (yi >= 0) & (xi < len(xs))
        zz[yi[ok], xi[ok]] = df[z].cast(pl.Float64).fill_null(float("nan")).to_numpy()[ok]
    return {"x": xs, "y": ys, "z": zz}


def parse_detail(detail: str | None) -> dict[str, Any]:
    if not detail:
        return {}
    try:
        out = json.loads(detail)
    except (json.JSONDecodeError, TypeError):
        return {"detail": str(detail)[:200]}
    return out if isinstance(out, dict) else {"detail": out}


def fmt_value(v: Any) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(fmt_value(x) for x in v[:12]) + (", ..." if len(v) > 12 else "") + "]"
    return str(v)


def evidence_text(row: dict[str, Any]) -> str:
    """One event as hover HTML: what fired, value vs threshold, then the JSON evidence."""
    head = row.get("kind", "")
    if row.get("detector"):
        head += f" {row['detector']}"
    parts = [f"<b>{head}</b>"]
    v, t = row.get("value"), row.get("threshold")
    if v is not None and isinstance(v, float) and (math.isfinite(v) or (t is not None and math.isfinite(t))):
        parts.append(f"value {fmt_value(v)} vs threshold {fmt_value(t)}")
    elif isinstance(v, float) and math.isnan(v) and row.get("detector") == schema.DET_NONFINITE:
        parts.append("value non-finite")
    for k, val in parse_detail(row.get("detail")).items():
        parts.append(f"{k}: {fmt_value(val)}")
    return "<br>".join(parts)


def action_marks(events: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """One row per (step, action) the guard took, with y positions and the evidence as hover.

    A verdict and the action event it caused are merged into one mark (same step, same
    action). `y_loss` / `y_grad_norm` are the series values at that step; where the value is
    non-finite (the NaN that was skipped) the mark is pinned to the series' finite maximum and
    `nf_loss` / `nf_grad_norm` say so (`nonfinite`: either), so the chart can label it.
    """
    sch = {
        "step": pl.Int64,
        "action": pl.String,
        "hover": pl.String,
        "y_loss": pl.Float64,
        "y_grad_norm": pl.Float64,
        "nf_loss": pl.Boolean,
        "nf_grad_norm": pl.Boolean,
        "nonfinite": pl.Boolean,
    }
    cols = list(sch)
    if events.height == 0:
        return pl.DataFrame(schema=sch)
    ev = events.filter(pl.col("action").is_in(ACTIVE_ACTIONS))
    rows: dict[tuple[int, str], list[str]] = {}
    for r in ev.iter_rows(named=True):
        rows.setdefault((int(r["step"]), r["action"]), []).append(evidence_text(r))
    if not rows:
        return pl.DataFrame(schema=sch)
    marks = pl.DataFrame(
        {
            "step": [k[0] for k in rows],
            "action": [k[1] for k in rows],
            "hover": [
                f"<b>{k[1].upper()}</b> at step {k[0]}<br>" + "<br>—<br>".join(dict.fromkeys(v))
                for k, v in rows.items()
            ],
        },
        schema={"step": pl.Int64, "action": pl.String, "hover": pl.String},
    )
    s = steps.select("step", "loss", "grad_norm").unique("step", keep="last")
    out = marks.join(s, on="step", how="left")
    lmax = steps["loss"].filter(steps["loss"].is_finite()).max() if steps.height else None
    gmax = steps["grad_norm"].filter(steps["grad_norm"].is_finite()).max() if steps.height else None
    return (
        out.with_columns(
            nf_loss=~pl.col("loss").is_finite().fill_null(False),
            nf_grad_norm=~pl.col("grad_norm").is_finite().fill_null(False),
            nonfinite=~(pl.col("loss").is_finite() & pl.col("grad_norm").is_finite()).fill_null(False),
            y_loss=pl.when(pl.col("loss").is_finite())
            .then(pl.col("loss"))
            .otherwise(pl.lit(lmax, pl.Float64)),
            y_grad_norm=pl.when(pl.col("grad_norm").is_finite())
            .then(pl.col("grad_norm"))
            .otherwise(pl.lit(gmax, pl.Float64)),
        )
        .select(cols)
        .sort("step")
    )


def timeline_rows(events: pl.DataFrame) -> pl.DataFrame:
    """Events for the timeline strip: one row each, lane = detector for verdicts else kind."""
    if events.height == 0:
        return pl.DataFrame(
            schema={"step": pl.Int64, "lane": pl.String, "kind": pl.String, "hover": pl.String}
        )
    hover = [
        f"step {r['step']}<br>"
        + evidence_text(r)
        + (f"<br>action: {r['action']}" if r["action"] not in (schema.ACT_NONE, "") else "")
        for r in events.iter_rows(named=True)
    ]
    return events.select(
        "step",
        pl.when(pl.col("kind") == schema.EV_VERDICT)
        .then(pl.col("detector"))
        .otherwise(pl.col("kind"))
        .alias("lane"),
        "kind",
    ).with_columns(hover=pl.Series(hover, dtype=pl.String))


def steady_state(steps: pl.DataFrame, *, warmup_frac: float = 0.1, min_warmup: int = 20) -> pl.DataFrame:
    """Steps after warm-up (compile, ramp) where the guard did not intervene."""
    if steps.height == 0:
        return steps
    lo = steps["step"].min()
    hi = steps["step"].max()
    cut = lo + max(min_warmup, int((hi - lo) * warmup_frac))  # type: ignore[operator]
    return steps.filter(
        (pl.col("step") >= cut)
        & pl.col("action").fill_null(schema.ACT_APPLY).is_in([schema.ACT_APPLY, schema.ACT_NONE])
    )


def env_differences(envs: dict[str, dict[str, Any]]) -> pl.DataFrame:
    """Rows = keys whose value differs between runs; columns = key + one per run."""
    flat = {run: _flatten(e) for run, e in envs.items()}
    keys = sorted({k for f in flat.values() for k in f})
    diff = [
        k for k in keys if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat.values()}) > 1
    ]
    data: dict[str, list[str]] = {"key": diff}
    for run, f in flat.items():
        data[run] = ["—" if f.get(k) is None else str(f.get(k)) for k in diff]
    return pl.DataFrame(data, schema=dict.fromkeys(data, pl.String))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


# ---------------------------------------------------------------------------------------
# MFU's peak: which one a run used, and whether a user can trust and compare it
# ---------------------------------------------------------------------------------------
MFU_LIMIT = 1.0  # MFU above this is not physical: a measurement artefact (a peak that was too low)
PEAK_TABLE = "table"  # GPU datasheet peak matched on the device name (trainer/flops.py)
PEAK_PINNED = "pinned"  # CPU peak pinned per machine class (configs/cpu_peaks.toml)
PEAK_SELF = "self-measured"  # older runs: each run timed a few matmuls at start-up
PEAK_NONE = "none"  # no peak: MFU not computed, tokens/s is the measure


@dataclass(frozen=True, slots=True)
class Peak:
    """The peak FLOP/s a run's MFU was computed against, from meta.json env."""

    flops: float | None
    source: str
    kind: str  # PEAK_*

    @property
    def trusted(self) -> bool:
        """A fixed, documented peak: MFU is bounded by it and comparable between runs that share it."""
        return self.kind in (PEAK_TABLE, PEAK_PINNED) and bool(self.flops)

    def label(self) -> str:
        """'214 GFLOP/s, pinned (cpu-...-2c fp32)' in a few words, for tables and captions."""
        if not self.flops:
            return "no peak: tokens/s only"
        what = {
            PEAK_TABLE: "datasheet",
            PEAK_PINNED: "pinned",
            PEAK_SELF: "self-measured by the run, not comparable",
        }
        detail = ""
        if self.kind == PEAK_PINNED:  # "pinned: <class> <dtype> in <file>, measured ..."
            detail = " (" + " ".join(self.source.removeprefix("pinned:").split(",")[0].split()[:2]) + ")"
        elif self.kind == PEAK_TABLE:  # "table: H100 SXM bf16 dense ('NVIDIA ...')"
            detail = " (" + self.source.split(":", 1)[1].split("(")[0].strip() + ")"
        return f"{fmt_flops(self.flops)}, {what.get(self.kind, self.kind)}{detail}"

    def short(self) -> str:
        """'214 GFLOP/s pinned' for a table cell (label() and source say the rest)."""
        if not self.flops:
            return "none"
        return f"{fmt_flops(self.flops)} {'self-measured' if self.kind == PEAK_SELF else self.kind}"


def fmt_flops(v: float) -> str:
    for unit, n in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if v >= n:
            return f"{v / n:.3g} {unit}"
    return f"{v:.3g} FLOP/s"


def run_peak(env: dict[str, Any]) -> Peak:
    flops = env.get("peak_flops")
    flops = float(flops) if isinstance(flops, int | float) and math.isfinite(flops) and flops > 0 else None
    source = str(env.get("peak_flops_source") or "")
    low = source.lower()
    if flops is None:
        kind = PEAK_NONE
    elif low.startswith("table"):
        kind = PEAK_TABLE
    elif low.startswith("pinned"):
        kind = PEAK_PINNED
    elif low.startswith("measured") or "probe" in low:
        kind = PEAK_SELF
    else:
        kind = PEAK_SELF  # a peak we cannot place is not one to trust
    return Peak(flops, source or "not recorded", kind)


def mfu_note(mfu: float | None, peak: Peak, *, short: bool = False) -> str:
    """What a reader must know next to one MFU figure ("" when nothing)."""
    if mfu is not None and mfu > MFU_LIMIT:
        if short:
            return "artefact: > 100%"
        return "above 100%: a measurement artefact (the peak used is too low), not a real MFU"
    if peak.kind == PEAK_SELF:
        return "not comparable" if short else "peak self-measured by the run: compare tokens/s instead"
    return ""


# ---------------------------------------------------------------------------------------
# Cached loaders. Arguments are (run path as str, signature, knobs): all hashable and cheap.
# ---------------------------------------------------------------------------------------
@st.cache_data(max_entries=512, show_spinner=False)
def load_summary(path: str, sig: tuple[int, ...]) -> dict[str, Any]:
    """Latest step, loss, recent MFU and tokens/s, guard action and verdict counts."""
    del sig
    out: dict[str, Any] = {
        "step": None,
        "loss": None,
        "mfu": None,
        "tokens_per_s": None,
        "mfu_over": 0,
        "actions": 0,
        "action_counts": actions.zero(),
        "verdicts": 0,
        "halts": 0,
    }
    parts = reader.cached_part_files(path, schema.TABLE_STEPS)
    if parts:
        tail = (
            reader.scan_table(path, schema.TABLE_STEPS, parts[-3:])
            .select("step", "loss", "mfu", "tokens_per_s")
            .sort("step")
            .tail(100)
            .collect()
        )
        if tail.height:
            out["step"] = int(tail["step"][-1])
            loss = tail["loss"][-1]
            out["loss"] = float(loss) if loss is not None else None
            for c in ("mfu", "tokens_per_s"):
                vals = tail[c].filter(tail[c].is_finite())
                out[c] = float(vals.median()) if len(vals) else None  # type: ignore[arg-type]
        out["mfu_over"] = (
            reader.scan_table(path, schema.TABLE_STEPS, cached=True)
            .select((pl.col("mfu") > MFU_LIMIT).sum())
            .collect()
            .item()
            or 0
        )
    out["action_counts"] = count_actions(path)
    out["actions"] = actions.total(out["action_counts"])
    ev = reader.scan_table(path, schema.TABLE_EVENTS, cached=True).select("step", "kind", "action").collect()
    if ev.height:
        out["verdicts"] = ev.filter(pl.col("kind") == schema.EV_VERDICT).height
        out["halts"] = ev.filter(pl.col("kind") == schema.EV_HALT).height
    return out


_STEP_COLS = [
    "step",
    "time",
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "tokens_per_s",
    "mfu",
    "step_time_s",
    "data_wait_s",
    "mem_peak_bytes",
    "action",
    "update_ratio",
    "adam_v_ratio",
]


# The two raw frames are shared, not copied: cache_resource hands out the same (immutable)
# polars frame instead of pickling 100k rows on every store and hit. Callers never mutate.
@st.cache_resource(max_entries=16, show_spinner=False)
def load_steps(path: str, sig: tuple[int, ...]) -> pl.DataFrame:
    """The steps table (projected), sorted by step."""
    del sig
    df = reader.scan_table(path, schema.TABLE_STEPS, cached=True).select(_STEP_COLS).collect()
    # parts arrive in step order; only a resumed or rolled-back run needs the sort
    return df if df["step"].is_sorted() else df.sort("step", "time")


@st.cache_resource(max_entries=64, show_spinner=False)
def load_events(path: str, sig: tuple[int, ...]) -> pl.DataFrame:
    del sig
    return reader.scan_table(path, schema.TABLE_EVENTS, cached=True).sort("step", "time").collect()


@st.cache_data(max_entries=32, show_spinner=False)
def load_step_series(
    path: str, sig: tuple[int, ...], columns: tuple[str, ...], max_points: int = MAX_LINE_POINTS
) -> dict[str, pl.DataFrame]:
    """Downsampled (step, value) series for each column, event steps always included."""
    steps = load_steps(path, sig)
    ev = load_events(path, sig)
    keep = tuple(sorted(set(ev["step"].to_list()))) if ev.height else ()
    return {c: downsample(steps, c, max_points=max_points, keep_steps=keep) for c in columns}


@st.cache_data(max_entries=32, show_spinner=False)
def load_marks(path: str, sig: tuple[int, ...]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(action marks, timeline rows) for the health chart."""
    steps = load_steps(path, sig)
    ev = load_events(path, sig)
    return action_marks(ev, steps), timeline_rows(ev)


# Per-layer signals: (column, bucket aggregate, label). max keeps spikes and collapse, min
# keeps entropy drops: a mean would smear a one-step event over the whole bucket.
LAYER_SIGNALS: dict[str, tuple[str, str]] = {
    "grad_norm": ("max", "Per-layer grad norm (bucket max)"),
    "maxvio": ("max", "MaxVio per layer (bucket max, ratio)"),
    "dead_experts": ("max", "Dead experts per layer (bucket max, count)"),
    "router_entropy": ("min", "Router entropy per layer (bucket min, nats)"),
    "load_entropy": ("min", "Load entropy per layer (bucket min, 0..1)"),
    "bias_norm": ("max", "Expert-bias L2 norm per layer (bucket max)"),
    "update_ratio": ("max", "Update ratio ||ΔW|| / ||W|| per layer (bucket max)"),
}


@st.cache_data(max_entries=16, show_spinner=False)
def load_layer_heatmaps(
    path: str, sig: tuple[int, ...], lo: int, hi: int, n_buckets: int = HEAT_BUCKETS
) -> dict[str, dict[str, Any]]:
    """layer x step-bucket matrices for every LAYER_SIGNALS column, in one scan."""
    del sig
    width = bucket_grid(lo, hi, n_buckets)
    aggs = []
    for c, (how, _) in LAYER_SIGNALS.items():
        e = _finite_or_null(c) if c != "dead_experts" else pl.col(c).cast(pl.Float64)
        aggs.append((e.max() if how == "max" else e.min()).alias(c))
    # a NaN/Inf layer grad norm is dropped from the bucket max above but is the best clue to
    # where a non-finite step came from: keep where it happened
    aggs.append((~pl.col("grad_norm").is_finite()).any().alias("gn_nonfinite"))
    long = (
        reader.scan_table(path, schema.TABLE_LAYERS, cached=True)
        .select("step", "layer", *LAYER_SIGNALS)
        .with_columns(b=((pl.col("step") - lo) // width) * width + lo)
        .group_by("b", "layer")
        .agg(aggs)
        .collect()
    )
    if long.height == 0:
        return {}
    xs = np.arange(lo, hi + 1, width)
    layers = sorted(long["layer"].unique().to_list())
    out = {}
    for c in LAYER_SIGNALS:
        h = long_to_heat(long, x="b", y="layer", z=c, x_values=xs, y_values=layers)
        if np.isfinite(h["z"]).any():
            h["width"] = width
            out[c] = h
    if "grad_norm" in out:
        bad = long.filter(pl.col("gn_nonfinite").fill_null(False)).sort("b", "layer")
        out["grad_norm"]["marks"] = (bad["b"].to_list(), bad["layer"].to_list(), "non-finite grad norm")
    return out


@st.cache_data(max_entries=16, show_spinner=False)
def load_group_series(
    path: str, sig: tuple[int, ...], column: str, max_points: int = MAX_LINE_POINTS
) -> dict[int, pl.DataFrame]:
    """optimizer group -> downsampled (step, `column`) rows of the `groups` table."""
    del sig
    df = reader.scan_table(path, schema.TABLE_GROUPS, cached=True).select("step", "group", column).collect()
    return {
        int(g): downsample(df.filter(pl.col("group") == g), column, max_points=max_points)
        for g in sorted(df["group"].unique().to_list())
    }


@st.cache_data(max_entries=16, show_spinner=False)
def load_layer_ids(path: str, sig: tuple[int, ...]) -> list[int]:
    """MoE layers (those with expert rows), read from the newest part only."""
    del sig
    parts = reader.cached_part_files(path, schema.TABLE_EXPERTS)
    if not parts:
        return []
    return sorted(
        reader.scan_table(path, schema.TABLE_EXPERTS, parts[-1:])
        .select(pl.col("layer").unique())
        .collect()["layer"]
        .to_list()
    )


@st.cache_data(max_entries=64, show_spinner=False)
def load_expert_share_over_time(
    path: str,
    sig: tuple[int, ...],
    layer: int,
    lo: int,
    hi: int,
    n_buckets: int = 200,
    row_budget: int = EXPERT_ROW_BUDGET,
) -> dict[str, Any]:
    """expert x step-bucket matrix of one layer's load share (bucket sum of load / layer total).

    Reads every part while the table is under `row_budget` rows; past that it reads evenly
    spaced parts only and says so in "note" (load shares move slowly; spikes are in `layers`).
    """
    del sig
    parts = reader.cached_part_files(path, schema.TABLE_EXPERTS)
    if not parts:
        return {}
    note = ""
    per_part = reader.scan_table(path, schema.TABLE_EXPERTS, parts[-1:]).select(pl.len()).collect().item()
    est = per_part * len(parts)
    if est > row_budget:
        stride = math.ceil(est / row_budget)
        parts = parts[::stride]
        note = f"sampled: every {stride}th chunk of the experts table ({len(parts)} chunks, ~{100 / stride:.0f}% of steps)"
    width = bucket_grid(lo, hi, n_buckets)
    long = (
        reader.scan_table(path, schema.TABLE_EXPERTS, parts)
        .select("step", "layer", "expert", "load")
        .filter(pl.col("layer") == layer)
        .with_columns(b=((pl.col("step") - lo) // width) * width + lo)
        .group_by("b", "expert")
        .agg(pl.col("load").sum())
        .with_columns(share=pl.col("load") / pl.col("load").sum().over("b"))
        .collect()
    )
    if long.height == 0:
        return {}
    h = long_to_heat(long, x="b", y="expert", z="share", x_values=np.arange(lo, hi + 1, width))
    h["note"] = note
    h["width"] = width
    return h


@st.cache_data(max_entries=64, show_spinner=False)
def load_expert_share_now(path: str, sig: tuple[int, ...], window: int = 100) -> dict[str, Any]:
    """layer x expert load share over the last `window` steps (newest parts only)."""
    del sig
    parts = reader.cached_part_files(path, schema.TABLE_EXPERTS)
    if not parts:
        return {}
    # parts are named by first step: walk back until the window is covered
    tail: list[Path] = []
    last_step = None
    for p in reversed(parts):
        tail.append(p)
        first = int(p.name.split("-")[1])
        if last_step is None:
            last_step = (
                reader.scan_table(path, schema.TABLE_EXPERTS, [p])
                .select(pl.col("step").max())
                .collect()
                .item()
            )
        if last_step is not None and first <= last_step - window:
            break
    long = (
        reader.scan_table(path, schema.TABLE_EXPERTS, tail)
        .select("step", "layer", "expert", "load")
        .filter(pl.col("step") > pl.col("step").max() - window)
        .group_by("layer", "expert")
        .agg(pl.col("load").sum(), pl.col("step").min().alias("from"), pl.col("step").max().alias("to"))
        .with_columns(share=pl.col("load") / pl.col("load").sum().over("layer"))
        .collect()
    )
    if long.height == 0:
        return {}
    h = long_to_heat(long, x="expert", y="layer", z="share")
    h["from"], h["to"] = int(long["from"].min()), int(long["to"].max())  # type: ignore[arg-type]
    return h


@st.cache_data(max_entries=64, show_spinner=False)
def load_steady_perf(path: str, sig: tuple[int, ...], max_points: int = 3000) -> pl.DataFrame:
    """Steady-state (step, mfu, tokens_per_s), evenly thinned to max_points for violins."""
    steps = steady_state(load_steps(path, sig)).select("step", "mfu", "tokens_per_s")
    if steps.height > max_points:
        steps = steps.gather_every(math.ceil(steps.height / max_points))
    return steps


# ---------------------------------------------------------------------------------------
# Compare: overlays on a chosen x-axis, "is B faster than A", profiler traces
# ---------------------------------------------------------------------------------------
# metric -> (label, unit scale for display, hover format)
OVERLAY_METRICS: dict[str, tuple[str, float, str]] = {
    "tokens_per_s": ("throughput (tokens/s)", 1.0, ",.0f"),
    "mfu": ("MFU (%)", 100.0, ".1f"),
    "loss": ("loss (nats/token)", 1.0, ".4f"),
    "grad_norm": ("grad norm", 1.0, ".4g"),
    "step_time_s": ("step time (s)", 1.0, ".3f"),
    "data_wait_s": ("data-loader wait (s)", 1.0, ".3f"),
    "lr": ("learning rate", 1.0, ".3g"),
    "mem_peak_bytes": ("peak memory (GiB)", 1 / 2**30, ".2f"),
}
X_AXES = {"step": "step", "tokens": "tokens consumed", "wall": "wall time since the first step (min)"}
# what the Compare page offers (labels are also what its URL carries: ?metric=MFU&x_axis=wall+time)
METRIC_CHOICES = {
    "tokens/s": "tokens_per_s",
    "MFU": "mfu",
    "loss": "loss",
    "grad norm": "grad_norm",
    "step time": "step_time_s",
    "data wait": "data_wait_s",
    "LR": "lr",
    "peak memory": "mem_peak_bytes",
}
X_CHOICES = {"steps": "step", "tokens": "tokens", "wall time": "wall"}


def smooth(y: pl.Series, window: int) -> pl.Series:
    """Centred rolling median over `window` steps (1 = raw): robust to the one-step spikes a
    guard run has, and it keeps level shifts where they happen (a mean smears them)."""
    if window <= 1:
        return y
    return y.rolling_median(window_size=window, min_samples=1, center=True)


def overlay_series(
    steps: pl.DataFrame, metric: str, x_axis: str, window: int = 1, max_points: int = MAX_LINE_POINTS
) -> pl.DataFrame:
    """(step, x, y) for one run: y smoothed over finite values, downsampled, x in the chosen unit."""
    if steps.height == 0:
        return pl.DataFrame(schema={"step": pl.Int64, "x": pl.Float64, "y": pl.Float64})
    df = steps.select("step", "time", "tokens", metric).sort("step")
    y = df[metric].cast(pl.Float64)
    y = y.set(~y.is_finite().fill_null(False), None)  # a NaN step is a gap, not part of a median
    df = df.with_columns(smooth(y, window).alias(metric))
    if x_axis == "tokens":
        x = pl.col("tokens").fill_null(0).cum_sum().cast(pl.Float64)
    elif x_axis == "wall":
        x = (pl.col("time") - pl.col("time").min()) / 60.0
    else:
        x = pl.col("step").cast(pl.Float64)
    df = df.with_columns(x=x)
    keep = downsample(df, metric, max_points=max_points)
    return keep.join(df.select("step", "x"), on="step", how="left").select(
        "step", "x", pl.col(metric).alias("y")
    )


@st.cache_data(max_entries=64, show_spinner=False)
def load_overlay(path: str, sig: tuple[int, ...], metric: str, x_axis: str, window: int = 1) -> pl.DataFrame:
    """One run's `metric` against `x_axis` (X_AXES), smoothed over `window` steps, downsampled."""
    return overlay_series(load_steps(path, sig), metric, x_axis, window)


def speedup(a: np.ndarray, b: np.ndarray, *, n_boot: int = 400, seed: int = 0) -> dict[str, float] | None:
    """How much faster B is than A from steady-state tokens/s samples (one per step).

    ratio = median(B) / median(A) - 1, with a 90% interval from a block bootstrap: steps are
    resampled in blocks of consecutive steps (throughput drifts, so neighbouring steps are not
    independent and a per-step bootstrap would be too narrow)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    a, b = a[np.isfinite(a) & (a > 0)], b[np.isfinite(b) & (b > 0)]
    if a.size < 10 or b.size < 10:
        return None
    rng = np.random.default_rng(seed)

    def boot_medians(x: np.ndarray) -> np.ndarray:
        block = max(5, x.size // 20)
        n_blocks = math.ceil(x.size / block)
        starts = rng.integers(0, x.size - block + 1, size=(n_boot, n_blocks))
        idx = (starts[:, :, None] + np.arange(block)).reshape(n_boot, -1)[:, : x.size]
        return np.median(x[idx], axis=1)

    ratios = boot_medians(b) / boot_medians(a) - 1
    med_a, med_b = float(np.median(a)), float(np.median(b))
    return {
        "pct": 100 * (med_b / med_a - 1),
        "lo": 100 * float(np.quantile(ratios, 0.05)),
        "hi": 100 * float(np.quantile(ratios, 0.95)),
        "a": med_a,
        "b": med_b,
        "n_a": float(a.size),
        "n_b": float(b.size),
    }


def speedup_sentence(name_a: str, name_b: str, r: dict[str, float]) -> str:
    """'B is 5.5% faster than A (90% interval +3.1% .. +7.8%)', or that no difference is clear."""
    span = f"90% interval {r['lo']:+.1f}% .. {r['hi']:+.1f}%"
    tps = f"steady-state tokens/s p50 {r['b']:,.0f} vs {r['a']:,.0f}"
    if r["lo"] > 0:
        return f"**{name_b}** is **{r['pct']:.1f}% faster** than **{name_a}** ({span}; {tps})."
    if r["hi"] < 0:
        return f"**{name_b}** is **{-r['pct']:.1f}% slower** than **{name_a}** ({span}; {tps})."
    return f"No clear difference: **{name_b}** vs **{name_a}** {r['pct']:+.1f}% ({span} includes 0; {tps})."


# [model] keys that say how the model runs, not what it computes: a kernel or backend change
# leaves the FLOPs per token alone, so tokens/s compares the same work
IMPL_KEYS = ("experts_kernel", "attention", "compile", "attention_backend")


def same_model(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> bool:
    """Whether two runs train the same model (config [model] equal up to IMPL_KEYS)."""

    def model(meta: dict[str, Any]) -> dict[str, Any]:
        cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        m = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
        return {k: v for k, v in m.items() if k not in IMPL_KEYS}

    return model(meta_a) == model(meta_b)


def profiler_trace(path: str | Path) -> Path | None:
    """The newest torch.profiler trace a run wrote (runs/<id>/profile/*.pt.trace.json[.gz])."""
    d = Path(path) / schema.PROFILE_DIR
    try:
        found = [p for p in d.iterdir() if p.is_file() and ".pt.trace.json" in p.name]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


# ---------------------------------------------------------------------------------------
# Canary history (JSONL, one object per canary run; written by `moeguard canary`). Parsed and
# judged with guard/canary's own parser, baseline rule and deltas, so the page's baseline is the
# one the gate used: the last `history_window` baseline entries recorded before the judged one
# with its fingerprint and config hash.
# ---------------------------------------------------------------------------------------
CANARY_COLUMNS = {
    ck.H_TIME: pl.Datetime("us", "UTC"),
    ck.H_SHA: pl.String,
    ck.H_TORCH: pl.String,
    ck.H_FP: pl.String,
    ck.H_CFG_HASH: pl.String,
    ck.H_CFG: pl.String,
    ck.MFU: pl.Float64,
    ck.TPS: pl.Float64,
    ck.H_VERDICT: pl.String,
    ck.H_BASELINE: pl.Boolean,
    ck.H_WARN_PCT: pl.Float64,
    ck.H_FAIL_PCT: pl.Float64,
    ck.H_PROFILE_TOP: pl.String,
}
CANARY_VERDICTS = ("pass", "warn", "fail")
CANARY_WINDOW = CanaryConfig().history_window  # `moeguard canary`'s default canary.history_window


def _canary_row(e: dict[str, Any]) -> dict[str, Any]:
    """One history entry as a table row: strings for the labels, None for what it lacks."""
    t = entry_time(e.get(ck.H_TIME))
    cfg = e.get(ck.H_CFG)
    verdict = str(e.get(ck.H_VERDICT, "")).lower()
    prof = e.get(ck.H_PROFILE_TOP)
    return {
        ck.H_TIME: datetime.fromtimestamp(t, tz=UTC) if t is not None else None,
        ck.H_SHA: str(e.get(ck.H_SHA) or "?"),
        ck.H_TORCH: str(e.get(ck.H_TORCH) or "?"),
        ck.H_FP: str(e.get(ck.H_FP) or "default"),
        ck.H_CFG_HASH: e.get(ck.H_CFG_HASH) if isinstance(e.get(ck.H_CFG_HASH), str) else None,
        ck.H_CFG: cfg if isinstance(cfg, str) else json.dumps(cfg, sort_keys=True) if cfg is not None else "",
        ck.MFU: float(e[ck.MFU]),
        ck.TPS: _num(e.get(ck.TPS)),
        ck.H_VERDICT: verdict if verdict in CANARY_VERDICTS else "unknown",
        ck.H_BASELINE: e.get(ck.H_BASELINE) is True,
        ck.H_WARN_PCT: _num(e.get(ck.H_WARN_PCT)),
        ck.H_FAIL_PCT: _num(e.get(ck.H_FAIL_PCT)),
        ck.H_PROFILE_TOP: json.dumps(prof) if isinstance(prof, dict) else None,
    }


def parse_canary_history(text: str) -> tuple[pl.DataFrame, list[str]]:
    """Rows in file order (with their index "n") plus the lines skipped ("line 3: not JSON"),
    never raising: guard.canary.history.parse_history, as a table."""
    entries, problems = parse_history(text)
    rows = [_canary_row(e) for e in entries]
    df = (
        pl.DataFrame(rows, schema=CANARY_COLUMNS, strict=False)
        if rows
        else pl.DataFrame(schema=CANARY_COLUMNS)
    )
    return df.with_row_index("n"), problems


def _num(v: Any) -> float | None:
    return float(v) if is_number(v) else None


@st.cache_data(max_entries=8, show_spinner=False)
def load_canary_history(path: str, mtime_ns: int) -> tuple[pl.DataFrame, list[str]]:
    del mtime_ns
    return parse_canary_history(Path(path).read_text(errors="replace"))


def canary_baseline_rows(df: pl.DataFrame, judged: int, window: int = CANARY_WINDOW) -> pl.DataFrame:
    """The entries entry `judged` (its "n") is compared with, as `moeguard canary` picks them
    (guard.canary.history.baseline_before): never the entry itself."""
    earlier = df.filter(pl.col("n") <= judged)
    if earlier.height == 0 or earlier["n"][-1] != judged:
        return df.clear()
    rows = earlier.to_dicts()
    picked = [b["n"] for b in baseline_before(rows, len(rows) - 1, window)]
    return df.filter(pl.col("n").is_in(picked))


def canary_gate(
    df: pl.DataFrame,
    *,
    warn_pct: float,
    fail_pct: float,
    judged: int | None = None,
    window: int = CANARY_WINDOW,
) -> dict[str, float | None]:
    """Gate lines for the judged entry (default: the latest): baseline = median MFU of its
    baseline rows (canary_baseline_rows), the lines where the gate's warn / fail levels begin."""
    if df.height == 0:
        return {"baseline": None}
    judged = int(df["n"][-1]) if judged is None else judged
    med, n = baseline_median(canary_baseline_rows(df, judged, window).to_dicts(), ck.MFU)
    if med is None:
        return {"baseline": None, "n_baseline": 0.0}
    return {
        "baseline": med,
        "warn_lo": line_value(med, warn_pct),
        "warn_hi": line_value(med, warn_pct, higher_is_better=False),
        "fail_lo": line_value(med, fail_pct),
        "n_baseline": float(n),
    }


def canary_deltas(df: pl.DataFrame, window: int = CANARY_WINDOW) -> pl.Series:
    """Each entry's MFU p50 vs its own baseline (the baseline entries before it), in %."""
    rows = df.to_dicts()
    out: list[float | None] = []
    for i, row in enumerate(rows):
        med, _ = baseline_median(baseline_before(rows, i, window), ck.MFU)
        out.append(relative_delta(row[ck.MFU], med) if med else None)
    return pl.Series("vs baseline %", out, dtype=pl.Float64)


def kernel_deltas(latest: dict[str, float], baseline: list[dict[str, float]]) -> pl.DataFrame:
    """Per-op self time per step (the canary's `profile_top`), latest vs its baseline's median.

    Raw per-op deltas blame whichever op is noisiest when the whole step slows down (a uniform
    30% slowdown read as silu +654%). So each op is also judged against the overall change:
    `vs overall %` = (op now / op before) / (all ops now / all ops before) - 1, over the ops
    both sides profiled, and by its share of the profiled time. Under a uniform slowdown both
    stay near 0 for every op; an op that really regressed stands out in both."""
    base: dict[str, float] = {}
    for op in {o for e in baseline for o in e}:
        vals = [e[op] for e in baseline if op in e and e[op] is not None]
        if vals:
            base[op] = statistics.median(vals)
    common = [o for o in latest if o in base and base[o] > 0 and latest[o] is not None]
    sch = {
        "op": pl.String,
        "now ms": pl.Float64,
        "baseline ms": pl.Float64,
        "raw change %": pl.Float64,
        "vs overall %": pl.Float64,
        "share now %": pl.Float64,
        "share before %": pl.Float64,
        "share change (pts)": pl.Float64,
    }
    if not common:
        return pl.DataFrame(schema=sch)
    tot_now = sum(latest[o] for o in common)
    tot_base = sum(base[o] for o in common)
    overall = tot_now / tot_base if tot_base > 0 else float("nan")
    rows = []
    for o in common:
        r = latest[o] / base[o]
        rows.append(
            {
                "op": o,
                "now ms": latest[o],
                "baseline ms": base[o],
                "raw change %": 100 * (r - 1),
                "vs overall %": 100 * (r / overall - 1),
                "share now %": 100 * latest[o] / tot_now,
                "share before %": 100 * base[o] / tot_base,
                "share change (pts)": 100 * (latest[o] / tot_now - base[o] / tot_base),
            }
        )
    df = pl.DataFrame(rows, schema=sch)
    return df.sort(pl.col("share change (pts)").abs(), descending=True)


def profile_top(entry_json: str | None) -> dict[str, float]:
    try:
        d = json.loads(entry_json) if entry_json else {}
    except json.JSONDecodeError:
        return {}
    return (
        {str(k): float(v) for k, v in d.items() if isinstance(v, int | float)} if isinstance(d, dict) else {}
    )


# ---------------------------------------------------------------------------------------
# Open alerts (optional): Alertmanager API v2, or the collector's /v1/runs
# ---------------------------------------------------------------------------------------
def fetch_collector_runs(url: str, timeout_s: float = 3.0) -> list[RunListing]:
    """The collector's run listing (GET /v1/runs, guard/wire/runs.py). Raises httpx.HTTPError
    or ValueError when the collector cannot be reached or answers something else."""
    import httpx

    r = httpx.get(url.rstrip("/") + "/v1/runs", timeout=timeout_s)
    if r.status_code != 200:
        raise ValueError(f"HTTP {r.status_code}")
    return parse_runs(r.json())


@st.cache_data(ttl=15, show_spinner=False)
def fetch_open_alerts(url: str) -> tuple[dict[str, int], str | None]:
    """run id -> firing alerts. Tries Alertmanager `/api/v2/alerts`, then the collector's
    `/v1/runs` (the alerts each run's entry implies: RunListing.open_alerts). Returns
    ({}, error) when both fail."""
    import httpx

    base = url.rstrip("/")
    errors = []
    try:
        r = httpx.get(
            base + "/api/v2/alerts",
            params={"active": "true", "silenced": "false", "inhibited": "false"},
            timeout=3.0,
        )
        if r.status_code == 200 and isinstance(r.json(), list):
            out: dict[str, int] = {}
            for a in r.json():
                run = (a.get("labels") or {}).get("run")
                if run and (a.get("status") or {}).get("state", "active") == "active":
                    out[run] = out.get(run, 0) + 1
            return out, None
        errors.append(f"/api/v2/alerts: HTTP {r.status_code}")
    except (httpx.HTTPError, ValueError) as e:
        errors.append(f"/api/v2/alerts: {e}")
    try:
        return {e.run: len(e.open_alerts()) for e in fetch_collector_runs(base)}, None
    except (httpx.HTTPError, ValueError) as e:
        errors.append(f"/v1/runs: {e}")
    return {}, "; ".join(errors)


def clear_caches() -> None:
    st.cache_data.clear()
    st.cache_resource.clear()
    reader.clear_cache()
