"""Guard: detectors + policy + snapshot ring, the engine every training loop shares.

The caller owns the training step; the guard only answers "what should happen to this update?"
and performs the state changes it alone knows how to do (snapshots and rollbacks):

    decision = guard.observe(report, lr=planned_lr)      # before optimizer.step()
    if decision.applies_update: optimizer.step()
    elif decision.action == "rollback": guard.rollback(decision)
    guard.after_step(step, extra={...})                  # maybe snapshot

The same DetectorSuite and Policy run in `moeguard replay` and in the collector.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.detectors import DetectorSuite
from guard.core.events import Event
from guard.core.lrbound import LRBoundDetector
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
        self.detectors = DetectorSuite(cfg)
        self.lr_bound = LRBoundDetector(max_lr) if max_lr else None
        self.policy = Policy(cfg, has_bias=has_bias, correction=correction)
        self.ring: SnapshotRing | None = None
        if model is not None and optimizer is not None and cfg.acting and cfg.policy.rollback:
            self.ring = SnapshotRing(model, optimizer, cfg.policy.ring_size, device=snapshot_device)

    def observe(self, report: StepReport, lr: float | None = None) -> Decision:
        """Run every detector on this step's statistics and decide. Pure host-side work."""
        verdicts = self.detectors.update(report)
        if self.lr_bound is not None and lr is not None:
            v = self.lr_bound.update(lr)
            if v.fired:
                verdicts.append(v)
        decision = self.policy.decide(report.step, verdicts, healthy=self._healthy)
        if decision.action == schema.ACT_ROLLBACK and (
            self.ring is None or not self._snapshot_before(decision)
        ):
            # Nothing to roll back to (too early in the run): skipping is the safe fallback.
            decision.action = schema.ACT_SKIP
            for ev in decision.events:
                if ev.action == schema.ACT_ROLLBACK:
                    ev.detail["fallback"] = "no snapshot before the incident; skipped instead"
        return decision

    def _healthy(self, layer: int) -> bool:
        return self.detectors.healthy(layer)

    def _snapshot_before(self, d: Decision) -> int | None:
        assert self.ring is not None
        limit = d.rollback_before if d.rollback_before is not None else d.step
        held = [s for s in self.ring.steps() if s < limit]
        return held[-1] if held else None

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
        return {"detectors": self.detectors.state_dict(), "policy": self.policy.state_dict()}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.detectors.load_state_dict(s["detectors"])
        self.policy.load_state_dict(s["policy"])


def events_of(d: Decision) -> list[Event]:
    return d.events
