"""The guard's state in a transformers `Trainer`'s checkpoints (MoEGuardCallback's save and resume).

At each save the callback writes GuardedStep.state_dict() (every detector's fit, the policy's skip
window, the corrector's bias-update momentum, the straggler windows, the step counter, the
counts) to `checkpoint-N/moeguard_guard.pt`, next to `optimizer.pt`; a `train(resume_from_checkpoint=
...)` reads it back, so the resumed run keeps every baseline instead of warming up blind.

Why a file of its own, not `TrainerState.stateful_callbacks` (ExportableState): trainer_state.json is
JSON and the guard's state holds numpy arrays, deques and tensors; and transformers restores those
callbacks only under `restore_callback_states_from_checkpoint` (off by default), by building them
anew from their init arguments. The guard's baselines are training state, like the optimizer's
moments: they come back with every resume, with no extra argument.

One file, written by the process that writes trainer_state.json (`args.should_save`), read by every
rank: the guard decides from all-reduced numbers and checks every step that the ranks agreed
(guard/runtime/ranks.py), so every rank's detectors, policy, corrector, straggler scores and
counts are the same; only goodput's wall-clock figures are a rank's own (rank 0's is the one the
run store reports).
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from guard.store.layout import atomic_write_bytes

GUARD_STATE_FILE = "moeguard_guard.pt"  # in each checkpoint-N/ folder of the Trainer


@dataclass(slots=True)
class ResumePoint:
    """Where a resumed train() starts: the checkpoint folder, the Trainer's step, what the guard saved
    there (None: no guard file, the guard starts its baselines afresh at that step)."""

    folder: Path
    step: int
    saved: dict[str, Any] | None


def checkpoint_dir(args: Any, state: Any) -> Path:
    """The folder the Trainer has just saved (`on_save`): <output_dir>/checkpoint-<global step>,
    transformers' own naming (its wandb / mlflow / neptune callbacks find it the same way)."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


def save(guarded: Any, folder: Path) -> Path:
    """Write the guard's state into the checkpoint folder, whole or not at all."""
    buf = io.BytesIO()
    torch.save(guarded.state_dict(), buf)
    path = folder / GUARD_STATE_FILE
    atomic_write_bytes(path, buf.getvalue())
    return path


def resume_point(args: Any, state: Any) -> ResumePoint | None:
    """At `on_train_begin`: the checkpoint this train() resumed from and the guard's state in it, or
    None for a fresh start (the Trainer's state starts at step 0 unless it was loaded from a
    checkpoint). A checkpoint without the guard's file warns, naming it, and resumes without it."""
    step = int(state.global_step)
    if step <= 0:
        return None
    folder = _trainer_resume_arg() or checkpoint_dir(args, state)
    path = folder / GUARD_STATE_FILE
    if not path.is_file():
        warnings.warn(
            f"MoEGuardCallback: resuming from {folder} at step {step}, but it has no {GUARD_STATE_FILE} "
            f"({path} not found: saved without MoEGuardCallback, or by an older moeguard); the guard "
            "starts its baselines afresh and warms up again",
            stacklevel=2,
        )
        return ResumePoint(folder, step, None)
    saved = torch.load(path, map_location="cpu", weights_only=False)  # numpy arrays, deques: our own file
    if int(saved.get("step", -1)) != step:
        warnings.warn(
            f"MoEGuardCallback: {path} was saved at guard step {saved.get('step')}, the Trainer resumes at "
            f"step {step}; the guard's baselines are restored and its steps renumbered from {step}",
            stacklevel=2,
        )
        saved = {**saved, "step": step}
    return ResumePoint(folder, step, saved)


def restore(guarded: Any, point: ResumePoint) -> None:
    """Hand the saved state to the GuardedStep just built; either way the run store drops the rows
    after the checkpoint's step, meta.json counts the restart and a resume event names the folder."""
    if point.saved is not None:
        guarded.load_state_dict(point.saved, checkpoint=str(point.folder))
        return
    guarded.step_idx = point.step  # the run store's steps stay the Trainer's
    guarded.session.resumed(
        point.step, str(point.folder), guard_state=f"no {GUARD_STATE_FILE}: started afresh"
    )


def _trainer_resume_arg() -> Path | None:
    """The checkpoint folder the running `Trainer.train()` loaded. transformers hands callbacks no
    such path, so it is read from the training loop's own `resume_from_checkpoint` argument up the
    call stack (`True` is resolved to the last checkpoint's path by then). None when not found (a
    Trainer whose loop names it otherwise): the caller falls back to <output_dir>/checkpoint-<step>."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        local = frame.f_locals
        arg = local.get("resume_from_checkpoint")
        if isinstance(local.get("self"), Trainer) and isinstance(arg, str | os.PathLike):
            return Path(arg)
        frame = frame.f_back
    return None
