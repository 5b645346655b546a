"""The library API: guard any PyTorch training loop in a few lines.

    from guard.api import GuardedStep
    from guard.integrations.transformers import attach

    guarded = GuardedStep(model, optimizer, attach=attach(model), run_dir="runs/my-run", max_lr=3e-4)
    for batch in guarded.batches(loader):            # drops the data window after a rollback
        loss = model(**batch).loss
        loss.backward()
        decision = guarded.step(loss, tokens=batch["input_ids"].numel())  # steps the optimizer, or not
        if decision.halt:
            break
    guarded.close()

`step()` reads gradients and router statistics (one host copy), runs the detectors and the
policy, then calls `optimizer.step()` only when the update is safe; on a skip neither weights nor
optimizer state change (NaN included); on a rollback it restores the last snapshot before the
incident and skips the next `skip_batches` batches (through `batches()`, or, when the loop does
not use it, by skipping those updates); a collapse correction goes through the attachment's
corrector (a selection-bias push or a per-layer balancing gradient) and is reported only when
the model offers one. Operator commands (skip, rollback, halt) from `commands=` (an exporter
talking to the collector, or a CommandFile an operator writes) are merged into the step's
decision by the same engine the trainer runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from guard.core import schema
from guard.core.config import GuardConfig, load_guard_config
from guard.core.events import Event
from guard.core.policy import Decision
from guard.core.report import StepReport
from guard.integrations.base import MODE_NONE, Attachment
from guard.runtime.apply import DecisionApplier
from guard.runtime.commands import CommandSource
from guard.runtime.guard import Guard
from guard.runtime.probe import Probe
from guard.store.runstore import RunStore

T = TypeVar("T")


def _default_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (transformer.h, model.layers, blocks...): the nn.ModuleList holding
    the most parameters, i.e. the outermost stack, not an experts list nested inside one block."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList | nn.ModuleDict) and len(m) > 0]
    if not lists:
        return [model]
    best = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(best.values()) if isinstance(best, nn.ModuleDict) else list(best)


class GuardedStep:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        run_dir: str | Path | None = None,
        config: GuardConfig | str | Path | None = None,
        attach: Attachment | None = None,
        layers: list[nn.Module] | None = None,
        routers: list[tuple[int, Any]] | None = None,
        max_lr: float | None = None,
        grad_clip: float = 0.0,
        dead_window: int = 50,
        commands: CommandSource | None = None,
    ) -> None:
        """`attach`: what guard.integrations.<framework>.attach(model) found (layers, routers and
        the collapse corrector); `layers`/`routers` are the manual form of the same for a custom
        model (routers observed, no correction applied). `commands`: where operator commands come
        from (guard.runtime.commands.CommandFile, or an Exporter); each applies at the next step."""
        if isinstance(config, str | Path):
            config = load_guard_config(config)
        self.cfg = config or GuardConfig()
        self.model = model
        self.optimizer = optimizer
        self.commands = commands
        if attach is not None:
            layers, routers = attach.layers, attach.routers
        device = next(model.parameters()).device
        self.probe = Probe(
            model,
            dead_window=dead_window,
            device=device,
            layers=layers if layers is not None else _default_layers(model),
            routers=routers or [],
            optimizer=optimizer,
            precursor=self.cfg.precursor,
        )
        self.layer_ids = np.arange(self.probe.n_layers, dtype=np.int32)
        mode = attach.correction_mode if attach is not None else MODE_NONE
        self.guard = Guard(self.cfg, model, optimizer, max_lr=max_lr, correction=mode)
        self.applier = DecisionApplier(
            optimizer,
            self.guard,
            grad_clip=grad_clip,
            corrector=attach.corrector if attach is not None else None,
            after_step=attach.after_step if attach is not None else None,
        )
        self.store = RunStore(run_dir) if run_dir is not None else None
        if self.store is not None:
            self.store.write_meta(
                {
                    "run_id": Path(run_dir).name,
                    "status": schema.STATUS_RUNNING,  # type: ignore[arg-type]
                    "started_at": time.time(),
                    "env": {"torch": torch.__version__},
                    "integration": {
                        "family": attach.family if attach else type(model).__name__,
                        "correction": mode,
                    },
                    "config": {"guard": _asdict(self.cfg)},
                }
            )
        self.step_idx = 0
        self._t_last = time.perf_counter()
        self.counts: dict[str, int] = {}
        self.pending_skip = 0  # batches still to drop after a rollback (the PaLM data window)

    # ---- data window ------------------------------------------------------------------
    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """Yield the loader's batches, dropping the data window a rollback asks to skip."""
        for batch in loader:
            if self.pending_skip > 0:
                self.pending_skip -= 1
                continue
            yield batch

    # ---- the step -----------------------------------------------------------------------
    def step(self, loss: torch.Tensor, *, tokens: int = 0, n_micro: int = 1) -> Decision:
        """Call after backward. Steps the optimizer only if the guard allows it; zeroes gradients."""
        pr = self.probe.collect(loss.detach() * n_micro, n_micro)
        planned = [float(g["lr"]) for g in self.optimizer.param_groups]
        rep = StepReport(
            step=self.step_idx,
            time=time.time(),
            loss=pr.loss,
            grad_norm=pr.grad_norm,
            lr=planned[0],
            tokens=tokens,
            layer_ids_L=self.layer_ids,
            layer_grad_norm_L=pr.layer_grad_norm_L,
            moe_layer_ids_M=self.probe.moe_ids_M,
            router_entropy_M=pr.router_entropy_M,
            load_entropy_M=pr.load_entropy_M,
            maxvio_M=pr.maxvio_M,
            dead_experts_M=pr.dead_experts_M,
            bias_norm_M=pr.bias_norm_M,
            load_ME=pr.load_ME,
            bias_ME=pr.bias_ME,
            **pr.precursors,
        )
        if self.commands is not None:
            self.guard.commands.offer(self.commands.poll_commands())
        d = self.guard.observe(rep, lr=planned[0], command=self.guard.commands.next())
        if d.applies_update and self.pending_skip > 0:
            # A rollback asked to skip a data window and this loop does not drop batches through
            # batches(): skip the update of each batch of the window instead.
            self.pending_skip -= 1
            d.action = schema.ACT_SKIP
            d.events.append(
                Event(
                    step=self.step_idx,
                    kind=schema.EV_ACTION,
                    action=schema.ACT_SKIP,
                    detail={"reason": "data window after a rollback", "left": self.pending_skip},
                )
            )
        rep.lr = planned[0] * d.lr_scale if d.applies_update else planned[0]
        done = self.applier.apply(d, grad_norm=pr.grad_norm, loads_ME=self.probe.loads_ME)
        if done.restored_step is not None:
            self.pending_skip = d.skip_batches
        self.probe.reset_router_stats()
        now = time.perf_counter()
        rep.step_time_s, self._t_last = now - self._t_last, now
        rep.tokens_per_s = tokens / rep.step_time_s if tokens else float("nan")
        rep.action = d.action
        self.counts[d.action] = self.counts.get(d.action, 0) + 1
        if self.store is not None:
            self.store.add_step(rep)
            for ev in d.events:
                self.store.add_event(ev)
        self.step_idx += 1
        self.guard.after_step(self.step_idx)
        return d

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_idx,
            "guard": self.guard.state_dict(),
            "probe": self.probe.state_dict(),
            "pending_skip": self.pending_skip,
            "counts": dict(self.counts),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.step_idx = int(s["step"])
        self.guard.load_state_dict(s["guard"])
        self.probe.load_state_dict(s["probe"])
        self.pending_skip = int(s.get("pending_skip", 0))
        self.counts = dict(s.get("counts", {}))

    def close(self) -> None:
        self.probe.close()
        if self.store is not None:
            self.store.close(status=schema.STATUS_FINISHED, final_step=self.step_idx, counts=self.counts)


def _asdict(cfg: GuardConfig) -> dict[str, Any]:
    from guard.core.tomlconf import to_dict

    return to_dict(cfg)
