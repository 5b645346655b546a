"""The canary history: a JSONL file, one entry per canary run, and the baseline rule.

`moeguard canary` appends to it (`--record`: a baseline entry; `--append`: a trend entry) and
judges a run against it; the app's Canaries page reads it with the same parser and rule, so the
chart's baseline is the one the gate used.

Baseline rule (`select_baseline`): the last `history_window` entries flagged as baseline with the
same fingerprint (hardware class + config hash) and config hash, recorded before the judged run.
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guard.canary.keys import (
    DATA_WAIT,
    ENV_KEYS,
    H_BASELINE,
    H_CFG,
    H_CFG_HASH,
    H_FAIL_PCT,
    H_FP,
    H_HW,
    H_PROFILE_TOP,
    H_SHA,
    H_TIME,
    H_TIME_FORMAT,
    H_TORCH,
    H_VERDICT,
    H_WARN_PCT,
    LOSS,
    MEM,
    MFU,
    PROC_MFU,
    PROC_REF,
    REF,
    TPS,
)

if TYPE_CHECKING:
    from guard.canary.config import Setup
    from guard.canary.measure import Measurement


def parse_history(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Entries in file order and the lines skipped ("line 3: not JSON"); never raises on a bad line.

    An entry is a JSON object with a numeric mfu_p50; every other key is optional to a reader."""
    entries, problems = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            problems.append(f"line {n}: not JSON")
            continue
        if not isinstance(obj, dict) or not is_number(obj.get(MFU)):
            problems.append(f"line {n}: not a canary entry")
            continue
        entries.append(obj)
    return entries, problems


def read_history(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """parse_history of a file; a missing file is an empty history."""
    if not path.is_file():
        return [], []
    return parse_history(path.read_text(errors="replace"))


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def entry_time(v: Any) -> float | None:
    """An entry's time as Unix seconds: ISO 8601 (what the canary writes; naive means UTC) or a
    number of Unix seconds (older writers); None when it is neither."""
    if is_number(v):
        return float(v)
    if isinstance(v, str):
        try:
            t = datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            return None
        return (t.replace(tzinfo=UTC) if t.tzinfo is None else t).timestamp()
    return None


def select_baseline(
    entries: list[dict[str, Any]], fingerprint: str, config_hash: str | None, window: int
) -> list[dict[str, Any]]:
    """The last `window` baseline entries of `entries` with this fingerprint and config hash."""
    same = [
        e
        for e in entries
        if e.get(H_BASELINE) is True and e.get(H_FP) == fingerprint and e.get(H_CFG_HASH) == config_hash
    ]
    return same[-window:]


def baseline_before(entries: list[dict[str, Any]], judged: int, window: int) -> list[dict[str, Any]]:
    """The baseline entry `judged` (an index into `entries`) was compared with when it was recorded:
    select_baseline over the entries before it, with its fingerprint and config hash. An entry is
    never part of its own baseline."""
    e = entries[judged]
    return select_baseline(entries[:judged], e.get(H_FP), e.get(H_CFG_HASH), window)


def baseline_span_h(baseline: list[dict[str, Any]]) -> float:
    """Hours from the first to the last recorded entry (0 when fewer than two carry a time)."""
    times = [t for t in (entry_time(e.get(H_TIME)) for e in baseline) if t is not None]
    return (max(times) - min(times)) / 3600 if len(times) > 1 else 0.0


def append_history(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(entry, sort_keys=False, default=json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def json_default(v: Any) -> Any:
    """json.dumps default: a non-finite float is null (JSON has no NaN), anything else its str."""
    return None if isinstance(v, float) and not math.isfinite(v) else str(v)


def finite(v: Any) -> Any:
    """A copy with every non-finite float (nested in dicts and lists too) replaced by None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [finite(x) for x in v]
    return v


def history_entry(
    m: Measurement,
    s: dict[str, Any],
    setup: Setup,
    fingerprint: str,
    config_hash: str,
    verdict: str,
    baseline: bool,
) -> dict[str, Any]:
    """The JSONL line; `s` is the run's summary (the two runs' mean when the canary re-ran)."""
    r, env = m.result, m.result.get("env", {})
    prof = s.get("profile", {})
    return finite(
        {
            H_TIME: time.strftime(H_TIME_FORMAT, time.gmtime()),
            H_SHA: env.get("git_sha", "unknown"),
            H_TORCH: env.get("torch", "?"),
            H_FP: fingerprint,
            H_HW: r.get("hardware"),
            H_CFG_HASH: config_hash,
            H_CFG: setup.label(),
            MFU: s.get(MFU),
            TPS: s.get(TPS),
            MEM: s.get(MEM),
            DATA_WAIT: s.get(DATA_WAIT),
            LOSS: s.get(LOSS),
            H_VERDICT: verdict,
            H_BASELINE: baseline,
            "timing": r.get("timing"),
            "mfu_wall_p50": s.get("mfu_wall_p50"),
            "tokens_per_s_wall_p50": s.get("tokens_per_s_wall_p50"),
            REF: s.get(REF),
            PROC_MFU: s.get(PROC_MFU),
            PROC_REF: s.get(PROC_REF),
            "step_cpu_ms_p50": s.get("step_cpu_ms_p50"),
            "step_iqr_pct": s.get("step_iqr_pct"),
            H_WARN_PCT: setup.canary.mfu_warn_pct,
            H_FAIL_PCT: setup.canary.mfu_fail_pct,
            "run_id": r.get("run_id"),
            "runs": 1 + (m.attempt > 1),
            "loadavg": r.get("loadavg"),
            "env": {k: env.get(k) for k in ENV_KEYS},
            H_PROFILE_TOP: {row["op"]: round(row["self_ms"], 4) for row in prof.get("top_self", [])},
        }
    )
