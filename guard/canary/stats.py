"""One measurement's numbers: the steady-state window, p50s, and pooling worker processes.

Each metric is the p50 over the steps after `canary.warmup_steps` (compile, allocator warm-up,
LR warm-up and the profiler window excluded), never the last sample (a last-sample gate flips on
identical runs).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from guard.canary.config import TIMING_CPU
from guard.canary.keys import DATA_WAIT, LOSS, MEM, MFU, MFU_ADJ, PROC_MFU, PROC_REF, REF, TPS


def _p50(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else float("nan")


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if math.isfinite(x))
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def steady_window(samples: list[dict[str, Any]], warmup_steps: int, profiled: range) -> list[dict[str, Any]]:
    """Steps after warm-up, outside the profiler window, where the update was applied."""
    ok = ("apply", "none")
    return [
        s for s in samples if s["step"] >= warmup_steps and s["step"] not in profiled and s["action"] in ok
    ]


def profiled_steps(train: Any) -> range:
    t = train.telemetry
    if not t.profile:
        return range(0)
    return range(t.profile_wait, t.profile_wait + t.profile_warmup + t.profile_active + 1)


def summarize(result: dict[str, Any], warmup_steps: int, profiled: range) -> dict[str, Any]:
    """Per-metric values of one measurement (the numbers the gate compares).

    CPU timing: MFU = (FLOPs/token * tokens / p50 step CPU time) / (reference FLOPs / p50 reference
    CPU time), both p50s over the same steady-state steps. Medians first, ratio second: a per-step
    ratio adds the reference's own step-to-step jitter to every sample, while the contention it
    corrects for moves on a scale of seconds (run-to-run sd 0.7% this way, 1.3% per-step ratios).
    """
    samples = result["samples"]
    win = steady_window(samples, warmup_steps, profiled)
    fpt = result["flops_per_token"]
    cpu = [s["cpu_s"] for s in win]
    cpu_p50 = _p50(cpu)
    tokens = _p50([float(s["tokens"]) for s in win])
    mfu_wall = [s["mfu"] for s in win]
    tps_wall = [s["tokens_per_s"] for s in win]
    if result["timing"] == TIMING_CPU:
        ref_p50 = _p50([s["ref_cpu_s"] for s in win])
        mfu = (
            (fpt * tokens / cpu_p50) / (result["reference_flops"] / ref_p50) if cpu_p50 > 0 else float("nan")
        )
        tps = tokens / cpu_p50 if cpu_p50 > 0 else float("nan")
        spread = (
            100 * (_quantile(cpu, 0.75) - _quantile(cpu, 0.25)) / cpu_p50 if cpu_p50 > 0 else float("nan")
        )
    else:
        ref_p50 = float("nan")
        mfu, tps = _p50(mfu_wall), _p50(tps_wall)
        spread = 100 * (_quantile(mfu_wall, 0.75) - _quantile(mfu_wall, 0.25)) / mfu if mfu else float("nan")
    step_wall = [s["step_time_s"] for s in win]
    first = samples[0]["step_time_s"] if samples else float("nan")
    wait = sum(s["data_wait_s"] for s in win)
    total = sum(step_wall)
    tail = [s["loss"] for s in samples[-10:]]
    return {
        MFU: mfu,
        TPS: tps,
        MEM: max((s["mem_peak_bytes"] for s in samples), default=0),
        DATA_WAIT: wait / total if total > 0 else float("nan"),
        LOSS: statistics.fmean(tail) if tail else float("nan"),
        "mfu_wall_p50": _p50(mfu_wall),
        "tokens_per_s_wall_p50": _p50(tps_wall),
        "step_iqr_pct": spread,
        "step_cpu_ms_p50": 1e3 * cpu_p50,
        REF: 1e3 * ref_p50,
        "step_wall_ms_p50": 1e3 * _p50(step_wall),
        "first_step_s": first,
        "compile_s": max(0.0, first - _p50(step_wall)) if step_wall else float("nan"),
        "window_steps": len(win),
        "steps": len(samples),
    }


def pool_processes(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One measurement from its processes: the median of each rate (robust to one odd process),
    the highest peak memory, step counts summed; per-process MFU kept for the report."""
    if len(summaries) == 1:
        return {**summaries[0], PROC_MFU: [summaries[0][MFU]], PROC_REF: [summaries[0][REF]]}
    out = dict(summaries[0])
    for key in (
        MFU,
        TPS,
        DATA_WAIT,
        LOSS,
        REF,
        "mfu_wall_p50",
        "tokens_per_s_wall_p50",
        "step_iqr_pct",
        "step_cpu_ms_p50",
        "step_wall_ms_p50",
        "first_step_s",
        "compile_s",
    ):
        out[key] = _p50([s.get(key, float("nan")) for s in summaries])
    out[MEM] = max(s[MEM] for s in summaries)
    out["window_steps"] = sum(s["window_steps"] for s in summaries)
    out["steps"] = sum(s["steps"] for s in summaries)
    out[PROC_MFU] = [s[MFU] for s in summaries]
    out[PROC_REF] = [s[REF] for s in summaries]
    return out


# [canary] keys only the parent reads: not passed to workers, so a worker of an older moeguard (`--ab


def pool_summaries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' gate metrics averaged (the baseline entry of a confirmed canary)."""
    out = dict(summaries[-1])
    for k in (PROC_MFU, PROC_REF):
        out[k] = [v for s in summaries for v in s.get(k) or []]
    for k in (MFU, MFU_ADJ, TPS, MEM, DATA_WAIT, LOSS, REF, "mfu_wall_p50", "tokens_per_s_wall_p50"):
        vals = [s[k] for s in summaries if isinstance(s.get(k), int | float) and math.isfinite(s[k])]
        if vals or k in out:
            out[k] = statistics.fmean(vals) if vals else float("nan")
    return out


def process_pairs(d: dict[str, Any]) -> list[tuple[float, float]]:
    """(MFU, reference ms) of each worker process of a summary or history entry (finite, > 0)."""
    mfus, refs = d.get(PROC_MFU) or [], d.get(PROC_REF) or []
    return [
        (m, r)
        for m, r in zip(mfus, refs, strict=False)
        if isinstance(m, int | float)
        and isinstance(r, int | float)
        and m > 0
        and r > 0
        and math.isfinite(m)
        and math.isfinite(r)
    ]
