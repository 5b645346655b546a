"""Which raw rows a long run keeps: every row of the newest `raw_window_steps` steps and of
+-`incident_steps` around every incident, forever; older layers/experts/groups/ranks rows live on
as rollups (guard/store/rollup.py) and are dropped only after their segment's rollups are durable
(guard/store/maintain.py orders it). The `steps` and `events` tables are never thinned.

An incident is a step with a guard verdict, an action, an injected fault, an operator command, a
restart (resume), a halt, a rerun or a straggler event, or a step whose decision is not apply /
none, or whose loss or grad norm is not finite. Windows are granted in the order incidents
happen until `incident_budget_steps` are spent; after that an incident keeps its own step only.
So a window, once granted, never shrinks as the run goes on.

Readers ask `guard.store.reader.full_fidelity_ranges(run_dir)` where raw rows are guaranteed
(summary.json keeps them; the reader's side lives in reader.py, so this module never imports it).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import polars as pl

from guard.core import schema

INCIDENT_EVENT_KINDS = (
    schema.EV_VERDICT,
    schema.EV_ACTION,
    schema.EV_INJECT,
    schema.EV_OPERATOR,
    schema.EV_RESUME,
    schema.EV_HALT,
    schema.EV_RERUN,
    schema.EV_STRAGGLER,
)
# Step decisions that are not incidents by themselves.
_QUIET_ACTIONS = (schema.ACT_APPLY, schema.ACT_NONE)
# Tables whose old raw rows retention drops (once rolled up); the rest are kept whole.
THINNED_TABLES = schema.THINNED_TABLES


def incident_steps(steps: pl.DataFrame | None, events: pl.DataFrame | None) -> list[int]:
    """Steps that are incidents, sorted, each once, from new `steps` and `events` rows."""
    out: set[int] = set()
    if steps is not None and steps.height:
        bad = steps.filter(
            ~pl.col("action").fill_null(schema.ACT_APPLY).is_in(list(_QUIET_ACTIONS))
            | ~pl.col("loss").fill_null(0.0).is_finite()
            | ~pl.col("grad_norm").fill_null(0.0).is_finite()
        )
        out.update(int(s) for s in bad["step"].to_list())
    if events is not None and events.height:
        ev = events.filter(pl.col("kind").is_in(list(INCIDENT_EVENT_KINDS)))
        out.update(int(s) for s in ev["step"].to_list() if s is not None and s >= 0)
    return sorted(out)


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Inclusive ranges merged where they overlap or touch, sorted."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


NEWEST_INCIDENTS = 1000  # incident steps summary.json lists (all are counted and kept)


def grant(doc: dict[str, Any], new_incidents: Iterable[int], half: int, budget: int) -> None:
    """Grant windows to incidents not seen yet, in step order, into summary `doc`: +-half while
    `budget` raw steps last (doc["granted"]: [step, half] pairs, at most budget / (2 half + 1) of
    them), then the incident's own step (doc["incident_points"]: merged ranges, so a detector that
    fires every step adds one range, not a million entries). doc["incident_count"] counts them,
    doc["incidents"] lists the newest NEWEST_INCIDENTS."""
    granted: list[list[int]] = doc.setdefault("granted", [])
    points = [tuple(r) for r in doc.get("incident_points", [])]
    seen = {g[0] for g in granted}
    used = sum(hi - lo + 1 for lo, hi in windows_of(granted))
    new = [s for s in sorted(set(new_incidents)) if s not in seen and not _inside(points, s)]
    for s in new:
        if half > 0 and used + 2 * half + 1 <= budget:
            granted.append([s, half])
            used = sum(hi - lo + 1 for lo, hi in windows_of(granted))
        else:
            points.append((s, s))
    doc["incident_points"] = [list(r) for r in merge_ranges(points)]
    doc["incident_count"] = int(doc.get("incident_count", 0)) + len(new)
    doc["incidents"] = sorted({*doc.get("incidents", []), *new})[-NEWEST_INCIDENTS:]


def _inside(ranges: list[tuple[int, ...]], s: int) -> bool:
    return any(lo <= s <= hi for lo, hi in ranges)


def kept_windows(doc: dict[str, Any]) -> list[tuple[int, int]]:
    """Every raw step incidents keep (their windows and, past the budget, their own steps), merged."""
    return merge_ranges(
        [*windows_of(doc.get("granted", [])), *(tuple(r) for r in doc.get("incident_points", []))]
    )  # type: ignore[misc]


def windows_of(granted: Iterable[list[int]]) -> list[tuple[int, int]]:
    """The inclusive step ranges the granted incident windows keep, merged."""
    return merge_ranges((max(0, s - w), s + w) for s, w in granted)


def keep_expr(ranges: list[tuple[int, int]]) -> pl.Expr:
    """A filter that keeps the rows whose step lies in one of `ranges`."""
    expr = pl.lit(False)
    for lo, hi in ranges:
        expr = expr | pl.col("step").is_between(lo, hi)
    return expr


def full_fidelity_ranges(run_dir: str | Path) -> list[tuple[int, int]]:
    """Inclusive step ranges in which every raw layers/experts/groups/ranks row is kept (the
    contract's name; the reader implements it, old stores included)."""
    from guard.store.reader import full_fidelity_ranges as ranges

    return ranges(run_dir)
