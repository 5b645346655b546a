"""runs/<run_id>/summary.json: what the Runs page and other readers need of a run, kept current
as the run goes (the in-process writer thread after each flush, the collector after each
checkpoint), so no reader has to scan a long run's tables to list it.

    {"summary_version": 1, "steps_written": 1000000, "first_step": 0, "last_step": 999999,
     "last_time": 1.7e9, "last_loss": 2.31, "last": {<the last steps row>},
     "actions": {"skip": 3, ...}, "events": {"verdict": 12, ...}, "status": "running",
     "updated_at": 1.7e9, "rollups": {"experts": [10, 100, 1000], ...},
     "full_fidelity": [[lo, hi], ...], "incidents": [step, ...], "rolled_through": 998}

`incidents`: the newest 1,000 incident steps (`incident_count` counts all); `granted` ([step,
half-width] windows) and `incident_points` (steps kept alone once the budget is spent, as merged
ranges) are what retention keeps (guard/store/retention.py); `retired`: the [first, last] step
range whose raw rows were thinned; `rolled_from`: the first segment this store rolls up (a store
written before rollups keeps its older rows raw).
`full_fidelity`: inclusive step ranges in which every raw layers/experts/groups/ranks row is
kept (guard/store/retention.py keeps it; readers ask `reader.full_fidelity_ranges`).
`rolled_through`: the last segment (guard/store/layout.py SEGMENT_STEPS) whose rollups and
compaction are done. A store written before summaries existed has no summary.json:
`read_summary` returns None and readers fall back to scanning (as they did).

`parts` (PARTS_KEY; written since issue #38's Runs page, still summary_version 1: a key added
to the document keeps the version, so an older moeguard still reads and resumes the run; a
summary without it reads as before): {table: {"mtime_ns": the table folder's mtime when the
writer listed it (0: no folder), "tail": [[part name, size in bytes], ...]}} for every table,
the tail being the parts the Runs page checks for truncation: the open segment's (from
`last_step`) and the TAIL_BEFORE newest before it, the newest TAIL_MAX of them. A reader that stats each table folder and
finds the same mtimes (no part written, compacted or removed since; `current_tails`) knows the
run's parts without listing a folder, and checks each tail part by one stat(): a size other
than the one written means it was cut or rewritten, and only then are its bytes read.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import polars as pl

from guard.core import actions, schema
from guard.store.layout import SEGMENT_STEPS, atomic_write_bytes, newest_part_names

SUMMARY_VERSION = 1
PARTS_KEY = "parts"
TAIL_BEFORE = 2  # the Runs page checks the open segment's parts and this many before them
TAIL_MAX = 64  # ... the newest this many of those (a job's open segment has ~20; a collector's up to ~1,000)


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's summary.json, or None when it is missing, damaged or of a newer version."""
    p = Path(run_dir) / schema.SUMMARY_FILE
    try:
        doc = json.loads(p.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("summary_version"), int):
        return None
    return doc if doc["summary_version"] <= SUMMARY_VERSION else None


def write_summary(run_dir: str | Path, doc: dict[str, Any]) -> None:
    """Replace summary.json whole (temp name, fsync, rename)."""
    atomic_write_bytes(
        Path(run_dir) / schema.SUMMARY_FILE, json.dumps(_jsonable(doc), sort_keys=True).encode()
    )


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def empty_summary() -> dict[str, Any]:
    return {
        "summary_version": SUMMARY_VERSION,
        "steps_written": 0,
        "first_step": None,
        "last_step": None,
        "last_time": None,
        "last_loss": None,
        "last": {},
        "actions": actions.zero(),
        "events": {},
        "status": schema.STATUS_RUNNING,
        "updated_at": time.time(),
        "rollups": {},
        "full_fidelity": [],
        "incidents": [],
        "rolled_through": -1,
    }


def add_steps(doc: dict[str, Any], steps: pl.DataFrame) -> None:
    """Count a frame of new `steps` rows into the summary (rows in step order)."""
    if steps.height == 0:
        return
    doc["steps_written"] += steps.height
    lo, hi = int(steps["step"].min()), int(steps["step"].max())  # type: ignore[arg-type]
    doc["first_step"] = lo if doc["first_step"] is None else min(doc["first_step"], lo)
    if doc["last_step"] is None or hi >= doc["last_step"]:
        last = steps.filter(pl.col("step") == hi).row(-1, named=True)
        doc["last_step"], doc["last"] = hi, last
        doc["last_time"], doc["last_loss"] = last.get("time"), last.get("loss")
    acts = steps.filter(pl.col("action").is_in(list(actions.STEP_ACTIONS))).group_by("action").len()
    for a, n in acts.iter_rows():
        doc["actions"][a] = doc["actions"].get(a, 0) + int(n)
    _add_recent(doc, steps)
    doc["updated_at"] = time.time()


