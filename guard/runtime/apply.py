"""The one place a Decision is applied to a torch model and optimizer.

Used by the trainer (trainer/loop.py) and by GuardedStep (guard/api.py), so both honour a
decision the same way:

    apply       clip the gradients to `grad_clip`, step with the LR cooled by `lr_scale`, then
                put back the exact planned LR (no drift from multiplying back and forth)
    clip        a finite grad-norm spike (PolicyConfig.clip_spikes): when the run's own
                `grad_clip` brings it under the detector's threshold (`grad_scale` x the norm), the
                update is the unguarded one: the step becomes an apply (its verdicts stay, action
                none), no guard action. When it does not (no grad clip, or a looser one) the step
                is skipped: a gradient clipped to the threshold, a far-tail line several times the
                level, still lands large in Adam's moments (docs/escalation.md: without a grad
                clip, x50 clipped to the threshold ended -0.4 .. +5.1% over the clean run, once
                worse than no guard, where the skip ended -1.2 .. +0.5%)
    skip, halt  nothing touches weights or optimizer state (NaN included)
    rollback    the guard restores its newest snapshot before the incident (model, optimizer,
                the caller's extra); the caller skips the data window (`skip_batches`)
    correction  the collapse boosts go to the model's corrector (guard/runtime/routing.py's
                Corrector protocol), told whether the update was applied
Gradients are zeroed at the end whatever was decided.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from guard.core import schema
from guard.core.policy import Decision, resolve_clip
from guard.runtime.guard import Guard
from guard.runtime.routing import Corrector


@dataclass(slots=True)
class Applied:
    updated: bool  # optimizer.step() ran
    restored_step: int | None = None  # the snapshot a rollback restored
    restored_extra: dict[str, Any] = field(default_factory=dict)  # what the caller stored with it


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class DecisionApplier:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        guard: Guard,
        *,
        grad_clip: float = 0.0,
        corrector: Corrector | None = None,
        after_step: Callable[[bool], None] | None = None,
    ) -> None:
        """`after_step(updated)`: called once per step after everything else (an adapter's hook,
        e.g. torchtitan zeroing counters an optimizer pre-hook would have zeroed)."""
        self.optimizer = optimizer
        self.guard = guard
        self.grad_clip = grad_clip
        self.corrector = corrector
        self.after_step = after_step

    def apply(
        self,
        d: Decision,
        *,
        grad_norm: float,
        loads_ME: torch.Tensor | None = None,
        lr: float | None = None,
    ) -> Applied:
        """Apply `d`. `grad_norm`: the step's total gradient norm (for clipping); `loads_ME`: the
        reduced per-expert loads (for the corrector); `lr`: the LR every parameter group should
        get this step (the caller's schedule), or None to keep the groups' own (a user's scheduler)."""
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        resolve_clip(d, grad_norm, self.grad_clip)
        out = Applied(updated=d.applies_update)
        if out.updated:
            self._update(grad_norm, d.lr_scale)
        if d.action == schema.ACT_ROLLBACK:
            out.restored_step, out.restored_extra = self.guard.rollback(d)
        if self.corrector is not None:
            # After a rollback: a correction that lives in a model buffer (a selection bias,
            # moeguard's aux-loss weight) would otherwise be overwritten by the snapshot at once,
            # while the events say it was applied.
            self.corrector.correct({**d.bias_boost, **d.aux_boost}, loads_ME, out.updated)
        if self.after_step is not None:
            self.after_step(out.updated)
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def _update(self, grad_norm: float, lr_scale: float) -> None:
        """Clip to `grad_clip`, step with the cooled LR, then put back the exact planned LR."""
        groups = self.optimizer.param_groups
        target = min(grad_norm, self.grad_clip) if self.grad_clip > 0 else grad_norm
        if math.isfinite(grad_norm) and target < grad_norm:
            grads = [_local(p.grad) for g in groups for p in g["params"] if p.grad is not None]
            torch._foreach_mul_(grads, target / (grad_norm + 1e-6))
        planned = [g["lr"] for g in groups]
        if lr_scale != 1.0:
            for g, lr in zip(groups, planned, strict=True):
                g["lr"] = lr * lr_scale
        try:
            self.optimizer.step()
        finally:
            if lr_scale != 1.0:
                for g, lr in zip(groups, planned, strict=True):
                    g["lr"] = lr
