"""What counts as a guard action, defined once and counted the same way everywhere.

A guard action is something the guard did that changed training (issue #17: the CLI said
"skip 2", the app 3, and Prometheus 0 skips for the same run):

  * every step whose decision (`steps.action`, `StepReport.action`) is not apply/none:
    skip, rollback, halt, clip (kept for old run stores: today a clip decision is resolved to an
    apply or a skip before the update, guard/runtime/apply.py), and bias_correct (issue #28: a step whose update was applied AND on
    which a collapse correction started: a selection-bias push or a per-layer aux-loss boost).
    One per step: the step's row is the record of what happened to that update (a rollback that
    found no snapshot and skipped counts as the skip it was; two layers whose corrections start
    on the same step are one bias_correct step, with one `action` event per layer as evidence);
  * the LR cool-down a rollback starts: an `action` event lr_cooldown (its step's row says
    rollback, so the step table cannot show it).

Not actions: verdict events (evidence; their `action` field repeats what their step did),
bias_correct `action` events (evidence per layer; their step's row counts), `recovered` events
(a correction ended), rollback and halt events (they describe the step's own action, already
counted once by its row), checkpoints, injections.

Runs recorded before issue #28 carry their corrections as events only, on `apply` rows: a reader
that finds no bias_correct row counts the distinct steps of bias_correct events instead (`tally`
does the same per step when the row says apply), so old and new runs count alike.

Readers: the CLI summary, meta.json `guard_actions`, the app (dashboards/data/loaders.py), the
collector's moeguard_guard_actions_total{action} (guard/collector/metrics.py) and `moeguard demo`.
The collector counts what it receives, so a trainer resumed from a checkpoint re-sends the
steps after it and the counter counts them again (Prometheus counters are for rates).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from guard.core import schema

STEP_ACTIONS = (  # one per row
    schema.ACT_SKIP,
    schema.ACT_ROLLBACK,
    schema.ACT_HALT,
    schema.ACT_BIAS_CORRECT,
    schema.ACT_CLIP,
)
EVENT_ACTIONS = (schema.ACT_LR_COOLDOWN,)  # one per `action` event
GUARD_ACTIONS = (*STEP_ACTIONS, *EVENT_ACTIONS)


def is_step_action(action: str | None) -> bool:
    """A step decision that counts (not apply, not none)."""
    return action in STEP_ACTIONS


def is_event_action(kind: str | None, action: str | None) -> bool:
    """An event that counts: the LR cool-down a rollback started."""
    return kind == schema.EV_ACTION and action in EVENT_ACTIONS


def _kind_action(ev: Any) -> tuple[Any, Any]:
    return (ev.get("kind"), ev.get("action")) if isinstance(ev, Mapping) else (ev.kind, ev.action)


def zero() -> dict[str, int]:
    return dict.fromkeys(GUARD_ACTIONS, 0)


def tally(counts: dict[str, int], step_action: str | None, events: Iterable[Any] = ()) -> dict[str, int]:
    """Add one step: its decision and its events (Event objects or event rows). Returns counts.
    A step recorded before issue #28 (a bias_correct action event on another row) counts its
    correction once, as a new run's bias_correct row does (a correction now starts only on an
    applied step, whose row says bias_correct)."""
    if is_step_action(step_action):
        counts[step_action] = counts.get(step_action, 0) + 1  # type: ignore[index]
    old_correction = False
    for ev in events:
        kind, action = _kind_action(ev)
        if is_event_action(kind, action):
            counts[action] = counts.get(action, 0) + 1
        elif (
            kind == schema.EV_ACTION and action == schema.ACT_BIAS_CORRECT and step_action == schema.ACT_APPLY
        ):
            old_correction = True
    if old_correction:
        counts[schema.ACT_BIAS_CORRECT] = counts.get(schema.ACT_BIAS_CORRECT, 0) + 1
    return counts


def count(step_actions: Iterable[str | None], events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Counts per action (zeros included) from a run's step decisions and event rows."""
    out = zero()
    for a in step_actions:
        tally(out, a)
    evs = list(events)
    tally(out, None, evs)
    if not out[schema.ACT_BIAS_CORRECT]:  # a run recorded before issue #28: corrections as events
        out[schema.ACT_BIAS_CORRECT] = len(old_correction_steps(evs))
    return out


def old_correction_steps(events: Iterable[Any]) -> set[Any]:
    """The distinct steps of bias_correct action events (how pre-#28 runs recorded corrections)."""
    out = set()
    for ev in events:
        kind, action = _kind_action(ev)
        if kind == schema.EV_ACTION and action == schema.ACT_BIAS_CORRECT:
            out.add(ev.get("step") if isinstance(ev, Mapping) else ev.step)
    return out


def total(counts: Mapping[str, int]) -> int:
    return sum(int(counts.get(a, 0)) for a in GUARD_ACTIONS)


def summary_text(counts: Mapping[str, int]) -> str:
    """'skip 2, bias_correct 1' (in GUARD_ACTIONS order), or 'none'."""
    return ", ".join(f"{a} {counts[a]}" for a in GUARD_ACTIONS if counts.get(a)) or "none"