RECENT_STEPS = 100  # the Runs page's MFU and tokens/s are medians over the last this many steps
MFU_LIMIT = 1.0  # an MFU above it is a measurement artefact (dashboards/data/mfu_peak.py says so)


def _add_recent(doc: dict[str, Any], steps: pl.DataFrame) -> None:
    """Keep the finite MFU and tokens/s of the last RECENT_STEPS steps (`recent`) and count the
    steps whose MFU is over MFU_LIMIT (`mfu_over`): the Runs page reads these, not the steps."""
    if "mfu" not in steps.columns or "tokens_per_s" not in steps.columns:
        return
    tail = steps.sort("step").tail(RECENT_STEPS)
    recent = doc.setdefault("recent", {})
    for c in ("mfu", "tokens_per_s"):
        vals = tail[c].filter(tail[c].is_finite()).to_list()
        recent[c] = (list(recent.get(c, [])) + vals)[-RECENT_STEPS:]
    over = steps.select((pl.col("mfu").is_finite() & (pl.col("mfu") > MFU_LIMIT)).sum()).item()
    doc["mfu_over"] = int(doc.get("mfu_over", 0)) + int(over or 0)


def add_events(doc: dict[str, Any], events: pl.DataFrame) -> None:
    """Count a frame of new `events` rows into the summary."""
    if events.height == 0:
        return
    for kind, n in events.group_by("kind").len().iter_rows():
        doc["events"][str(kind)] = doc["events"].get(str(kind), 0) + int(n)
    counted = events.filter(
        (pl.col("kind") == schema.EV_ACTION) & pl.col("action").is_in(list(actions.EVENT_ACTIONS))
    )
    for a, n in counted.group_by("action").len().iter_rows():
        doc["actions"][a] = doc["actions"].get(a, 0) + int(n)
    # a run recorded before issue #28 logged bias corrections as events only: count_actions
    # counts their steps when the steps table has none, and the Runs page does the same from here
    bias = events.filter((pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_BIAS_CORRECT))
    doc["bias_correct_event_steps"] = int(doc.get("bias_correct_event_steps", 0)) + bias["step"].n_unique()
    doc["updated_at"] = time.time()


# ---- the Runs page's listing (PARTS_KEY) ---------------------------------------------------
def open_segment_start(last_step: Any) -> int:
    """The first step of the segment holding `last_step` (0 when there is no step yet)."""
    return (last_step // SEGMENT_STEPS) * SEGMENT_STEPS if isinstance(last_step, int) else 0


def table_tails(run_dir: str | Path, last_step: Any) -> dict[str, dict[str, Any]]:
    """PARTS_KEY's value for the run as it is on disk now. Each folder is stat()ed before it is
    listed: a part landing during the listing leaves a recorded mtime older than the folder's,
    so readers list it themselves rather than miss the part. (No memo of an unchanged folder:
    a part renamed in within the same mtime tick as an earlier listing would be missed for good.)"""
    open_from = open_segment_start(last_step)
    out: dict[str, dict[str, Any]] = {}
    for t in schema.TABLES:
        d = os.path.join(run_dir, t)
        try:
            mtime = os.stat(d).st_mtime_ns
        except OSError:
            out[t] = {"mtime_ns": 0, "tail": []}
            continue
        tail = []
        for name in newest_part_names(d, open_from, TAIL_BEFORE, TAIL_MAX):
            try:
                tail.append([name, os.stat(os.path.join(d, name)).st_size])
            except OSError:  # removed while listed: the folder's mtime moved, readers list it
                continue
        out[t] = {"mtime_ns": mtime, "tail": tail}
    return out


def current_tails(doc: dict[str, Any], run_dir: str | Path) -> dict[str, list[list[Any]]] | None:
    """table -> the summary's tail ([[part name, size], ...], oldest first) when every table
    folder is as the writer last listed it (same mtime); None when a folder changed since, or the
    summary predates PARTS_KEY: then list the folders."""
    parts = doc.get(PARTS_KEY)
    if not isinstance(parts, dict):
        return None
    out = {}
    base = os.fspath(run_dir) + os.sep
    for t in schema.TABLES:
        rec = parts.get(t)
        if not isinstance(rec, dict) or not isinstance(tail := rec.get("tail"), list):
            return None
        try:
            mtime = os.stat(base + t).st_mtime_ns
        except OSError:
            mtime = 0
        if mtime != rec.get("mtime_ns"):
            return None
        out[t] = tail
    return out
