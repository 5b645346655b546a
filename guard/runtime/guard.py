"""Guard: the engine plus the snapshot ring, for every training loop that runs in-process.

The caller owns the training step; the guard answers "what should happen to this update?" and
performs the state changes it alone knows how to do (snapshots and rollbacks); the decision is
applied by guard/runtime/apply.py:

    decision = guard.observe(report, lr=planned_lr, command=guard.commands.next())
    applier.apply(decision, grad_norm=...)               # step, skip or roll back
    guard.after_step(step, extra={...})                  # maybe snapshot

The same Engine runs in `moeguard replay` and in the collector.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from guard.core import schema
from guard.core.commands import CommandInbox, OperatorCommand
from guard.core.config import GuardConfig
from guard.core.engine import Engine
from guard.core.policy import Decision, Policy
from guard.core.report import StepReport
from guard.runtime.snapshot import SnapshotRing


class Guard:
    def __init__(
        self,
        cfg: GuardConfig,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        max_lr: float | None = None,
        has_bias: bool = True,
        correction: str | None = None,
        snapshot_device: torch.device | str | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine = Engine(cfg, max_lr=max_lr, has_bias=has_bias, correction=correction)
        self.ring: SnapshotRing | None = None
        if model is not None and optimizer is not None and cfg.acting and cfg.policy.rollback:
            self.ring = SnapshotRing(model, optimizer, cfg.policy.ring_size, device=snapshot_device)

    @property
    def policy(self) -> Policy:
        return self.engine.policy

    @property
    def commands(self) -> CommandInbox:
        """Operator commands waiting for their step (offer them here; `observe` merges one)."""
        return self.engine.commands

    def observe(
        self, report: StepReport, lr: float | None = None, command: OperatorCommand | None = None
    ) -> Decision:
        """Run the engine on this step's statistics (and an operator command) and decide.
        Pure host-side work; a rollback with no snapshot before the incident becomes a skip."""
        return self.engine.decide(report, lr, command=command, snapshot_before=self.snapshot_before)

    def snapshot_before(self, step: int) -> int | None:
        """The newest snapshot held before `step`, or None (none held, or no ring)."""
        held = [s for s in self.ring.steps() if s < step] if self.ring is not None else []
        return held[-1] if held else None

    def _snapshot_before(self, d: Decision) -> int | None:
        return self.snapshot_before(d.rollback_before if d.rollback_before is not None else d.step)

    def rollback(self, d: Decision) -> tuple[int, dict[str, Any]]:
        """Restore the newest snapshot taken before the incident. Returns (its step, its extra)."""
        assert self.ring is not None
        target = self._snapshot_before(d)
        if target is None:
            raise RuntimeError("rollback requested but no snapshot precedes the incident")
        back = list(reversed(self.ring.steps())).index(target)
        step, extra = self.ring.restore(back)
        self.ring.drop_newer_than(step)
        for ev in d.events:
            if ev.action == schema.ACT_ROLLBACK and ev.kind == schema.EV_ACTION:
                ev.detail["restored_step"] = step
        return step, extra

    def after_step(self, step: int, extra: dict[str, Any] | None = None) -> bool:
        """Take a snapshot every `snapshot_every` steps. Returns True if one was taken.

        Snapshots are taken during incidents too (a flagged step changes no state, so a snapshot
        after it is as good as one before), which bounds what a rollback loses: it restores the
        newest snapshot before the incident's first flagged step, at most `snapshot_every` steps
        before it. The one thing a snapshot must not do is evict that target while the incident
        is open: then it waits until the incident closes."""
        if self.ring is None or step % self.cfg.policy.snapshot_every != 0:
            return False
        anchor = self.policy.incident_anchor()
        if anchor is not None and self.ring.evicts_next() is not None:
            held_before = [s for s in self.ring.steps() if s < anchor]
            if held_before and self.ring.evicts_next() == held_before[-1]:
                return False
        self.ring.take(step, extra)
        return True

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.engine.load_state_dict(s)
