"""LR bound: the learning rate about to be applied must not exceed the schedule's bound.

LR spikes come from scheduler and resume bugs (a warm-up restarted, a factor applied twice),
and they do their damage through the update, not the gradient: no gradient or loss statistic
sees one before it lands. The LR is known on the host before `optimizer.step()`, so checking it
against the configured peak catches it at the step it happens, at zero cost.
"""

from __future__ import annotations

import math

from guard.core import schema
from guard.core.events import Verdict


class LRBoundDetector:
    def __init__(self, max_lr: float, tolerance: float = 1e-3) -> None:
        self.max_lr = max_lr
        self.tolerance = tolerance

    def update(self, lr: float) -> Verdict:
        bound = self.max_lr * (1 + self.tolerance)
        if not math.isfinite(lr) or lr > bound:
            return Verdict(
                detector=schema.DET_LR,
                fired=True,
                value=lr,
                threshold=bound,
                severity="critical",
                evidence={"max_lr": self.max_lr, "ratio": lr / self.max_lr if self.max_lr else math.inf},
            )
        return Verdict.ok(schema.DET_LR)

    def state_dict(self) -> dict[str, float]:
        return {"max_lr": self.max_lr, "tolerance": self.tolerance}

    def load_state_dict(self, d: dict[str, float]) -> None:
        self.max_lr, self.tolerance = d["max_lr"], d["tolerance"]
