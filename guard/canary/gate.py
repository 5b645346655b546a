"""The gate: a measurement against its baseline entries, and the verdict.

Baseline = median of the selected baseline entries (history.select_baseline). A regression must
repeat: when the first run crosses a fail line (or MFU its warn line) the canary re-runs once and
judges both runs (`decide`). On CPU the gated MFU is host-adjusted (`HostFit`), and against a
baseline that spans less than `canary.baseline_min_span_h` its fail line is widened
(`young_fail_line`). The app's Canaries page draws the same median and lines (`line_value`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from guard.canary.config import TIMING_CPU, CanaryConfig
from guard.canary.history import baseline_span_h
from guard.canary.keys import CPU_EFFICIENCY, DATA_WAIT, LOSS, MEM, MFU, MFU_ADJ, MFU_METRICS, TPS
from guard.canary.stats import process_pairs

if TYPE_CHECKING:
    from guard.canary.measure import Measurement

PASS, WARN, FAIL = "pass", "warn", "fail"
_SEVERITY = {PASS: 0, WARN: 1, FAIL: 2}


def worst(levels: list[str]) -> str:
    return max(levels, key=_SEVERITY.__getitem__, default=PASS)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    key: str
    label: str
    higher_is_better: bool
    gate: str  # CanaryConfig field prefix: <gate>_warn_pct / <gate>_fail_pct (data_wait: _pp)
    absolute: bool = False  # compare differences in percentage points instead of ratios


def metric_specs(timing: str) -> tuple[MetricSpec, ...]:
    tps_label = "tokens/s p50 (per CPU-second)" if timing == TIMING_CPU else "tokens/s p50"
    if timing == TIMING_CPU:
        mfu = MetricSpec(MFU_ADJ, f"{CPU_EFFICIENCY} p50 (vs reference matmul, host-adjusted)", True, "mfu")
    else:
        mfu = MetricSpec(MFU, "MFU p50", True, "mfu")
    return (
        mfu,
        MetricSpec(TPS, tps_label, True, "tokens_cpu" if timing == TIMING_CPU else "tokens"),
        MetricSpec(MEM, "peak memory", False, "mem"),
        MetricSpec(DATA_WAIT, "data-wait share", False, "data_wait", absolute=True),
        MetricSpec(LOSS, "final loss", False, "loss"),
    )


def _thresholds(c: CanaryConfig, m: MetricSpec) -> tuple[float, float]:
    unit = "pp" if m.absolute else "pct"
    return getattr(c, f"{m.gate}_warn_{unit}"), getattr(c, f"{m.gate}_fail_{unit}")


def baseline_median(baseline: list[dict[str, Any]], key: str) -> tuple[float | None, int]:
    """The median of `key` over the baseline entries that have a finite value, and how many had one."""
    vals = [e[key] for e in baseline if isinstance(e.get(key), int | float) and math.isfinite(e[key])]
    return (statistics.median(vals) if vals else None), len(vals)


def relative_delta(current: float, base: float, *, absolute: bool = False) -> float:
    """Change from the baseline in percent (absolute: percentage points of a share)."""
    if absolute:
        return 100 * (current - base)
    return 100 * (current / base - 1) if base else 0.0


def level_of(delta: float, warn: float, fail: float, *, higher_is_better: bool) -> str:
    """pass / warn / fail for a change of `delta` (percent) against lines `warn` and `fail`."""
    bad = -delta if higher_is_better else delta
    return FAIL if bad >= fail else WARN if bad >= warn else PASS


def line_value(base: float, pct: float, *, higher_is_better: bool = True) -> float:
    """The value where a relative line of `pct` percent lies (what a chart of the gate draws)."""
    return base * (1 - pct / 100) if higher_is_better else base * (1 + pct / 100)


def compare(
    current: dict[str, Any], baseline: list[dict[str, Any]], c: CanaryConfig, timing: str
) -> list[dict[str, Any]]:
    """One row per metric: current, baseline median, delta, the thresholds and the level."""
    rows = []
    for m in metric_specs(timing):
        base, n = baseline_median(baseline, m.key)
        cur = current.get(m.key)
        warn, fail = _thresholds(c, m)
        row = {
            "metric": m.key,
            "label": m.label,
            "current": cur,
            "baseline": base,
            "n_baseline": n,
            "unit": "pp" if m.absolute else "%",
            "warn": warn,
            "fail": fail,
            "delta": None,
            "level": PASS,
        }
        if base is not None and cur is not None and math.isfinite(cur):
            row["delta"] = relative_delta(cur, base, absolute=m.absolute)
            row["level"] = level_of(row["delta"], warn, fail, higher_is_better=m.higher_is_better)
        rows.append(row)
    return rows


@dataclass(frozen=True, slots=True)
class HostFit:
    """How MFU moves with the host's speed, fitted on the baseline's worker processes (CPU timing).

    Plain normalisation (MFU against the paired reference) assumes the model and the reference slow
    down alike. They do not: when something outside the VM competes for the core, the model slows
    1.4-4.4x as much as the reference in log terms (docs/NOTES.md, canary), so a slow phase of the
    host reads as an MFU drop of up to 8% on an unchanged build. Across the baseline's processes
    this is a line, log MFU = slope * log ref + c (slope = 1 - b; 0 means plain normalisation), and
    `adjust` moves a process's MFU to the baseline's median reference time along it.

    Guard rails, because a fitted correction must never hide a regression:
      - the slope is shrunk towards 0 (plain normalisation) when the baseline saw little host
        variation (ridge with `prior_sd` of log ref), and clamped to [-4, 0.5];
      - a reference time outside the range the baseline saw is clipped to that range: no
        extrapolation (a far slower host is not corrected beyond what was observed);
      - the reference is numpy's BLAS, so no torch change moves it.
    """

    slope: float = 0.0
    log_ref0: float = float("nan")  # the baseline's median log reference time (ms)
    lo: float = float("nan")  # the range of log reference times the baseline saw
    hi: float = float("nan")
    n: int = 0  # baseline processes the fit used (0: no adjustment)
    r: float = float("nan")  # correlation of log MFU with log ref over them

    def adjust(self, mfu: float, ref_ms: float) -> float:
        if self.n == 0 or not (math.isfinite(mfu) and math.isfinite(ref_ms) and ref_ms > 0):
            return mfu
        x = min(max(math.log(ref_ms), self.lo), self.hi)
        return mfu * math.exp(-self.slope * (x - self.log_ref0))


HOST_FIT_MIN_POINTS = 10
HOST_FIT_PRIOR_SD = 0.005
HOST_FIT_SLOPE_RANGE = (-4.0, 0.5)


def fit_host(pairs: list[tuple[float, float]], prior_sd: float = HOST_FIT_PRIOR_SD) -> HostFit:
    """Least squares of log MFU on log ref, shrunk towards slope 0 (see HostFit)."""
    if len(pairs) < HOST_FIT_MIN_POINTS:
        return HostFit()
    xs = [math.log(r) for _, r in pairs]
    ys = [math.log(m) for m, _ in pairs]
    n, xm, ym = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - xm) ** 2 for x in xs)
    syy = sum((y - ym) ** 2 for y in ys)
    sxy = sum((x - xm) * (y - ym) for x, y in zip(xs, ys, strict=True))
    lo_s, hi_s = HOST_FIT_SLOPE_RANGE
    slope = min(max(sxy / (sxx + n * prior_sd**2), lo_s), hi_s)
    r = sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")
    return HostFit(slope=slope, log_ref0=statistics.median(xs), lo=min(xs), hi=max(xs), n=n, r=r)


def adjusted_median(pairs: list[tuple[float, float]], fit: HostFit) -> float:
    """The median over processes of the host-adjusted MFU (one measurement's gated value)."""
    return statistics.median(fit.adjust(m, r) for m, r in pairs)


def with_host_adjusted(d: dict[str, Any], fit: HostFit) -> dict[str, Any]:
    """A copy of a summary / history entry with MFU_ADJ (the plain MFU where it has no
    per-process pairs)."""
    pairs = process_pairs(d)
    return {**d, MFU_ADJ: adjusted_median(pairs, fit) if pairs else d.get(MFU)}


def baseline_spread_pct(baseline: list[dict[str, Any]], key: str) -> float | None:
    """The baseline's own spread of the gated MFU, in percent: (max - min) / median over its
    entries; with one entry, over that entry's worker processes. None when there is nothing to span."""
    vals = [
        e[key]
        for e in baseline
        if isinstance(e.get(key), int | float) and math.isfinite(e[key]) and e[key] > 0
    ]
    if len(vals) < 2 and len(baseline) == 1:
        vals = [m for m, _ in process_pairs(baseline[0])]
    if len(vals) < 2:
        return None
    return 100 * (max(vals) - min(vals)) / statistics.median(vals)


def young_fail_line(baseline: list[dict[str, Any]], timing: str, c: CanaryConfig) -> dict[str, Any]:
    """The MFU fail line to apply, and why (CPU timing, see CanaryConfig.baseline_min_span_h).

    A baseline whose entries span less than baseline_min_span_h has not seen a shared host's slow
    and fast spells, so the configured line would false-alarm on drift. The line is widened, not
    disarmed:

        fail = max(mfu_fail_pct, min(young_fail_cap_pct, max(young_spread_factor x spread, young_fail_floor_pct)))

    spread = the baseline's own (max - min) / median (baseline_spread_pct). The floor (10%) is about
    twice the drift this class of host shows within an hour on an unchanged build (docs/BENCHMARKS.md,
    canary: clean first-run MFU deltas down to -5.1% against a history of 0.9 h, the host's step time
    +22% in 30 minutes, two thirds of it normalised away); 3x the spread covers a baseline that saw
    more. The cap (20%) keeps the gate armed whatever a few noisy entries say: a 30% slowdown reads
    -23% MFU and fails from the first day. The warn line and the re-run rule stay as configured.
    """
    span = baseline_span_h(baseline)
    key = MFU_ADJ if timing == TIMING_CPU else MFU
    out = {
        "armed": True,
        "widened": False,
        "fail_pct": c.mfu_fail_pct,
        "configured_fail_pct": c.mfu_fail_pct,
        "spread_pct": None,
        "baseline_span_h": span,
        "reason": "",
    }
    if timing != TIMING_CPU or c.baseline_min_span_h <= 0 or not baseline or span >= c.baseline_min_span_h:
        return out
    spread = baseline_spread_pct(baseline, key)
    wide = min(c.young_fail_cap_pct, max(c.young_spread_factor * (spread or 0.0), c.young_fail_floor_pct))
    line = max(c.mfu_fail_pct, wide)
    out.update(widened=line > c.mfu_fail_pct, fail_pct=line, spread_pct=spread)
    spread_txt = "no spread (one process)" if spread is None else f"spread {spread:.1f}%"
    out["reason"] = (
        f"the {len(baseline)} baseline entries span {span:.1f} h, less than canary.baseline_min_span_h = "
        f"{c.baseline_min_span_h:g} h, so the MFU fail line is -{line:.1f}% = max(configured "
        f"-{c.mfu_fail_pct:g}%, min(cap {c.young_fail_cap_pct:g}%, max({c.young_spread_factor:g} x the "
        f"baseline's {spread_txt}, floor {c.young_fail_floor_pct:g}%))); record baselines (--record) at "
        "other times to narrow it"
    )
    return out


def needs_confirmation(rows: list[dict[str, Any]]) -> bool:
    """Re-run when any gate fails, or when MFU (the gate with the most noise) is past its warn line."""
    return any(r["level"] == FAIL or (r["metric"] in MFU_METRICS and r["level"] == WARN) for r in rows)


def decide(comparisons: list[list[dict[str, Any]]], pooled: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Final level per metric. One run: its level. Confirmed (two runs): fail only if the mean of
    both runs is past the fail line AND the re-run alone is past the warn line (it regressed too);
    warn if anything was past a line; else pass."""
    first = comparisons[0]
    out = []
    for i, row in enumerate(first):
        d = {
            "metric": row["metric"],
            "label": row["label"],
            "first": row["level"],
            "second": None,
            "pooled": None,
            "pooled_delta": None,
            "final": row["level"],
        }
        if pooled:
            second, both = comparisons[1][i], pooled[i]
            d.update(second=second["level"], pooled=both["level"], pooled_delta=both["delta"])
            repeated = both["level"] == FAIL and _SEVERITY[second["level"]] >= _SEVERITY[WARN]
            seen = worst([row["level"], second["level"], both["level"]])
            d["final"] = FAIL if repeated else (WARN if seen != PASS else PASS)
        out.append(d)
    return out


@dataclass(kw_only=True, slots=True)
class Judgement:
    """What the gate saw and decided for one canary: its runs (one, or two when the first regressed),
    each run's comparison with the baseline, the mean of both compared (after a re-run), the judged
    numbers (the first run's, or the mean of both) and the final level per metric."""

    runs: list[Measurement]
    comparisons: list[list[dict[str, Any]]]
    summary: dict[str, Any]
    pooled: list[dict[str, Any]] = field(default_factory=list)
    decision: list[dict[str, Any]] = field(default_factory=list)
    verdict: str = PASS

    def decide(self) -> None:
        self.decision = decide(self.comparisons, self.pooled)
        self.verdict = worst([d["final"] for d in self.decision])
