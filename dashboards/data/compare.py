"""The Compare page's data: overlays on a chosen x-axis, "is B faster than A", whether two runs
train the same model, what differs between their environments, profiler traces."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import streamlit as st

from dashboards.data.loaders import load_steps, long_run_span
from dashboards.data.shaping import MAX_LINE_POINTS, downsample
from guard.core import schema
from guard.store import reader

ENV_KEYS = ("torch", "attention_backend", "expert_kernel", "compile")


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


X_AXES = {"step": "step", "tokens": "tokens consumed", "wall": "wall time since the first step"}


def wall_unit(span_min: float) -> tuple[str, float]:
    """(unit, factor from minutes) for a wall-time axis spanning `span_min` minutes: seconds
    under 2 min (an 80-step CPU run read 0.005, 0.01 .. 0.025 min), hours past 2 h."""
    if span_min < 2:
        return "s", 60.0
    if span_min < 120:
        return "min", 1.0
    return "h", 1 / 60


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
    elif x_axis == "wall":  # minutes; the chart picks the unit (wall_unit)
        x = (pl.col("time") - pl.col("time").min()) / 60.0
    else:
        x = pl.col("step").cast(pl.Float64)
    df = df.with_columns(x=x)
    keep = downsample(df, metric, max_points=max_points)
    return keep.join(df.select("step", "x"), on="step", how="left").select(
        "step", "x", pl.col(metric).alias("y")
    )


def overlay_buckets(frame: pl.DataFrame, metric: str, x_axis: str, window: int, res: int) -> pl.DataFrame:
    """(step, x, y) for one run from its steps rollups (a reader.read_series frame at `res`
    steps a bucket). Unsmoothed (`window` <= res): each bucket's min at its first step and max at
    its last, so a one-step spike shows; smoothed: the rolling median of bucket means over
    window / res buckets, at each bucket's middle. Tokens: cumulated from bucket means x rows."""
    empty = pl.DataFrame(schema={"step": pl.Int64, "x": pl.Float64, "y": pl.Float64})
    if frame.height == 0:
        return empty
    f = frame.sort("step")
    tok = pl.col("tokens_mean").cast(pl.Float64).fill_nan(0).fill_null(0) * pl.col("n")
    f = f.with_columns(tok_hi=tok.cum_sum())
    f = f.with_columns(tok_lo=pl.col("tok_hi") - tok + pl.col("tokens_mean").cast(pl.Float64).fill_nan(0))
    if x_axis == "tokens":
        x_lo, x_hi = pl.col("tok_lo"), pl.col("tok_hi")
    elif x_axis == "wall":  # minutes; the chart picks the unit (wall_unit)
        t0 = f["time_min"].cast(pl.Float64).min()
        x_lo = (pl.col("time_min").cast(pl.Float64) - t0) / 60.0
        x_hi = (pl.col("time_max").cast(pl.Float64) - t0) / 60.0
    else:
        x_lo, x_hi = pl.col("step_lo").cast(pl.Float64), pl.col("step_hi").cast(pl.Float64)
    if window <= res:
        lo = f.select(pl.col("step_lo").alias("step"), x_lo.alias("x"), pl.col(f"{metric}_min").alias("y"))
        hi = f.select(pl.col("step_hi").alias("step"), x_hi.alias("x"), pl.col(f"{metric}_max").alias("y"))
        out = pl.concat([lo, hi]).sort("step", maintain_order=True)
    else:
        y = f[f"{metric}_mean"].cast(pl.Float64)
        y = y.set(~y.is_finite().fill_null(False), None)
        out = f.select(
            ((pl.col("step_lo") + pl.col("step_hi")) // 2).alias("step"),
            ((x_lo + x_hi) / 2).alias("x"),
            smooth(y, max(1, round(window / res))).alias("y"),
        )
    out = out.with_columns(pl.col("y").cast(pl.Float64), pl.col("step").cast(pl.Int64))
    return out.with_columns(y=pl.when(pl.col("y").is_finite()).then(pl.col("y")))


@st.cache_data(max_entries=64, show_spinner=False)
def load_overlay(path: str, sig: tuple[int, ...], metric: str, x_axis: str, window: int = 1) -> pl.DataFrame:
    """One run's `metric` against `x_axis` (X_AXES), smoothed over `window` steps, downsampled.
    A run longer than loaders.FULL_READ_STEPS is read from its steps rollups at the resolution
    that fits the chart (reader.read_series: ~1,000 buckets, whatever the run's length); a store
    without steps rollups (written before them) is read whole, as before."""
    span = long_run_span(path)
    if span is None or not reader.rollup_resolutions(path, schema.TABLE_STEPS):
        return overlay_series(load_steps(path, sig), metric, x_axis, window)
    got = reader.read_series(
        path,
        schema.TABLE_STEPS,
        columns=tuple(dict.fromkeys((metric, "tokens", "time"))),
        lo=span[0],
        hi=span[1],
        max_points=MAX_LINE_POINTS // 2,  # two points a bucket (its min and max)
    )
    return overlay_buckets(got.frame, metric, x_axis, window, got.resolution)


def steady_median(perf: pl.DataFrame) -> float:
    """Median steady-state tokens/s of one run (NaN when it has none)."""
    t = perf["tokens_per_s"].filter(perf["tokens_per_s"].is_finite()) if perf.height else None
    return float(t.median()) if t is not None and len(t) else float("nan")  # type: ignore[arg-type]


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


@dataclass(frozen=True, slots=True)
class Spread:
    """Run-to-run spread of steady-state tokens/s among runs of one config (same code, model,
    training config, environment), which a within-run interval cannot see: host drift, load."""

    pct: float  # 100 * (largest run median / smallest - 1)
    runs: tuple[str, ...]


def speed_identity(meta: dict[str, Any]) -> str:
    """What decides a run's speed besides the host: its config (seed, length, telemetry and guard
    left out), environment (torch, kernels, compile, device, dtype, ranks, git sha) and the faults
    it injected on purpose (meta.json "injections": a drill's stall, skips and rollbacks are not
    the host's). Runs with the same identity should run at the same speed; their spread is the
    host's."""
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    cfg = {k: v for k, v in cfg.items() if k not in ("telemetry", "guard", "name")}
    if isinstance(cfg.get("train"), dict):
        cfg["train"] = {k: v for k, v in cfg["train"].items() if k not in ("seed", "steps")}
    env = meta.get("env") if isinstance(meta.get("env"), dict) else {}
    keep = {k: env.get(k) for k in (*ENV_KEYS, "device", "dtype", "world_size", "git_sha")}
    injected = meta.get("injections") if isinstance(meta.get("injections"), list) else []
    return json.dumps(
        {"config": cfg, "env": keep, "injections": sorted(map(str, injected))}, sort_keys=True, default=str
    )


def run_spread(medians: dict[str, float]) -> Spread | None:
    """The spread of same-identity runs' median tokens/s (None with fewer than two runs)."""
    vals = {r: v for r, v in medians.items() if math.isfinite(v) and v > 0}
    if len(vals) < 2:
        return None
    return Spread(100 * (max(vals.values()) / min(vals.values()) - 1), tuple(sorted(vals)))


def speedup_sentence(
    name_a: str,
    name_b: str,
    r: dict[str, float],
    *,
    spread: Spread | None = None,
    same_config: bool = False,
) -> str:
    """What the steady-state tokens/s of two runs can say, and no more. The 90% interval is a
    bootstrap over steps within each run: blind to drift between runs made at different times.
    So a difference is set against the run-to-run spread of same-config runs when the store has
    some, and otherwise said with that caveat and a pointer to the A/B canary, which can decide."""
    span = f"90% interval {r['lo']:+.1f}% .. {r['hi']:+.1f}% over steps within each run"
    tps = f"steady-state tokens/s p50 {r['b']:,.0f} vs {r['a']:,.0f}"
    if r["lo"] <= 0 <= r["hi"]:
        return (
            f"No clear difference: **{name_b}** vs **{name_a}** {r['pct']:+.1f}% ({span} includes 0; {tps})."
        )
    word = "higher" if r["pct"] > 0 else "lower"
    head = f"**{name_b}**: tokens/s **{abs(r['pct']):.1f}% {word}** than **{name_a}** ({span}; {tps})."
    if same_config:
        return (
            f"{head} The two runs have the same code, config and environment: the difference is "
            "run-to-run variation (host drift, other load), not a speed difference."
        )
    if spread is not None:
        seen = f"Same-config runs here vary by up to {spread.pct:.1f}% run to run ({len(spread.runs)} runs)"
        if abs(r["pct"]) > spread.pct:
            return f"{head} {seen}; this difference is larger than that."
        return f"{head} {seen}; this difference is within that: not one this store can show."
    return (
        f"{head} Host drift between runs made at different times is not in that interval, and this "
        "store has no same-config repeat to measure it: the A/B canary (`moeguard canary --ab A B`), "
        "which interleaves A and B on one host, is the tool that can decide whether B is faster."
    )


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


def profiler_trace(path: str | Path) -> Path | None:
    """The newest torch.profiler trace a run wrote (runs/<id>/profile/*.pt.trace.json[.gz])."""
    d = Path(path) / schema.PROFILE_DIR
    try:
        found = [p for p in d.iterdir() if p.is_file() and ".pt.trace.json" in p.name]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None
