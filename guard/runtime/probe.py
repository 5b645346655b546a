"""Probe: per-step, per-layer statistics computed on the device, ONE device->host copy per step.

Shapes: L transformer blocks, M MoE layers, E experts, P parameters. The raw numbers (gradient
norms per parameter, router accumulators, biases) stay tensors on the training device until
`collect()` concatenates them into one flat vector and copies it once; no `.item()` per layer or
per expert (each would be a host sync on a GPU). The statistics derived from them are a few
numpy operations on the host.

Across ranks, the additive quantities (loss sum, expert loads, router-entropy sums, token
counts, and any `extra` values the caller adds) are packed into one tensor and all-reduced once,
so every rank derives identical statistics and therefore identical guard decisions. Replicated
gradients are already synchronised; with FSDP2 (DTensor gradients sharded on dim 0) each rank
holds only its shard, so the per-layer sums of squares ride in the same all-reduce and every rank
gets the full norms. Still one device->host copy per step.

Given the optimizer, the probe also carries the precursor signals (guard/runtime/precursor.py):
the update ratio of the update that produced this step's weights (sampled around
optimizer.step() by hooks, shipped at the next collect), per optimizer group grad norms, and
optionally Adam's second-moment spike ratio; in the same copy and the same all-reduce. Layers
holding a LogitWatch also get their max attention logit on every k-th step
(guard/runtime/attention_logits.py), at the end of the same copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from guard.core.config import PrecursorConfig
from guard.core.routing_stats import maxvio_and_entropy
from guard.runtime.attention_logits import MaxLogitSampler, find_watches
from guard.runtime.precursor import Precursors
from guard.runtime.routing import count_pending, counted_together


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
    # StepReport fields of the precursor signals (update_ratio, update_ratio_L, group_grad_norm_G,
    # group_update_ratio_G, adam_v_ratio); empty when the probe has no optimizer or they are off
    precursors: dict[str, Any] = field(default_factory=dict)


class Probe:
    """Reads gradients and router accumulators after backward, before the optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        *,
        dead_window: int,
        device: torch.device,
        layers: list[nn.Module] | None = None,
        routers: list[tuple[int, Any]] | None = None,
        all_reduce: Callable[..., Any] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        precursor: PrecursorConfig | None = None,
    ) -> None:
        """`layers`: the modules whose gradient norms are reported per layer (default model.blocks).
        `routers`: (layer index, router) pairs; a router exposes tokens_per_expert_E, entropy_sum,
        token_count, expert_bias_E and reset_stats() (moeguard's Router, or a guard.runtime.probes.RouterProbe
        attached to any third-party gate). Default: model.moe_layers().
        `all_reduce(tensor)`: sums a tensor across ranks in place (default torch.distributed's; the
        trainer passes its timed one, so time waiting for peers stays out of a rank's busy time).
        `optimizer` (with `precursor` enabled, the default): measure the precursor signals; the
        probe hooks optimizer.step() to sample each update (guard/runtime/precursor.py)."""
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
        self._segments = np.asarray(seg, dtype=np.int64)
        if routers is None:
            routers = (
                [(i, layer.router) for i, layer in model.moe_layers()] if hasattr(model, "moe_layers") else []
            )
        self.routers = list(routers)
        self.moe_ids_M = np.array([i for i, _ in self.routers], dtype=np.int32)
        self.n_experts = self.routers[0][1].expert_bias_E.numel() if self.routers else 0
        m, e = len(self.routers), self.n_experts
        self._since_token_ME = np.zeros((m, e), dtype=np.int64)
        # Routers that never have a selection bias ship one constant zero vector, not M views.
        no_bias = m > 0 and all(getattr(r, "has_selection_bias", True) is False for _, r in self.routers)
        self._zero_bias = self.routers[0][1].expert_bias_E.new_zeros(m * e) if no_bias else None
        self._token_counts: tuple[int, torch.Tensor] | None = None  # (n, [M] of n), read-only
        self._nothing: torch.Tensor | None = None
        self.device = device
        self.loads_ME: torch.Tensor | None = None  # reduced loads of the last collect (for bias updates)
        # FSDP2: gradients are DTensor shards; their squared norms must be summed across ranks.
        self.sharded = any(_is_shard(p) for p in self.params)
        self.all_reduce: Callable[..., Any] = all_reduce if all_reduce is not None else dist.all_reduce
        precursor = precursor if precursor is not None else PrecursorConfig()
        self.precursors = (
            Precursors(self.params, self._segments, self.n_layers, optimizer, precursor)
            if optimizer is not None and precursor.enabled
            else None
        )
        watches = find_watches(blocks) if precursor.enabled and precursor.max_logit_every > 0 else []
        self.logits = (
            MaxLogitSampler(
                watches,
                self.n_layers,
                every=precursor.max_logit_every,
                n_seqs=precursor.max_logit_seqs,
                all_reduce=self.all_reduce,
            )
            if watches
            else None
        )

    # ---- device-side pieces ----------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient (this rank's shard when sharded), zeros where missing."""
        if self.sharded:
            return [
                _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in self.params
            ]
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def param_norms(self) -> torch.Tensor:
        """L2 norm of each parameter's gradient [P] (float32, on the device), NaN-propagating."""
        return torch.stack(torch._foreach_norm(self._grads())).float()

    def _router_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loads [M,E], entropy sums [M], token counts [M]) of this rank, summed over micro-batches."""
        if not self.routers:
            z = torch.zeros(0, device=self.device)
            return z.reshape(0, 0), z, z
        routers = [r for _, r in self.routers]
        count_pending(routers)
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
        """Gather the step's raw numbers on the device and copy them to the host in one transfer;
        derive the statistics there.

        On the device: one _foreach_norm over every gradient and one concatenation of [loss, the
        per-parameter gradient norms, the routers' loads, entropy sums and token counts, extra,
        the selection biases]: a handful of kernel launches whatever the layer count. The derived
        statistics (per-block norms, MaxVio, entropies, dead experts) are a few numpy operations
        on O(params + M*E) numbers on the host, far cheaper than ~25 tiny device kernels (on a
        CPU each torch op costs ~5-10 us of dispatch; on a GPU each is a launch).

        Across ranks: ONE all-reduce (sum) of [loss, FSDP per-parameter squared norms, router
        loads, entropy sums, token counts, extra]. `extra` (1-D, optional) comes back summed
        over ranks in ProbeResult.extra, e.g. a one-hot of each rank's data wait."""
        norms = self.param_norms()
        m, e = len(self.routers), self.n_experts
        sources = [r for _, r in self.routers]
        count_pending(sources)  # hooks that defer their arithmetic: all layers in one batch
        loss = loss_sum.detach().float().reshape(1)
        if self._nothing is None or self._nothing.device != loss.device:
            self._nothing = loss.new_zeros(0)  # the empty piece, reused (read-only)
        nothing = self._nothing
        ex = extra.detach().float().reshape(-1).to(loss.device) if extra is not None else nothing
        # Additive across ranks: loss, router accumulators, extra (and FSDP shards' squared norms).
        summed = [loss, *self._routed(sources), ex]
        biases = (
            [self._zero_bias]
            if self._zero_bias is not None
            else [r.expert_bias_E.reshape(-1) for r in sources]
        )
        # precursor numbers: sums over this rank's shard when sharded (then reduced), else replicated
        pre = self.precursors.device_part(loss) if self.precursors is not None else nothing
        # max attention logits (sampled steps only; already MAX-reduced across ranks): last
        logit = self.logits.device_part(loss) if self.logits is not None else nothing
        n_ex = ex.numel()
        if _multi_rank():
            own = [norms**2, pre] if self.sharded else [norms[:0], pre[:0]]
            flat = torch.cat([own[0], *summed, own[1]]).float()
            self.all_reduce(flat)
            n_sq, n_pre = own[0].numel(), own[1].numel()
            end = flat.numel() - n_pre
            flat = torch.cat(
                [
                    flat[:n_sq] if self.sharded else norms**2,
                    flat[n_sq:end],
                    *biases,
                    flat[end:] if self.sharded else pre,
                    logit,
                ]
            )
            world = dist.get_world_size()
        else:
            flat = torch.cat([norms**2, *summed, *biases, pre, logit])
            world = 1
        n_p = len(self.params)
        # This step's loads stay a device tensor for bias updates (a view of the gathered vector).
        self.loads_ME = flat[n_p + 1 : n_p + 1 + m * e].view(m, e) if m else None
        host = flat.cpu().numpy().astype(np.float64)  # the single device->host transfer of the step
        return self._derive(host, m, e, n_ex, world, n_micro)

    def _routed(self, sources: list[Any]) -> list[torch.Tensor]:
        """[loads M*E, entropy sums M, token counts M] as flat pieces: the stacked tensors when the
        routers were counted together (the usual step), else three views per router."""
        batch = counted_together(sources)
        if batch is None:
            return [
                *(r.tokens_per_expert_E.reshape(-1) for r in sources),
                *(r.entropy_sum.reshape(1) for r in sources),
                *(r.token_count.reshape(1) for r in sources),
            ]
        if self._token_counts is None or self._token_counts[0] != batch.n_tokens:
            counts = batch.ent_G.new_full((len(sources),), float(batch.n_tokens))
            self._token_counts = (batch.n_tokens, counts)
        return [batch.counts_GE.view(-1), batch.ent_G, self._token_counts[1]]

    def _derive(self, h: np.ndarray, m: int, e: int, n_extra: int, world: int, n_micro: int) -> ProbeResult:
        """Host-side statistics from the gathered vector [sq norms P, loss, loads M*E, entropy sums M,
        token counts M, extra, biases M*E, precursors, max logits]."""
        n_p = len(self.params)
        sq_L1 = np.bincount(self._segments, weights=h[:n_p], minlength=self.n_layers + 1)  # NaN-propagating
        i = n_p
        loss = h[i] / world / n_micro
        i += 1
        loads = h[i : i + m * e].reshape(m, e)
        i += m * e
        ent, cnt = h[i : i + m], h[i + m : i + 2 * m]
        i += 2 * m
        extra = h[i : i + n_extra].copy()
        i += n_extra
        bias = h[i : i + m * e].reshape(m, e)
        i += m * e
        precursors = self.precursors.derive(h[i:], h[:n_p]) if self.precursors is not None else {}
        if self.logits is not None:
            precursors.update(self.logits.derive(h[h.size - self.logits.n_values :]))
        if m:
            # No np.errstate: loads are finite counts and every divisor is clamped positive (a
            # NaN or inf entropy sum divides quietly).
            maxvio, load_ent = maxvio_and_entropy(loads)
            router_ent = ent / np.maximum(cnt, 1.0)
            self._since_token_ME = np.where(loads > 0, 0, self._since_token_ME + 1)
            dead = (self._since_token_ME >= self.dead_window).sum(axis=1).astype(np.int32)
            bias_norm = np.sqrt((bias * bias).sum(axis=1))
        else:
            maxvio = load_ent = router_ent = bias_norm = np.zeros(0)
            dead = np.zeros(0, dtype=np.int32)
        return ProbeResult(
            loss=float(loss),
            grad_norm=float(np.sqrt(sq_L1.sum())),
            layer_grad_norm_L=np.sqrt(sq_L1[: self.n_layers]),
            router_entropy_M=router_ent,
            load_entropy_M=load_ent,
            maxvio_M=maxvio,
            dead_experts_M=dead,
            bias_norm_M=bias_norm,
            load_ME=np.rint(loads).astype(np.int64),
            bias_ME=bias.copy(),
            extra=extra,
            precursors=precursors,
        )

    def close(self) -> None:
        """Remove the optimizer hooks the precursor sampler installed."""
        if self.precursors is not None:
            self.precursors.close()
        if self.logits is not None:
            self.logits.close()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"steps_since_token_ME": torch.from_numpy(self._since_token_ME.astype(np.float32))}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self._since_token_ME = np.asarray(d["steps_since_token_ME"].cpu(), dtype=np.int64)


def _multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _is_shard(p: torch.Tensor) -> bool:
    return any(pl.is_shard() for pl in getattr(p, "placements", ()))
