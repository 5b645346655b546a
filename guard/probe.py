"""Probe: per-step, per-layer statistics computed on the device, ONE device->host copy per step.

Shapes: L transformer blocks, M MoE layers, E experts. Everything below stays a tensor on the
training device until `collect()` concatenates it into one flat float64 vector and copies it
once; no `.item()` per layer or per expert (each would be a host sync on a GPU).

Across ranks, the additive quantities (loss sum, expert loads, router-entropy sums, token
counts, and any `extra` values the caller adds) are packed into one tensor and all-reduced once,
so every rank derives identical statistics and therefore identical guard decisions. Replicated
gradients are already synchronised; with FSDP2 (DTensor gradients sharded on dim 0) each rank
holds only its shard, so the per-layer sums of squares ride in the same all-reduce and every rank
gets the full norms. Still one device->host copy per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
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
    extra: np.ndarray = field(default_factory=lambda: np.zeros(0))  # the caller's values, summed over ranks


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
        blocks = layers if layers is not None else model.blocks
        # torchtitan keeps its blocks in an nn.ModuleDict: iterate the modules, not the keys
        blocks = list(blocks.values()) if isinstance(blocks, nn.ModuleDict | dict) else list(blocks)
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
        # FSDP2: gradients are DTensor shards; their squared norms must be summed across ranks.
        self.sharded = any(_is_shard(p) for p in self.params)
        self.all_reduce: Callable[..., Any] = dist.all_reduce  # the trainer swaps in a timed one

    # ---- device-side pieces ----------------------------------------------------------
    def grad_sq(self) -> torch.Tensor:
        """Sum of squared gradients per block [L+1] (last: everything outside the blocks), of
        this rank's gradient shards when sharded. NaN-propagating."""
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in self.params]
        norms = torch.stack(torch._foreach_norm(grads)).float()
        return torch.zeros(self.n_layers + 1, device=norms.device).index_add_(0, self.segment_ids, norms**2)

    def grad_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(total L2 norm, per-block L2 norms [L]) as device tensors, NaN-propagating."""
        sq = self.grad_sq()
        if self.sharded and _multi_rank():
            self.all_reduce(sq)
        return sq.sum().sqrt(), sq[: self.n_layers].sqrt()

    def _router_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loads [M,E], entropy sums [M], token counts [M]) of this rank, summed over micro-batches."""
        if not self.routers:
            z = torch.zeros(0, device=self.device)
            return z.reshape(0, 0), z, z
        routers = [r for _, r in self.routers]
        loads = torch.stack([r.tokens_per_expert_E for r in routers]).float()
        ent = torch.stack([r.entropy_sum.reshape(()) for r in routers]).float()
        cnt = torch.stack([r.token_count.reshape(()) for r in routers]).float()
        return loads, ent, cnt

    def reduced_router_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loads [M,E], entropy sums [M], token counts [M]), summed over micro-batches and ranks."""
        loads, ent, cnt = self._router_stats()
        if self.routers and _multi_rank():
            flat = torch.cat([loads.reshape(-1), ent, cnt])
            self.all_reduce(flat)
            m, e = loads.shape
            loads, ent, cnt = flat[: m * e].reshape(m, e), flat[m * e : m * e + m], flat[m * e + m :]
        return loads, ent, cnt

    def reset_router_stats(self) -> None:
        for _, r in self.routers:
            r.reset_stats()

    # ---- the one transfer --------------------------------------------------------------
    def collect(self, loss_sum: torch.Tensor, n_micro: int, extra: torch.Tensor | None = None) -> ProbeResult:
        """Compute every statistic on the device and copy them to the host in one transfer.

        Across ranks: ONE all-reduce (sum) of [loss, FSDP grad sums of squares, router loads,
        entropy sums, token counts, extra]. `extra` (1-D, optional) comes back summed over ranks
        in ProbeResult.extra, e.g. a one-hot of each rank's data wait."""
        sq = self.grad_sq()
        loads, ent, cnt = self._router_stats()
        m, e = loads.shape if loads.ndim == 2 else (0, 0)
        loss = loss_sum.detach().float().reshape(1)
        ex = extra.detach().float().reshape(-1).to(loss.device) if extra is not None else loss.new_zeros(0)
        if _multi_rank():
            parts = [loss, sq if self.sharded else sq.new_zeros(0), loads.reshape(-1), ent, cnt, ex]
            flat = torch.cat(parts)
            self.all_reduce(flat)
            loss, sq_r, loads_f, ent, cnt, ex = torch.split(flat, [p.numel() for p in parts])
            loss = loss / dist.get_world_size()
            sq = sq_r if self.sharded else sq
            loads = loads_f.reshape(m, e)
        total, per_layer = sq.sum().sqrt(), sq[: self.n_layers].sqrt()
        self.loads_ME = loads
        loss = loss / n_micro
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
             loads.reshape(-1), bias.reshape(-1), ex]  # fmt: skip
        ).to(torch.float64)
        host = flat.cpu().numpy()  # the single device->host transfer of the step
        return self._unpack(host, m, e, ex.numel())

    def _unpack(self, h: np.ndarray, m: int, e: int, n_extra: int = 0) -> ProbeResult:
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
        i += m * e
        extra = h[i : i + n_extra].copy()
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
            extra=extra,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"steps_since_token_ME": self.steps_since_token_ME.cpu()}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self.steps_since_token_ME = d["steps_since_token_ME"].to(self.device)


def _multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _is_shard(p: torch.Tensor) -> bool:
    return any(pl.is_shard() for pl in getattr(p, "placements", ()))
