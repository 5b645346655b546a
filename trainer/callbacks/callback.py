"""The trainer's hook points, in the OLMo-core style: a callback records, injects or measures at
fixed places in the step; the trainer calls every hook of every callback, in list order, and
knows nothing of what they do.

In step order (trainer/loop.py):

    pre_train()                     once, when run() starts
    pre_step(step)                  first thing in a step
    pre_load_batch(step)            before the step's micro-batches are read
    post_load_batch(step, batches)  the step's host batches; a callback may replace them in place
    post_backward(step)             this rank's gradients, before the cross-rank reduction
    adjust_lr(step, lr) -> lr       the LR the guard checks and the optimizer uses (guarded step)
    pre_record(step, events)        the step's events, before they are printed, counted and recorded
                                    (guarded step); a callback may add its own
    post_step(step, report)         last thing in a step
    close()                         when run() ends, however it ends

and, outside the step, meta() (fields for meta.json) and state_dict() / load_state_dict() (kept
in the checkpoint's host state, so a callback survives a resume).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from guard.core.events import Event
from guard.core.report import StepReport

if TYPE_CHECKING:
    from trainer.view import TrainerView


class Callback:
    name = "callback"  # the key of its state in the checkpoint; unique per trainer
    trainer: TrainerView  # set by Callbacks before the first hook runs

    def pre_train(self) -> None:
        """Runs once, when the training loop starts."""

    def pre_step(self, step: int) -> None:
        """Runs first in a step (its clock has started)."""

    def pre_load_batch(self, step: int) -> None:
        """Runs right before the step's micro-batches are read from the data loader."""

    def post_load_batch(self, step: int, batches: list[torch.Tensor]) -> None:
        """Runs with the step's host batches; replace items of `batches` to change what is trained on."""

    def post_backward(self, step: int) -> None:
        """Runs after forward/backward, before gradients are reduced across ranks."""

    def adjust_lr(self, step: int, lr: float) -> float:
        """Returns the LR planned for this step (the schedule's, or a previous callback's)."""
        return lr

    def pre_record(self, step: int, events: list[Event]) -> None:
        """Runs with the step's events before they are printed, counted and recorded."""

    def post_step(self, step: int, report: StepReport) -> None:
        """Runs last in a step, with its report."""

    def close(self) -> None:
        """Runs when the training loop ends, even on an error."""

    def meta(self) -> dict[str, Any]:
        """Fields this callback adds to the run's meta.json."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this callback."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what state_dict() returned."""


class Callbacks:
    """The trainer's callbacks, each hook called on every one in order."""

    def __init__(self, trainer: TrainerView, callbacks: list[Callback]) -> None:
        names = [cb.name for cb in callbacks]
        if len(set(names)) != len(names):
            raise ValueError(f"callback names must be unique (their checkpoint keys): {names}")
        for cb in callbacks:
            cb.trainer = trainer
        self.items = list(callbacks)

    def pre_train(self) -> None:
        for cb in self.items:
            cb.pre_train()

    def pre_step(self, step: int) -> None:
        for cb in self.items:
            cb.pre_step(step)

    def pre_load_batch(self, step: int) -> None:
        for cb in self.items:
            cb.pre_load_batch(step)

    def post_load_batch(self, step: int, batches: list[torch.Tensor]) -> None:
        for cb in self.items:
            cb.post_load_batch(step, batches)

    def post_backward(self, step: int) -> None:
        for cb in self.items:
            cb.post_backward(step)

    def adjust_lr(self, step: int, lr: float) -> float:
        for cb in self.items:
            lr = cb.adjust_lr(step, lr)
        return lr

    def pre_record(self, step: int, events: list[Event]) -> None:
        for cb in self.items:
            cb.pre_record(step, events)

    def post_step(self, step: int, report: StepReport) -> None:
        for cb in self.items:
            cb.post_step(step, report)

    def close(self) -> None:
        """Every callback's close() runs; the first error is raised after the last one."""
        first: BaseException | None = None
        for cb in self.items:
            try:
                cb.close()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for cb in self.items:
            out.update(cb.meta())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {cb.name: cb.state_dict() for cb in self.items}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for cb in self.items:
            cb.load_state_dict(state.get(cb.name, {}))
