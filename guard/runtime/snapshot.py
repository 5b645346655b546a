"""In-memory ring of training-state snapshots for cheap, exact rollback.

A snapshot is a copy of every model tensor (parameters and buffers, e.g. expert biases) and
every optimizer state tensor, plus a small dict of scalars the caller owns (optimizer step,
LR-schedule position). Slots are allocated once and reused, and copies go through one
`torch._foreach_copy_` call, so taking a snapshot costs a memcpy of the state, not an
allocation. Works for any nn.Module and any torch optimizer whose state is tensors/scalars.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def _foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if not dst:
        return
    try:
        torch._foreach_copy_(dst, src)
    except (AttributeError, RuntimeError):  # older torch or mixed devices
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


@dataclass(slots=True)
class _Slot:
    step: int = -1
    model: list[torch.Tensor] = field(default_factory=list)
    # per optimizer param index: {state key: tensor or python scalar}
    opt: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class SnapshotRing:
    """Keep the last `size` snapshots of (model, optimizer, extra)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        size: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.size = size
        self.device = device  # None: keep snapshots on the training device
        self._slots: list[_Slot] = [_Slot() for _ in range(size)]
        self._next = 0
        self._count = 0
        self._model_tensors = self._live_model_tensors()
        self._params = [p for g in optimizer.param_groups for p in g["params"]]

    def _live_model_tensors(self) -> list[torch.Tensor]:
        # state_dict(keep_vars) would include non-persistent buffers only partially; walk both.
        # detach(), not .data: a detached tensor shares the parameter's version counter, so a
        # restore is visible to whoever watches the weights for writes (the precursor sampler).
        ts = [p.detach() for p in self.model.parameters()]
        ts += [b for b in self.model.buffers()]
        return ts

    def __len__(self) -> int:
        return self._count

    def steps(self) -> list[int]:
        """Steps held, oldest first."""
        order = [(self._next + i) % self.size for i in range(self.size)]
        return [self._slots[i].step for i in order if self._slots[i].step >= 0]

    def take(self, step: int, extra: dict[str, Any] | None = None) -> None:
        slot = self._slots[self._next]
        if len(slot.model) != len(self._model_tensors):
            slot.model = [torch.empty_like(t, device=self.device or t.device) for t in self._model_tensors]
        _foreach_copy(slot.model, self._model_tensors)
        self._take_optimizer(slot)
        slot.step = step
        slot.extra = copy.deepcopy(extra or {})
        self._next = (self._next + 1) % self.size
        self._count = min(self._count + 1, self.size)

    def _take_optimizer(self, slot: _Slot) -> None:
        if len(slot.opt) != len(self._params):
            slot.opt = [{} for _ in self._params]
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for i, p in enumerate(self._params):
            live = self.optimizer.state.get(p, {})
            held = slot.opt[i]
            for k in list(held):
                if k not in live:
                    del held[k]
            for k, v in live.items():
                if torch.is_tensor(v):
                    h = held.get(k)
                    if not (torch.is_tensor(h) and h.shape == v.shape and h.dtype == v.dtype):
                        h = held[k] = torch.empty_like(v, device=self.device or v.device)
                    dst.append(h)
                    src.append(v)
                else:
                    held[k] = copy.deepcopy(v)
        _foreach_copy(dst, src)

    def evicts_next(self) -> int | None:
        """The step of the snapshot the next `take` overwrites (None while a slot is free)."""
        slot = self._slots[self._next]
        return slot.step if slot.step >= 0 else None

    def latest_step(self) -> int | None:
        if not self._count:
            return None
        return self._slots[(self._next - 1) % self.size].step

    def restore(self, back: int = 0) -> tuple[int, dict[str, Any]]:
        """Restore the snapshot `back` places before the newest (0 = newest).

        Returns (step, extra). Model tensors and optimizer state are overwritten in place, so
        references the training loop holds (optimizer param groups, compiled graphs) stay valid.
        """
        if back >= self._count:
            raise IndexError(f"only {self._count} snapshot(s) held; cannot go back {back}")
        slot = self._slots[(self._next - 1 - back) % self.size]
        _foreach_copy(self._model_tensors, slot.model)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for i, p in enumerate(self._params):
            held = slot.opt[i] if i < len(slot.opt) else {}
            if not held:
                self.optimizer.state.pop(p, None)
                continue
            live = self.optimizer.state.setdefault(p, {})
            for k in list(live):
                if k not in held:
                    del live[k]
            for k, v in held.items():
                if torch.is_tensor(v):
                    cur = live.get(k)
                    if torch.is_tensor(cur) and cur.shape == v.shape and cur.dtype == v.dtype:
                        dst.append(cur)
                        src.append(v)
                    else:
                        live[k] = v.clone().to(p.device) if v.device != p.device else v.clone()
                else:
                    live[k] = copy.deepcopy(v)
        _foreach_copy(dst, src)
        return slot.step, copy.deepcopy(slot.extra)

    def drop_newer_than(self, step: int) -> None:
        """Forget snapshots taken after `step` (they hold the state we just rolled away from)."""
        for s in self._slots:
            if s.step > step:
                s.step = -1
        self._count = sum(1 for s in self._slots if s.step >= 0)
        # Keep _next pointing after the newest valid slot so the ring order stays oldest->newest.
        order = [(self._next + i) % self.size for i in range(self.size)]
        valid = [i for i in order if self._slots[i].step >= 0]
        self._next = (valid[-1] + 1) % self.size if valid else 0
