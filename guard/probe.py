"""Probe: per-step, per-layer statistics computed on the device, ONE device->host copy per step.

Shapes: L transformer blocks, M MoE layers, E experts. Everything below stays a tensor on the
training device until `collect()` concatenates it into one flat float64 vector and copies it
once; no `.item()` per layer or per expert (each would be a host sync on a GPU).

Across ranks, the additive quantities (loss sum, expert loads, router-entropy sums, token
counts) are packed into one tensor and all-reduced once, so every rank derives identical
statistics and therefore identical guard decisions. Gradients are already synchronised by DDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


@dataclass(slots=True)
class ProbeResult:
    """Host-side statistics for one step (numpy / floats)."""

    loss: float
    grad_norm: float
    layer_grad_norm_L: np.ndarray
    router_entropy_M: np.ndarray
    load_entropy_M: np.ndarray
    maxvio_M: np.ndarray
    dead_experts_M: np.ndarray
    bias_norm_M: np.ndarray
    load_ME: np.ndarray
    bias_ME: np.ndarray


class Probe:
    """Reads gradients and router accumulators after backward, before the optimizer step."""

    def __init__(self, model: nn.Module, *, dead_window: int, device: torch.device,
                 layers: list[nn.Module] | None = None, routers: list[tuple[int, Any]] | None = None) -> None:
        """`layers`: the modules whose gradient norms are reported per layer (default model.blocks).
        `routers`: (layer index, router) pairs; a router exposes tokens_per_expert_E, entropy_sum,
        token_count, expert_bias_E and reset_stats() (moeguard's Router, or a guard.probes.RouterProbe
        attached to any third-party gate). Default: model.moe_layers()."""
        self.model = model
        self.dead_window = dead_window
        blocks = list(layers if layers is not None else model.blocks)
        self.n_layers = len(blocks)
        # Parameters grouped by block; the rest (embeddings, final norm, head) count only in the
        # total norm. Fixed order so one _foreach_norm call covers every gradient.
        block_params = [[p for p in b.parameters() if p.requires_grad] for b in blocks]
        in_blocks = {id(p) for ps in block_params for p in ps}
        other = [p for p in model.parameters() if p.requires_grad and id(p) not in in_blocks]
        self.params = [p for ps in block_params for p in ps] + other
        seg = [i for i, ps in enumerate(block_params) for _ in ps] + [self.n_layers] * len(other)
        self.segment_ids = torch.tensor(seg, device=device)
        if routers is None:
            routers = [(i, layer.router) for i, layer in model.moe_layers()] if hasattr(model, "moe_layers") else []
        self.routers = list(routers)
        self.moe_ids_M = np.array([i for i, _ in self.routers], dtype=np.int32)
        self.n_experts = self.routers[0][1].expert_bias_E.numel() if self.routers else 0
        m, e = len(self.routers), self.n_experts
        self.steps_since_token_ME = torch.zeros(m, e, device=device)
        self.device = device
        self.loads_ME: torch.Tensor | None = None  # reduced loads of the last collect (for bias updates)

    # ---- device-side pieces ----------------------------------------------------------
    def grad_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(total L2 norm, per-block L2 norms [L]) as device tensors, NaN-propagating."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        norms = torch.stack(torch._foreach_norm(grads)).float()
        sq = torch.zeros(self.n_layers + 1, device=norms.device).index_add_(0, self.segment_ids, norms**2)
        return sq.sum().sqrt(), sq[: self.n_layers].sqrt()

    def reduced_router_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loads [M,E], entropy sums [M], token counts [M]), summed over micro-batches and ranks."""
        if not self.routers:
            z = torch.zeros(0, device=self.device)
            return z.reshape(0, 0), z, z
        routers = [r for _, r in self.routers]
        loads = torch.stack([r.tokens_per_expert_E for r in routers]).float()
        ent = torch.stack([r.entropy_sum.reshape(()) for r in routers]).float()
        cnt = torch.stack([r.token_count.reshape(()) for r in routers]).float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flat = torch.cat([loads.reshape(-1), ent, cnt])
            dist.all_reduce(flat)
            m, e = loads.shape
            loads, ent, cnt = flat[: m * e].reshape(m, e), flat[m * e : m * e + m], flat[m * e + m :]
        return loads, ent, cnt

    def reset_router_stats(self) -> None:
        for _, r in self.routers:
            r.reset_stats()

    # ---- the one transfer --------------------------------------------------------------
    def collect(self, loss_sum: torch.Tensor, n_micro: int) -> ProbeResult:
        """Compute every statistic on the device and copy them to the host in one transfer."""
        total, per_layer = self.grad_norms()
        loads, ent, cnt = self.reduced_router_stats()
        self.loads_ME = loads
        loss = loss_sum.detach().float().reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loss)
            loss = loss / dist.get_world_size()
        loss = loss / n_micro
        m, e = loads.shape if loads.ndim == 2 else (0, 0)
        if m:
            mean = loads.mean(dim=1, keepdim=True).clamp_min(1e-9)
            maxvio = (loads.max(dim=1).values - mean.squeeze(1)) / mean.squeeze(1)
            share = loads / loads.sum(dim=1, keepdim=True).clamp_min(1e-9)
            load_ent = -(share * share.clamp_min(1e-12).log()).sum(dim=1) / math.log(e)
            router_ent = ent / cnt.clamp_min(1.0)
            self.steps_since_token_ME = torch.where(loads > 0, 0.0, self.steps_since_token_ME + 1)
            dead = (self.steps_since_token_ME >= self.dead_window).sum(dim=1).float()
            bias = torch.stack([r.expert_bias_E for _, r in self.routers]).float()
            bias_norm = bias.norm(dim=1)
        else:
            maxvio = load_ent = router_ent = dead = bias_norm = torch.zeros(0, device=self.device)
            bias = torch.zeros(0, 0, device=self.device)
        flat = torch.cat(
            [loss, total.reshape(1), per_layer, router_ent, load_ent, maxvio, dead, bias_norm,
             loads.reshape(-1), bias.reshape(-1)]  # fmt: skip
        ).to(torch.float64)
        host = flat.cpu().numpy()  # the single device->host transfer of the step
        return self._unpack(host, m, e)

    def _unpack(self, h: np.ndarray, m: int, e: int) -> ProbeResult:
        n_l = self.n_layers
        i = 2
        per_layer = h[i : i + n_l]
        i += n_l
        parts = []
        for _ in range(5):
            parts.append(h[i : i + m])
            i += m
        loads = h[i : i + m * e].reshape(m, e)
        i += m * e
        bias = h[i : i + m * e].reshape(m, e)
        router_ent, load_ent, maxvio, dead, bias_norm = parts
        return ProbeResult(
            loss=float(h[0]),
            grad_norm=float(h[1]),
            layer_grad_norm_L=per_layer.copy(),
            router_entropy_M=router_ent.copy(),
            load_entropy_M=load_ent.copy(),
            maxvio_M=maxvio.copy(),
            dead_experts_M=dead.astype(np.int32),
            bias_norm_M=bias_norm.copy(),
            load_ME=np.rint(loads).astype(np.int64),
            bias_ME=bias.copy(),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"steps_since_token_ME": self.steps_since_token_ME.cpu()}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self.steps_since_token_ME = d["steps_since_token_ME"].to(self.device)
