"""The library API: guard any PyTorch training loop in a few lines.

    from guard.api import GuardedStep
    from guard.probes import RouterProbe

    routers = [(i, RouterProbe(blk.moe.gate, n_experts=8, top_k=2)) for i, blk in enumerate(model.layers)]
    guarded = GuardedStep(model, optimizer, run_dir="runs/my-run", layers=model.layers, routers=routers,
                          max_lr=3e-4, grad_clip=1.0)
    for batch in loader:
        loss = model(batch).loss
        loss.backward()
        decision = guarded.step(loss, tokens=batch.numel())  # steps the optimizer, or not
        if decision.halt:
            break
    guarded.close()

`step()` reads gradients and router statistics (one host copy), runs the detectors and the
policy, then calls `optimizer.step()` only when the update is safe; on a skip neither weights nor
optimizer state change (NaN included); on a rollback it restores the last good snapshot.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from guard import schema
from guard.config import GuardConfig, load_guard_config
from guard.guard import Guard
from guard.policy import Decision
from guard.probe import Probe
from guard.report import StepReport
from guard.runstore import RunStore


def _default_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (transformer.h, model.layers, blocks...): the nn.ModuleList holding
    the most parameters, i.e. the outermost stack, not an experts list nested inside one block."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return [model]
    return list(max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters())))


class GuardedStep:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 run_dir: str | Path | None = None, config: GuardConfig | str | Path | None = None,
                 layers: list[nn.Module] | None = None, routers: list[tuple[int, Any]] | None = None,
                 max_lr: float | None = None, grad_clip: float = 0.0, dead_window: int = 50) -> None:  # fmt: skip
        if isinstance(config, str | Path):
            config = load_guard_config(config)
        self.cfg = config or GuardConfig()
        self.model = model
        self.optimizer = optimizer
        self.grad_clip = grad_clip
        device = next(model.parameters()).device
        self.probe = Probe(model, dead_window=dead_window, device=device,
                           layers=layers if layers is not None else _default_layers(model),
                           routers=routers or [])  # fmt: skip
        self.layer_ids = list(range(self.probe.n_layers))
        self.guard = Guard(self.cfg, model, optimizer, max_lr=max_lr, has_bias=False)
        self.store = RunStore(run_dir) if run_dir is not None else None
        if self.store is not None:
            self.store.write_meta({"run_id": Path(run_dir).name, "status": schema.STATUS_RUNNING,  # type: ignore[arg-type]
                                   "started_at": time.time(), "env": {"torch": torch.__version__},
                                   "config": {"guard": _asdict(self.cfg)}})  # fmt: skip
        self.step_idx = 0
        self._t_last = time.perf_counter()
        self.counts: dict[str, int] = {}

    def step(self, loss: torch.Tensor, *, tokens: int = 0, n_micro: int = 1) -> Decision:
        """Call after backward. Steps the optimizer only if the guard allows it; zeroes gradients."""
        pr = self.probe.collect(loss.detach() * n_micro, n_micro)
        lr = float(self.optimizer.param_groups[0]["lr"])
        import numpy as np

        rep = StepReport(step=self.step_idx, time=time.time(), loss=pr.loss, grad_norm=pr.grad_norm, lr=lr,
                         tokens=tokens, layer_ids_L=np.asarray(self.layer_ids, dtype=np.int32),
                         layer_grad_norm_L=pr.layer_grad_norm_L, moe_layer_ids_M=self.probe.moe_ids_M,
                         router_entropy_M=pr.router_entropy_M, load_entropy_M=pr.load_entropy_M,
                         maxvio_M=pr.maxvio_M, dead_experts_M=pr.dead_experts_M, bias_norm_M=pr.bias_norm_M,
                         load_ME=pr.load_ME, bias_ME=pr.bias_ME)  # fmt: skip
        d = self.guard.observe(rep, lr=lr)
        if d.applies_update:
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            if self.grad_clip and math.isfinite(pr.grad_norm) and pr.grad_norm > self.grad_clip:
                torch._foreach_mul_([p.grad for p in params], self.grad_clip / (pr.grad_norm + 1e-6))
            scale = d.lr_scale
            if scale != 1.0:
                for g in self.optimizer.param_groups:
                    g["lr"] = g["lr"] * scale
            self.optimizer.step()
            if scale != 1.0:
                for g in self.optimizer.param_groups:
                    g["lr"] = g["lr"] / scale
        elif d.action == schema.ACT_ROLLBACK:
            self.guard.rollback(d)
        self.optimizer.zero_grad(set_to_none=True)
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

    def close(self) -> None:
        if self.store is not None:
            self.store.close(status=schema.STATUS_FINISHED, final_step=self.step_idx, counts=self.counts)


def _asdict(cfg: GuardConfig) -> dict[str, Any]:
    from guard.tomlconf import to_dict

    return to_dict(cfg)
