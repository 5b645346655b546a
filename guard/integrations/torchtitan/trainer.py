"""GuardedTrainer: torchtitan's own Trainer with moeguard deciding each optimizer step.

Nothing of torchtitan's train_step is copied. What changes:
  * `self.optimizers` as train_step sees it: its step() is GuardedStep.step, which steps the real
    container (its pre-hooks, the expert-bias update, included) only when the guard allows it;
  * the gradient clip moves into the guard's step (same max_norm, applied after the decision;
    `training.max_norm` becomes inf): the guard must see unclipped norms;
  * batch_generator times each batch (the step's data wait, the `data` phase in heartbeats) and
    drops the data window a rollback asks to skip;
  * the checkpointer carries the guard's state (torchtitan's Stateful protocol, key "moeguard"),
    so a resume keeps every baseline; a save beats in the `checkpoint` phase and is an event;
    torchtitan's validation beats in the `eval` phase, and the loss it logs
    (`metrics_processor.log_validation`) lands in the run store's `evals` table as `eval_loss`;
  * a halt stops the loop after a full checkpoint; a non-finite loss the guard skipped does not
    crash the run (torchtitan raises on one at its log steps);
  * GuardedStep streams to the collector (every rank), MFU from torchtitan's own
    `get_nparams_and_flops`, and the run store on rank 0.
"""

from __future__ import annotations

import io
import math
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from guard.core import schema
from guard.core.heartbeat import PHASE_CHECKPOINT, PHASE_DATA, PHASE_EVAL, PHASE_TRAIN
from guard.integrations.torchtitan.adapter import OptimizersView, attach, force_collapse

STATE_KEY = "moeguard"  # the guard's entry in torchtitan's checkpoint


