"""Top ops from a canary run's torch.profiler trace (Kineto chrome-trace JSON), and their change.

The canary config profiles a few steps (outside the steady window); the report lists the top host
ops by self and total time, the top device kernels, and each op's self time against the baseline
entries' `profile_top`.
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from typing import Any

from guard.canary.keys import H_PROFILE_TOP
from guard.core import schema


def profile_summary(run_dir: Path, top: int = 10) -> dict[str, Any]:
    """Top host ops (by self and by total time) and device kernels from runs/<id>/profile/."""
    files = sorted((run_dir / schema.PROFILE_DIR).glob("*.json*"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {"file": None, "note": "no torch.profiler trace (telemetry.profile = false?)"}
    path = files[-1]
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        return {"file": str(path), "note": f"unreadable trace: {e}"}
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    n_steps = sum(1 for e in events if str(e.get("name", "")).startswith("ProfilerStep#")) or 1
    host = [e for e in events if e.get("cat") == "cpu_op"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host_stats = _op_stats(host, nested=True)
    dev_stats = _op_stats(device, nested=False)

    def rows(stats: dict[str, list[float]], by: int, limit: int) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda kv: kv[1][by], reverse=True)[:limit]
        return [
            {
                "op": k,
                "calls": int(v[0] / n_steps),
                "total_ms": v[1] / 1e3 / n_steps,
                "self_ms": v[2] / 1e3 / n_steps,
            }
            for k, v in ranked
        ]

    host_self_total = sum(v[2] for v in host_stats.values()) / 1e3 / n_steps
    return {
        "file": str(path),
        "profiled_steps": n_steps,
        "host_self_ms_per_step": host_self_total,
        "top_total": rows(host_stats, 1, top),
        "top_self": rows(host_stats, 2, top),
        "device_top": rows(dev_stats, 1, top),
    }


def _op_stats(events: list[dict[str, Any]], *, nested: bool) -> dict[str, list[float]]:
    """name -> [calls, total_us, self_us]; self time subtracts direct children on the same thread."""
    stats: dict[str, list[float]] = {}
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e.get("ts", 0)), -float(e.get("dur", 0))))
        stack: list[tuple[float, str]] = []  # (end_ts, name) of the enclosing ops
        for e in evs:
            ts, dur, name = float(e.get("ts", 0)), float(e.get("dur", 0)), str(e.get("name"))
            s = stats.setdefault(name, [0, 0.0, 0.0])
            s[0] += 1
            s[1] += dur
            s[2] += dur
            if not nested:
                continue
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if stack:
                stats[stack[-1][1]][2] -= dur  # the parent's self time excludes this child
            stack.append((ts + dur, name))
    return stats


def profile_deltas(current: dict[str, Any], baseline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-op self time per step now vs the baseline entries' median (ops in either top list)."""
    now = {r["op"]: r["self_ms"] for r in current.get("top_self", [])}
    base: dict[str, list[float]] = {}
    for e in baseline:
        for op, ms in (e.get(H_PROFILE_TOP) or {}).items():
            base.setdefault(op, []).append(ms)
    out = []
    for op in list(now) + [o for o in base if o not in now]:
        b = statistics.median(base[op]) if op in base else None
        n = now.get(op)
        out.append(
            {
                "op": op,
                "self_ms": n,
                "baseline_ms": b,
                "delta_pct": 100 * (n / b - 1) if n is not None and b else None,
            }
        )
    return out
