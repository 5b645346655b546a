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
THINNED_TABLES = schema.ROLLUP_TABLES


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


def grant_windows(
    granted: list[list[int]], new_incidents: Iterable[int], half: int, budget: int
) -> list[list[int]]:
    """`granted` (the [step, half-width] pairs already granted, in grant order) with windows for
    incidents not granted yet: +-half while the budget lasts (steps newly covered are counted),
    then +-0. Returns the new list (the old pairs unchanged, first)."""
    out = [list(g) for g in granted]
    seen = {g[0] for g in out}
    used = sum(hi - lo + 1 for lo, hi in windows_of(out))
    for s in sorted(set(new_incidents) - seen):
        w = half if used + 2 * half + 1 <= budget else 0
        out.append([s, w])
        used = sum(hi - lo + 1 for lo, hi in windows_of(out))
    return out


def windows_of(granted: Iterable[list[int]]) -> list[tuple[int, int]]:
    """The inclusive step ranges the granted incident windows keep, merged."""
    return merge_ranges((max(0, s - w), s + w) for s, w in granted)


def kept_ranges(
    granted: Iterable[list[int]], retired_through: int, last_step: int | None
) -> list[tuple[int, int]]:
    """Where raw rows are guaranteed: the incident windows, plus everything after the last step
    retention may have thinned (`retired_through`; -1: nothing thinned yet)."""
    tail = [(retired_through + 1, last_step)] if last_step is not None and last_step > retired_through else []
    return merge_ranges([*windows_of(granted), *tail])


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