class GuardState:
    """GuardedStep's state as one picklable blob: DCP saves a non-tensor value as bytes and hands
    it back whole on load, whatever it holds (deques, numpy arrays). Every rank's guard state is
    the same (same inputs, same decisions, checked every step), so one copy serves all ranks."""

    def __init__(self, guarded: Any) -> None:
        self.guarded = guarded

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.guarded.state_dict(), buf)
        return {"blob": buf.getvalue()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        blob = sd["blob"]
        raw = blob.getvalue() if isinstance(blob, io.BytesIO) else bytes(blob)
        state = torch.load(io.BytesIO(raw), weights_only=False)
        # torchtitan names its checkpoints step-<its step>, one per guarded step from 1
        self.guarded.load_state_dict(state, checkpoint=f"step-{state['step']}")


def default_run_dir(config: Any) -> Path:
    """runs/<model>-<torchrun run id> (the same on every rank and across torchrun restarts), or
    runs/<model>-<rank 0's start time> shared over the process group."""
    name = f"tt-{getattr(config.model_spec, 'name', 'model')}"
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if job and job != "none":
        return Path("runs") / f"{name}-{job}"
    box = [f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    return Path("runs") / box[0]


def _compute_dtype(config: Any, model: torch.nn.Module) -> torch.dtype | None:
    """The dtype torchtitan computes in on an accelerator: training.mixed_precision_param (FSDP's
    param dtype, or AMP's autocast without FSDP), for meta.json's env dtype; None on a CPU, where
    the parameters' dtype is what runs."""
    p = next(model.parameters(), None)
    want = getattr(getattr(config, "training", None), "mixed_precision_param", None)
    if p is None or p.device.type == "cpu" or want != "bfloat16":
        return None
    return torch.bfloat16


def _drillable(att: Any, parts: list[torch.nn.Module]) -> Any:
    """The attachment, able to force a collapse for `inject collapse@S:LAYER` (guard/runtime/inject.py)."""
    att.force_collapse = lambda layer: force_collapse(parts, layer)
    return att


def guarded_trainer() -> type:
    from torchtitan.trainer import Trainer

    from guard.api import GuardedStep

    class GuardedTrainer(Trainer):
        """torchtitan's Trainer, guarded (module docstring). One pipeline stage."""

        def __init__(
            self,
            config: Any,
            *,
            guard_config: Any = None,
            run_dir: str | Path | None = None,
            collector: str | None = None,
            inject: list[str] | None = None,
            tags: list[str] | None = None,
        ) -> None:
            """`inject`: drills (guard/core/inject.py specs; None: $MOEGUARD_INJECT); `tags`: meta.json
            "tags" (guard/core/tags.py)."""
            super().__init__(config)
            if len(self.model_parts) != 1:
                raise NotImplementedError(
                    "GuardedTrainer: pipeline parallelism (several parts) is not supported"
                )
            clip, config.training.max_norm = float(config.training.max_norm), math.inf
            view = OptimizersView(self.optimizers, set_to_none=config.training.disable_cuda_graphs)
            self.guarded = GuardedStep(
                self.model_parts[0],
                view,  # type: ignore[arg-type]
                attach=_drillable(attach(self.model_parts), self.model_parts),
                run_dir=run_dir if run_dir is not None else default_run_dir(config),
                config=guard_config,
                grad_clip=max(clip, 0.0),
                collector=collector,
                flops_per_token=float(self.metrics_processor.num_flops_per_token),
                inject=inject,
                tags=tags,
                autocast=_compute_dtype(config, self.model_parts[0]),
            )
            # torchtitan's loss is a local sum / the GLOBAL token count; the guard wants local means
            pd = self.parallel_dims
            self._dp = pd.get_mesh("batch").size() if pd.dp_enabled else 1
            self._loss: torch.Tensor | None = None
            self._tokens = 0
            self.guard_decision: Any = None
            self.halted = False
            self.guarded_steps = 0  # in this process (0 after a relaunch that had nothing to train)
            self.optimizers = _Steps(self, self.optimizers)  # type: ignore[assignment]
            if self.checkpointer.enable:
                self.checkpointer.states[STATE_KEY] = GuardState(self.guarded)
                self._save = self.checkpointer.save
                self.checkpointer.save = self._guarded_save  # type: ignore[method-assign]
            if config.validator.enable:
                self._validate = self.validator.validate
                self.validator.validate = self._guarded_validate  # type: ignore[method-assign]
                # the validator's one report of its loss (all-reduced: the same on every rank)
                mp = self.validator.metrics_processor
                self._log_validation = mp.log_validation
                mp.log_validation = self._guarded_log_validation

        # ---- the step ----------------------------------------------------------------------
        def batch_generator(
            self, data_iterable: Iterable[tuple[dict[str, torch.Tensor], torch.Tensor]]
        ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            it = super().batch_generator(data_iterable)
            per_step = self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches
            session = self.guarded.session
            while True:
                session.phase(PHASE_DATA)
                t0 = time.perf_counter()
                try:
                    if self.guarded.pending_skip > 0:  # the data window a rollback skips
                        for _ in range(self.guarded.pending_skip * per_step):
                            next(it)
                        self.guarded.pending_skip = 0
                    batch = next(it)
                finally:
                    session.phase(PHASE_TRAIN)
                self.guarded.note_data_wait(time.perf_counter() - t0)
                yield batch

        def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
            loss = super().forward_backward_step(**kwargs)
            part = loss.detach() * self._dp  # a copy: a CUDA-graph replay may overwrite `loss`
            self._loss = part if self._loss is None else self._loss + part
            self._tokens += int(kwargs["labels"].numel())
            return loss

        def guarded_step(self) -> None:
            assert self._loss is not None, "optimizer step without a forward/backward"
            # this rank's tokens; GuardedStep sums them over the ranks
            self.guard_decision = self.guarded.step(self._loss, tokens=self._tokens)
            self.guarded_steps += 1
            self._loss, self._tokens = None, 0
            self.halted = self.halted or self.guard_decision.halt

        def train_step(self, data_iterator: Any) -> None:
            try:
                super().train_step(data_iterator)
            except RuntimeError as e:
                # torchtitan raises on a non-finite loss at its log steps, after the optimizer step.
                # The guard skipped that update (weights and optimizer state untouched): go on.
                d = self.guard_decision
                if "not finite" not in str(e) or d is None or d.applies_update:
                    raise

        def should_continue_training(self) -> bool:
            return not self.halted and super().should_continue_training()

        # ---- checkpoints -------------------------------------------------------------------
        def _guarded_save(self, curr_step: int, last_step: bool = False) -> bool:
            """torchtitan's save, in the checkpoint phase; a halt forces a full save."""
            ckpt, interval = self.checkpointer, self.checkpointer.interval
            if self.halted:
                ckpt.interval = 1  # a full save now (last_step may save the model only)
            try:
                if not ckpt._should_save(curr_step, last_step):
                    return False
                t0 = time.perf_counter()
                self.guarded.session.phase(PHASE_CHECKPOINT, beat=True)
                self.guarded.session.checkpoint_starts()
                saved = self._save(curr_step, last_step)
                self.guarded.goodput.add("checkpoint_s", time.perf_counter() - t0)
                path = Path(ckpt.folder) / f"step-{curr_step}"
                self.guarded.session.checkpoint_saved(
                    self.guarded.step_idx, path, lambda: self.guarded.goodput.report(time.time())
                )
                self.guarded.restart_clock()  # the save is not the next step's time
                return saved
            finally:
                ckpt.interval = interval

        def _guarded_validate(self, *args: Any, **kwargs: Any) -> Any:
            """torchtitan's validation, in the eval phase (a long eval is not a hang); its time is
            not the next step's."""
            self.guarded.session.phase(PHASE_EVAL, beat=True)
            try:
                return self._validate(*args, **kwargs)
            finally:
                self.guarded.session.phase(PHASE_TRAIN, beat=True)
                self.guarded.restart_clock()

        def _guarded_log_validation(
            self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None
        ) -> None:
            """The validation loss goes to the evals table at the last guarded step (0-based, as
            MoEGuardCallback files the Trainer's eval_loss), numeric extra metrics beside it."""
            extra = {
                k: float(v)
                for k, v in (extra_metrics or {}).items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
            if self.guarded.step_idx > 0:  # an evaluation before any step has no step to sit at
                self.guarded.log(**{**extra, "eval_loss": float(loss)})
            self._log_validation(loss=loss, step=step, extra_metrics=extra_metrics)

        def close(self) -> None:
            self.guarded.close(*self._ending())
            super().close()

        def _ending(self) -> tuple[str | None, str]:
            """A halt ends the run as halted; anything else as GuardedStep reads the exit."""
            if not self.halted:
                return None, ""
            why = next(
                (
                    str(e.detail.get("reason", ""))
                    for e in self.guard_decision.events
                    if e.kind == schema.EV_HALT
                ),
                "an operator command",
            )
            return (
                schema.STATUS_HALTED,
                f"halted at step {self.guarded.step_idx - 1}: {why}; the checkpoint of torchtitan step "
                f"{self.step} resumes it",
            )

    class _Steps:
        """`trainer.optimizers` inside train_step: step() is the guard's, the rest the container's."""

        def __init__(self, trainer: GuardedTrainer, container: Any) -> None:
            self.trainer, self.container = trainer, container

        def step(self) -> None:
            self.trainer.guarded_step()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.container, name)

    return GuardedTrainer
