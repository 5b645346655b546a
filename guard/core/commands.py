"""Operator commands: a human asks the guard to skip, roll back or halt.

They reach a run from the collector (`POST /v1/runs/{run}/commands`, handed to the trainer in
ingest answers and polled by the exporter) or from a command file a library user points
GuardedStep at; either way they are merged into the step's Decision here, by the engine, so
every loop that uses the guard honours them the same way:

    inbox.offer(source.poll_commands())     # each command id is taken once
    decision = engine.decide(report, lr, command=inbox.next())

Merge rule: the stronger action wins (skip < rollback < halt); a rollback with no snapshot to
roll back to becomes a skip; every command taken up is recorded as an `operator` event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from guard.core import schema
from guard.core.events import Event
from guard.core.policy import Decision

OPERATOR_ACTIONS = (schema.ACT_SKIP, schema.ACT_ROLLBACK, schema.ACT_HALT)  # weakest first
_SEVERITY = {a: i + 1 for i, a in enumerate(OPERATOR_ACTIONS)}


@dataclass(frozen=True, slots=True)
class OperatorCommand:
    id: int  # increasing per run: a command is applied at most once
    action: str  # one of OPERATOR_ACTIONS
    reason: str = ""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OperatorCommand:
        """From the collector's command record ({"id", "action", "reason", ...})."""
        return cls(id=int(d["id"]), action=str(d["action"]), reason=str(d.get("reason") or ""))


class CommandInbox:
    """Commands waiting for their step, oldest first, one per step; the highest id applied is
    kept in `state_dict` so a resumed run does not apply a command twice."""

    def __init__(self) -> None:
        self.waiting: list[OperatorCommand] = []
        self.applied_id = 0

    def offer(self, commands: Iterable[Mapping[str, Any]]) -> None:
        for c in commands:
            if int(c.get("id", 0)) > self.applied_id:
                self.waiting.append(OperatorCommand.from_dict(c))

    def next(self) -> OperatorCommand | None:
        return self.waiting.pop(0) if self.waiting else None

    def state_dict(self) -> dict[str, Any]:
        return {"applied_id": self.applied_id}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.applied_id = int(s.get("applied_id", 0))


def merge_command(d: Decision, cmd: OperatorCommand, *, can_roll_back: bool, skip_batches: int) -> None:
    """Make `cmd` part of this step's decision (the guard's own action wins when it is stronger)
    and record it as an operator event."""
    action, step = cmd.action, d.step
    detail: dict[str, Any] = {"command": action, "id": cmd.id, "reason": cmd.reason, "guard_action": d.action}
    if action == schema.ACT_ROLLBACK and not can_roll_back:
        action, detail["fallback"] = schema.ACT_SKIP, "no snapshot to roll back to; skipped instead"
    if _SEVERITY.get(action, 0) > _SEVERITY.get(d.action, 0):
        d.action = action
        if action == schema.ACT_ROLLBACK:
            d.rollback_before, d.skip_batches = step, skip_batches
            # the rollback records the restored step into this event
            d.events.append(
                Event(
                    step=step,
                    kind=schema.EV_ACTION,
                    action=action,
                    detail={"reason": "operator command", "skip_batches": skip_batches},
                )
            )
    d.events.append(Event(step=step, kind=schema.EV_OPERATOR, action=action, detail=detail))
