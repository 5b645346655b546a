"""The canary history (JSONL, one object per canary run; written by `moeguard canary`) as tables.

Parsed and judged with guard/canary's own parser, baseline rule and deltas, so the page's
baseline is the one the gate used: the last `history_window` baseline entries recorded before
the judged one with its fingerprint and config hash."""

from __future__ import annotations

import json
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
import streamlit as st

from guard.canary import keys as ck
from guard.canary.config import CanaryConfig
from guard.canary.gate import baseline_median, line_value, relative_delta
from guard.canary.history import baseline_before, entry_time, is_number, parse_history

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
