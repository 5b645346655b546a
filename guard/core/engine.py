"""The engine: detectors + LR bound + policy (+ operator commands) -> one Decision per step.

Pure (no torch, no I/O), and the only place the pipeline is assembled: the in-process guard
(guard/runtime/guard.py, used by the trainer and GuardedStep), `moeguard replay` and the
collector's server-side detectors all call it, so a threshold means the same thing everywhere.

    engine = Engine(cfg, max_lr=3e-4)
    decision = engine.decide(report, lr=planned_lr, command=engine.commands.next(),
                             snapshot_before=ring_lookup)   # the runtime applies the decision
    verdicts = engine.verdicts(report)                       # detectors only (the collector)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from guard.core import schema
from guard.core.commands import CommandInbox, OperatorCommand, merge_command
from guard.core.config import GuardConfig
from guard.core.detectors.suite import DetectorSuite
from guard.core.events import Verdict
from guard.core.lrbound import LRBoundDetector
from guard.core.policy import Decision, Policy
from guard.core.report import StepReport

# step -> the newest snapshot held before that step, or None: what a rollback could restore
SnapshotLookup = Callable[[int], int | None]


class Engine:
    def __init__(
        self,
        cfg: GuardConfig,
        *,
        max_lr: float | None = None,
        has_bias: bool = True,
        correction: str | None = None,
    ) -> None:
        """`max_lr`: the schedule's peak LR (None: no LR bound); `has_bias`/`correction`: how a
        collapse can be corrected on this model (see Policy)."""
        self.cfg = cfg
        self.detectors = DetectorSuite(cfg)
        self.lr_bound = LRBoundDetector(max_lr) if max_lr else None
        self.policy = Policy(cfg, has_bias=has_bias, correction=correction)
        self.commands = CommandInbox()
        # steps whose rollback found no snapshot and was applied as a skip (the policy still counts
        # them as its rollbacks; a halt's reason says which were skips, as the counts do)
        self.fell_back: list[int] = []

    def verdicts(self, report: StepReport, lr: float | None = None) -> list[Verdict]:
        """Every fired verdict for this step (detectors, then the LR bound); updates their state."""
        out = self.detectors.update(report)
        if self.lr_bound is not None and lr is not None:
            v = self.lr_bound.update(lr)
            if v.fired:
                out.append(v)
        return out

    def decide(
        self,
        report: StepReport,
        lr: float | None = None,
        *,
        command: OperatorCommand | None = None,
        snapshot_before: SnapshotLookup | None = None,
    ) -> Decision:
        """This step's Decision. `lr`: the LR about to be applied; `command`: an operator command
        to merge; `snapshot_before`: what a rollback could restore (None: do not check, as in
        replay, which asks what the policy would do)."""
        d = self.policy.decide(report.step, self.verdicts(report, lr), healthy=self.detectors.healthy)
        if snapshot_before is not None and d.action == schema.ACT_ROLLBACK:
            before = d.rollback_before if d.rollback_before is not None else d.step
            if snapshot_before(before) is None:
                _skip_instead(d)
                self.fell_back = [*self.fell_back[-63:], d.step]
        if d.action == schema.ACT_HALT:
            self._say_which_were_skips(d)
        if command is not None:
            self.commands.applied_id = max(self.commands.applied_id, command.id)
            can_roll_back = snapshot_before is None or snapshot_before(report.step) is not None
            merge_command(
                d, command, can_roll_back=can_roll_back, skip_batches=self.cfg.policy.rollback_skip_batches
            )
        return d

    def _say_which_were_skips(self, d: Decision) -> None:
        """A halt whose reason lists rollbacks that found no snapshot: say they were applied as
        skips (meta.json counts them as skips, issue #37: "rollback 0" beside "4 rollbacks")."""
        for ev in d.events:
            if ev.kind != schema.EV_HALT:
                continue
            listed = [int(s) for s in ev.detail.get("rollbacks", [])]
            skipped = [s for s in listed if s in self.fell_back]
            if skipped:
                ev.detail["rollbacks_applied_as_skips"] = skipped
                ev.detail["reason"] = (
                    f"{ev.detail.get('reason', '')}; {len(skipped)} of those {len(listed)} rollback(s) "
                    "found no snapshot and were applied as skips"
                )

    def state_dict(self) -> dict[str, Any]:
        return {
            "detectors": self.detectors.state_dict(),
            "policy": self.policy.state_dict(),
            "commands": self.commands.state_dict(),
            "fell_back": list(self.fell_back),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.detectors.load_state_dict(s["detectors"])
        self.policy.load_state_dict(s["policy"])
        if "commands" in s:  # absent from a checkpoint written before the engine kept them
            self.commands.load_state_dict(s["commands"])
        self.fell_back = [int(x) for x in s.get("fell_back", [])]


def _skip_instead(d: Decision) -> None:
    """Nothing to roll back to (too early in the run): skipping is the safe fallback."""
    d.action = schema.ACT_SKIP
    for ev in d.events:
        if ev.action == schema.ACT_ROLLBACK:
            ev.detail["fallback"] = "no snapshot before the incident; skipped instead"
