"""The transformers `Trainer` guarded in one line: a callback that owns the optimizer step.

    from guard.integrations.hf_trainer import MoEGuardCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[MoEGuardCallback()])
    trainer.train()

Every argument is optional. `run_dir` defaults to $MOEGUARD_RUN_DIR (set by `moeguard canary
--ab --script`), else `<args.output_dir>/moeguard`; `config` is a GuardConfig or a TOML path;
`collector` / `flops_per_token` go to GuardedStep (streaming, heartbeats, MFU) where it takes them.

How it holds the step. A callback cannot veto `optimizer.step()` (transformers 5.23 calls it right
after `on_pre_optimizer_step`), so at `on_train_begin` the callback takes over what the Trainer
handed it:
  - the optimizer: GuardedStep drives the torch optimizer inside accelerate's AcceleratedOptimizer
    from `on_pre_optimizer_step` (after the last micro-batch's backward, gradient accumulation
    honoured: one decision per OPTIMIZER step); the Trainer's own `optimizer.step()` that follows
    becomes a no-op for that step. When the guard did not update, the AcceleratedOptimizer says its
    step was skipped (`step_was_skipped`, as after an fp16 overflow), so the Trainer does not step
    the LR scheduler: a skip or rollback leaves weights, optimizer state and schedule untouched.
  - the clip: `args.max_grad_norm` moves into the guard (same max_norm, applied after the
    decision; the Trainer still logs the unclipped norm) because the guard must see unclipped
    gradients: a clipped 1000x spike looks like an ordinary step. Put back at `on_train_end`.
  - the loss: a forward hook on the model keeps each training micro-batch's `outputs.loss` and
    scales it as the Trainer scales what it back-propagates (normalised by `num_items_in_batch`
    when the model took it, x world size under `average_tokens_across_devices`; else / the
    micro-batches), so the guard's loss per step is the loss the Trainer logs.
A rollback restores the guard's snapshot (model, optimizer state) and puts back the LRs the
schedule had set; the data window after it is skipped as updates (GuardedStep's fallback for a loop
that does not drop batches itself). Collapse correction goes through the model
(guard.integrations.transformers.attach's corrector). A halt stops training
(`control.should_training_stop`). `report_to` and the Trainer's logging are left alone.

Multi-rank (DDP through torchrun): every rank builds its GuardedStep, which decides from the same
all-reduced numbers on every rank, checks that the ranks agree, and writes the run store on rank 0. Not supported (a clear error at train start): fp16 with a GradScaler
(the gradients are scaled; use bf16), DeepSpeed.

Checkpoints (guard/integrations/hf_resume.py): each save writes the guard's state into the
Trainer's `checkpoint-N/` (`moeguard_guard.pt`, after the run store's rows up to N are on disk), and
`trainer.train(resume_from_checkpoint=...)` (a path, or True for the last one) reads it back when
the GuardedStep is built: every baseline, the skip window and the step counter carry on; the run
store drops the rows after N (written again), meta.json counts the restart and a resume event
names the checkpoint. A checkpoint without the file (saved without the callback) warns and resumes
with the guard warming up afresh.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from guard.extras import require

try:
    from transformers import TrainerCallback
except ImportError:  # one line naming the extra (guard/extras.py), not transformers' traceback
    require("transformers", "guard.integrations.hf_trainer (MoEGuardCallback)")
    raise

from guard.api import GuardedStep
from guard.canary.keys import RUN_DIR_ENV
from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.policy import Decision
from guard.integrations import hf_resume
from guard.integrations.base import Attachment


class MoEGuardCallback(TrainerCallback):
    """The guard deciding every optimizer step of a transformers `Trainer` (see the module doc)."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        config: GuardConfig | str | Path | None = None,
        collector: str | None = None,
        *,
        flops_per_token: float | None = None,
        attach: Attachment | None = None,
        max_lr: float | None = None,
        **guarded: Any,
    ) -> None:
        """`attach`: what guard.integrations.transformers.attach(model) returns (default: called on
        the Trainer's model at train start, with its defaults). `max_lr`: the LR bound (default:
        the schedule's base LR, `initial_lr`, the peak of transformers' schedules; a warm-up has
        already set `lr` to 0 at train start). `guarded`: any other GuardedStep keyword
        (dead_window, commands, inject: drills such as "nan@120,collapse@300:2", default
        $MOEGUARD_INJECT; guard/core/inject.py, guard/runtime/inject.py)."""
        self.run_dir, self.config, self.collector = run_dir, config, collector
        self.flops_per_token, self.attach, self.max_lr = flops_per_token, attach, max_lr
        self.extra = guarded
        self.guarded: GuardedStep | None = None
        self.decision: Decision | None = None  # the last step's
        self._reset()

    def _reset(self) -> None:
        self._own_attach: Attachment | None = None
        self._optimizer: Any = None
        self._trainer_step: Any = None
        self._decided = False
        self._hook: Any = None
        self._clip: float | None = None
        self._args: Any = None
        self._losses: list[torch.Tensor] = []
        self._scaled = False
        self._tokens = 0
        self._seq_len = 0
        self._model: Any = None
        self._inner: Any = None
        self._att: Attachment | None = None
        self._resume: hf_resume.ResumePoint | None = None  # read at train start, applied at build
        self._began: float | None = None  # time.time() at train start: step 0's clock starts there
        self._mark = 0.0  # perf_counter at the Trainer's last hook before a save (the save's start)

    # ---- set-up ----------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """Attach to the model, build the GuardedStep, take over the step and the clip."""
        began = time.time()  # the Trainer's own train_runtime starts just before this hook
        model, optimizer = kw.get("model"), kw.get("optimizer")
        if model is None or optimizer is None:
            raise ValueError("MoEGuardCallback: the Trainer handed no model or optimizer at train start")
        if getattr(optimizer, "scaler", None) is not None:
            raise ValueError(
                "MoEGuardCallback: fp16 with a GradScaler is not supported (the guard would see "
                "scaled gradients); train in bf16 or fp32"
            )
        if getattr(args, "deepspeed", None):
            raise ValueError("MoEGuardCallback: DeepSpeed owns the optimizer step; not supported")
        if self._model is not None:  # a second train() call: start afresh
            self._close()
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        att = self.attach
        if att is None:
            from guard.integrations.transformers import attach

            att = self._own_attach = attach(model)
        self._args, self._clip = args, float(args.max_grad_norm or 0.0)
        args.max_grad_norm = 0.0  # the guard clips, after it has seen the unclipped norm
        self._model, self._inner, self._att = model, inner, att
        self._optimizer = optimizer
        self._trainer_step = optimizer.step

        def step(*a: Any, **k: Any) -> Any:
            return self._gated_step(*a, **k)

        # torch's LR scheduler marks the optimizer.step it wrapped and warns when it is replaced:
        # this one still is the optimizer's step as far as the schedule's order is concerned
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = step  # an instance attribute: the Trainer's call lands here
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        self._resume = hf_resume.resume_point(args, state)  # None unless train() resumed a checkpoint
        self._began = began

    def _build(self, args: Any) -> GuardedStep:
        """The GuardedStep, at the first optimizer step: its FLOPs per token (MFU) need the
        sequence length, which only the first batch tells (the routers were hooked at train start,
        so that step's routing is counted)."""
        model, inner = self._model, self._inner
        flops = self.flops_per_token
        if flops is None and self._seq_len:
            flops = _flops(model, self._seq_len)
        g = GuardedStep(
            model,
            inner,
            attach=self._att,
            run_dir=self._run_dir(args),  # GuardedStep: rank 0 writes it, every rank spools there
            config=self.config,
            max_lr=self.max_lr if self.max_lr is not None else _peak_lr(inner),
            grad_clip=max(self._clip or 0.0, 0.0),
            collector=self.collector,
            flops_per_token=flops,
            # built at the first optimizer step: step 0 and the run's wall time start at train
            # start, as every later step runs from the previous step's decision (issue #40)
            started_at=self._began,
            autocast=_autocast(args),
            **self.extra,
        )
        if self._resume is not None:
            hf_resume.restore(g, self._resume)
            self._resume = None
        return g

    def _run_dir(self, args: Any) -> Path:
        if self.run_dir is not None:
            return Path(self.run_dir)
        env = os.environ.get(RUN_DIR_ENV)
        return Path(env) if env else Path(args.output_dir) / "moeguard"

    # ---- each micro-batch --------------------------------------------------------------
    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        """Keep a training forward's loss (detached, on the device: no sync) and its tokens."""
        if not module.training or not torch.is_grad_enabled():
            return  # evaluation, generation
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
        self._scaled = kwargs.get("num_items_in_batch") is not None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            self._tokens += ids.numel()
            self._seq_len = self._seq_len or int(ids.shape[-1])

    def _step_loss(self, args: Any, device: torch.device) -> torch.Tensor:
        """The loss the Trainer back-propagated over this step's micro-batches (see the module doc);
        0 when the model returned none (a compute_loss_func): the grad-norm detectors still run."""
        if not self._losses:
            return torch.zeros((), device=device)
        total = torch.stack([x.float().reshape(()) for x in self._losses]).sum()
        if not self._scaled:
            return total / len(self._losses)
        if getattr(args, "average_tokens_across_devices", False) and args.world_size > 1:
            return total * args.world_size  # the Trainer's compute_loss does the same
        return total

    # ---- the optimizer step ------------------------------------------------------------
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        """The guard decides this optimizer step and applies it (or not) through GuardedStep."""
        if self._model is None:
            return None  # not started by on_train_begin
        if self.guarded is None:
            self.guarded = self._build(args)
        g = self.guarded
        n_micro = max(len(self._losses), 1)
        loss = self._step_loss(args, next(g.model.parameters()).device)
        planned = [gr["lr"] for gr in g.optimizer.param_groups]
        d = g.step(loss, tokens=self._tokens, n_micro=n_micro)  # this rank's tokens
        if d.action == schema.ACT_ROLLBACK:  # the snapshot's param groups carry its old LRs
            for gr, lr in zip(g.optimizer.param_groups, planned, strict=True):
                gr["lr"] = lr
        if hasattr(self._optimizer, "_is_overflow"):
            self._optimizer._is_overflow = not d.applies_update  # no LR-scheduler step on a non-update
        self._losses, self._tokens, self._decided = [], 0, True
        self.decision = d
        if d.halt:
            control.should_training_stop = True
        return control

    def _gated_step(self, *a: Any, **k: Any) -> Any:
        """The Trainer's `optimizer.step()`: a no-op after the guard decided this step."""
        self._optimizer._opt_called = True  # what the LR scheduler's own wrapper records
        if self._decided:
            self._decided = False
            return None
        return self._trainer_step(*a, **k)  # not decided by the guard (e.g. called outside train())

    # ---- checkpoints ---------------------------------------------------------------------
    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """The Trainer's save (if any) starts after this hook, its log and its evaluation."""
        self._mark = time.perf_counter()

    def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._mark = time.perf_counter()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """The Trainer's evaluation metrics (eval_loss, ...) go to the run store's `evals` table at
        the last step taken (its global_step - 1, 0-based as the guard counts); an evaluation before the first optimizer step, or after
        train() ended, has no run to land in."""
        self._mark = time.perf_counter()
        metrics = kw.get("metrics") or {}
        if self.guarded is not None:
            nums = {
                k: float(v)
                for k, v in metrics.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
            self.guarded.log(step=int(state.global_step) - 1, **nums)

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """The Trainer saved checkpoint-N: the guard's state goes into it (hf_resume.py), once the
        run store's rows up to N are on disk; the save is an event and not the next step's time.
        The Trainer's save (from its last hook before it) and the guard's are goodput's
        checkpoint_s, as `moeguard train` books its own saves."""
        g = self.guarded
        if g is None:
            return  # no optimizer step yet
        t0 = self._mark or time.perf_counter()
        folder = hf_resume.checkpoint_dir(args, state)
        g.session.checkpoint_starts()
        if args.should_save:  # the process that writes trainer_state.json
            if folder.is_dir():
                hf_resume.save(g, folder)
            else:  # a hyperparameter search's per-trial folder: not where transformers' naming says
                warnings.warn(
                    f"MoEGuardCallback: no checkpoint folder {folder} to hold the guard's state; "
                    "a resume from this save starts the guard's baselines afresh",
                    stacklevel=2,
                )
        g.goodput.add("checkpoint_s", time.perf_counter() - t0)
        g.session.checkpoint_saved(g.step_idx, folder, lambda: g.goodput.report(time.time()))
        g.restart_clock()

    # ---- tear-down ---------------------------------------------------------------------
    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """Close the run store; give back the optimizer's step, the clip and the model's hooks."""
        self._close()

    def _close(self) -> None:
        if self.guarded is not None:
            self.guarded.close()
        if self._optimizer is not None and self._optimizer.__dict__.get("step") is not None:
            del self._optimizer.step
        if self._args is not None and self._clip is not None:
            self._args.max_grad_norm = self._clip
        if self._hook is not None:
            self._hook.remove()
        if self._own_attach is not None:
            self._own_attach.remove()
        self.guarded = None
        self._reset()


def _autocast(args: Any) -> torch.dtype | None:
    """The dtype the Trainer's forward runs in under autocast (accelerate's mixed precision)."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def _peak_lr(optimizer: torch.optim.Optimizer) -> float:
    """The largest base LR of the optimizer's groups (torch's schedulers keep it as initial_lr)."""
    return max(float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups)


def _flops(model: nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token for MFU (guard/integrations/hf_flops.py), None where it cannot count."""
    try:
        from guard.integrations.hf_flops import flops_per_token
    except ImportError:
        return None
    try:
        return float(flops_per_token(model, seq_len=seq_len))
    except (TypeError, ValueError, AttributeError):  # a model it cannot count: no MFU, training goes on
        return None
