"""What counts as a guard action, defined once and counted the same way everywhere.

A guard action is something the guard did that changed training (issue #17: the CLI said
"skip 2", the app 3, and Prometheus 0 skips for the same run):

  * every step whose decision (`steps.action`, `StepReport.action`) is not apply/none:
    skip, rollback, halt. One per step: the step's row is the record of what happened to
    that update (a rollback that found no snapshot and skipped counts as the skip it was);
  * every correction the policy started alongside a step: an `action` event whose action is
    bias_correct (a collapsing layer's bias or aux-loss boost starts) or lr_cooldown (after a
    rollback). Their step applied its update, so the step table does not show them.

Not actions: verdict events (evidence; their `action` field repeats what their step did),
`recovered` events (a correction ended), rollback and halt events (they describe the step's
own action, already counted once by its row), checkpoints, injections.

Readers: the CLI summary, meta.json `guard_actions`, the app (dashboards/data/loaders.py), the
collector's moeguard_guard_actions_total{action} (guard/collector/metrics.py) and `moeguard demo`.
The collector counts what it receives, so a trainer resumed from a checkpoint re-sends the
steps after it and the counter counts them again (Prometheus counters are for rates).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from guard.core import schema

STEP_ACTIONS = (schema.ACT_SKIP, schema.ACT_ROLLBACK, schema.ACT_HALT)  # one per step row
EVENT_ACTIONS = (schema.ACT_BIAS_CORRECT, schema.ACT_LR_COOLDOWN)  # one per `action` event
GUARD_ACTIONS = (*STEP_ACTIONS, *EVENT_ACTIONS)


def is_step_action(action: str | None) -> bool:
    """A step decision that counts (not apply, not none)."""
    return action in STEP_ACTIONS


def is_event_action(kind: str | None, action: str | None) -> bool:
    """An event that counts: a correction the policy started."""
    return kind == schema.EV_ACTION and action in EVENT_ACTIONS


def zero() -> dict[str, int]:
    return dict.fromkeys(GUARD_ACTIONS, 0)


def tally(counts: dict[str, int], step_action: str | None, events: Iterable[Any] = ()) -> dict[str, int]:
    """Add one step: its decision and its events (Event objects or event rows). Returns counts."""
    if is_step_action(step_action):
        counts[step_action] = counts.get(step_action, 0) + 1  # type: ignore[index]
    for ev in events:
        kind, action = (ev.get("kind"), ev.get("action")) if isinstance(ev, Mapping) else (ev.kind, ev.action)
        if is_event_action(kind, action):
            counts[action] = counts.get(action, 0) + 1
    return counts


def count(step_actions: Iterable[str | None], events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Counts per action (zeros included) from a run's step decisions and event rows."""
    out = zero()
    for a in step_actions:
        tally(out, a)
    tally(out, None, events)
    return out


def total(counts: Mapping[str, int]) -> int:
    return sum(int(counts.get(a, 0)) for a in GUARD_ACTIONS)


def summary_text(counts: Mapping[str, int]) -> str:
    """'skip 2, bias_correct 1' (in GUARD_ACTIONS order), or 'none'."""
    return ", ".join(f"{a} {counts[a]}" for a in GUARD_ACTIONS if counts.get(a)) or "none"
