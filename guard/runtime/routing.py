"""The routing statistics every RoutingSource feeds and the Probe reads, and the correction
protocol the runtime calls: the contract between guard/runtime (probe.py, probes.py, apply.py)
and the adapters above it (guard/integrations/), defined here so that the runtime never imports
an adapter. guard/integrations/base.py re-exports these names and documents the contract in full.

Shapes: N tokens, E experts, G layers counted together.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class RoutingSource(Protocol):
    tokens_per_expert_E: torch.Tensor
    entropy_sum: torch.Tensor
    token_count: torch.Tensor
    expert_bias_E: torch.Tensor

    def reset_stats(self) -> None: ...


class Corrector(Protocol):
    mode: str

    def correct(self, boosts: dict[int, float], loads_ME: torch.Tensor | None, applied: bool) -> None:
        """Called once per step after the update decision. `boosts`: layer id -> multiplier of every
        correction open now (empty when none); `loads_ME`: this step's reduced loads in router
        order; `applied`: whether the optimizer step ran (a skipped step must not move a bias)."""
        ...


def score_entropy_sum(
    logits_NE: torch.Tensor, score_func: str, dims: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum over tokens of the entropy (nats) of the router's score distribution. The experts are
    the last dim; `dims`: the token dims to sum over (default all: one scalar)."""
    x = logits_NE.detach().float()
    if score_func == "sigmoid":
        s = x.sigmoid()
        p = s / s.sum(-1, keepdim=True).clamp_min(1e-12)
        p_log_p = p * p.clamp_min(1e-12).log()
    else:
        # log_softmax with the experts moved to dim -2 (a transposed view, no copy): torch 2.13's
        # CPU (log_)softmax vectorises along the inner dim, so over a last dim of 8 it is ~5x
        # slower than over a middle one. 4 ops instead of the max-shifted form's 9: 18 vs 33 us
        # on [4, 256, 8] isolated, 78 vs 102 us a step in place after a backward (tiny Mixtral).
        log_p = x.mT.log_softmax(-2)
        p_log_p = (log_p.exp() * log_p).mT
    return -(p_log_p.sum() if dims is None else p_log_p.sum(dim=(*dims, -1)))


class RoutingCounters:
    """The device-side accumulators every RoutingSource exposes, fed by a forward hook on a module;
    the probe reads them once per step and calls reset_stats()."""

    def __init__(self, module: nn.Module, n_experts: int) -> None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self.n_experts = n_experts
        self.tokens_per_expert_E = torch.zeros(n_experts, device=device)
        self.entropy_sum = torch.zeros((), device=device)
        self.token_count = torch.zeros((), device=device)
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        raise NotImplementedError

    def reset_stats(self) -> None:
        for t in (self.tokens_per_expert_E, self.entropy_sum, self.token_count):
            t.zero_()

    def remove(self) -> None:
        self._handle.remove()


@dataclass(slots=True, eq=False)
class CountedBatch:
    """count_pending's results for layers counted together: row j is the j-th hook's loads and
    entropy sum; each counted n_tokens tokens for its entropy. The probe ships these stacked
    tensors as they are (counted_together) instead of 3 views per layer."""

    counts_GE: torch.Tensor  # float32, contiguous
    ent_G: torch.Tensor
    n_tokens: int


def counted_together(hooks: list[Any]) -> CountedBatch | None:
    """The CountedBatch whose rows are exactly `hooks`' accumulators in this order (one batch of
    count_pending, one forward each, nothing added since), else None (read the hooks one by one)."""
    first = getattr(hooks[0], "counted", None) if hooks else None
    if first is None or first[0].counts_GE.shape[0] != len(hooks):
        return None
    batch = first[0]
    for j, h in enumerate(hooks):
        row = getattr(h, "counted", None)
        if row is None or row[0] is not batch or row[1] != j:
            return None
    return batch


@functools.cache
def _layer_bins(g: int, n: int, e: int, device: torch.device) -> torch.Tensor:
    """[g * n]: where the bins of the layer each of g x n concatenated indices belongs to start in
    count_pending's bincount (shifted past its spare bin -1), cached: the same few shapes every
    step."""
    return (torch.arange(g, device=device) * (e + 2) + 1).repeat_interleave(n)


# Router entropy is a mean over tokens: it is taken over a fixed-stride sample of at most this
# many tokens per layer and forward (every token below it). Its cost then stops growing with the
# batch: on the CPU tiny models, 1,024 tokens a step over 4 layers spent ~0.25 ms of the guard's
# step on it, most of the routing statistics' cost. A 256-token mean of a per-token entropy in
# [0, log E] has a standard error of ~1% of its level; loads (the bincount) use every token.
ENTROPY_TOKENS = 256


def count_pending(hooks: list[Any]) -> None:
    """Fold every pending forward of `hooks` into their accumulators. Layers whose pending
    entries all have the same shape and score function (the usual case: one forward, every
    layer routing the same N tokens) are counted in one batch: a stack, one bincount over
    layer-offset indices and one entropy pass, instead of ~14 kernels per layer."""
    todo = [h for h in hooks if getattr(h, "pending", None)]
    if todo:  # every accumulator read lands here: nothing to count is the common case
        with torch.no_grad():
            _count(todo)


def _count(todo: list[Any]) -> None:
    groups: dict[tuple[Any, ...], list[tuple[Any, torch.Tensor, torch.Tensor]]] = {}
    for h in todo:
        for logits_NE, idx in h.pending:
            key = (
                tuple(logits_NE.shape),
                idx.numel(),
                logits_NE.dtype,
                logits_NE.device,
                h.score_func,
                h.n_experts,
            )
            groups.setdefault(key, []).append((h, logits_NE, idx))
        h.pending = []
    for (shape, _, _, device, score_func, e), entries in groups.items():
        g = len(entries)
        stride = -(-shape[0] // ENTROPY_TOKENS)  # ceil: the sample spans the whole batch
        logits_GNE = torch.stack([lg[::stride] if stride > 1 else lg for _, lg, _ in entries])
        idx_X = torch.cat([ix for _, _, ix in entries])  # [g * n]: each layer's n indices in turn
        # Each layer gets E + 2 bins: an index outside 0..E-1 (a dropped token's sentinel) is
        # clamped onto the spare bin at either end of its own layer's range, never counted as an
        # expert of the next layer. Two kernels (clamp, add; in place on the fresh copy) where a
        # mask would take five.
        flat = idx_X.clamp_(-1, e).add_(_layer_bins(g, idx_X.numel() // g, e, device))
        counts_GE = torch.bincount(flat, minlength=g * (e + 2)).view(g, e + 2)[:, 1 : e + 1].float()
        ent_G = score_entropy_sum(logits_GNE, score_func, dims=(1,))
        n_tokens = logits_GNE.shape[1]  # the entropy's tokens: it is normalised by this count
        hooks = [h for h, _, _ in entries]
        if all(h._zeroed for h in hooks) and len({id(h) for h in hooks}) == g:
            # every layer's first forward since its reset: the rows are the accumulators (the
            # usual step: no view per layer until someone reads one)
            batch = CountedBatch(counts_GE, ent_G, n_tokens)
            for j, h in enumerate(hooks):
                h.counted, h._zeroed = (batch, j), False
            continue
        count_G = torch.full((g,), float(n_tokens), device=device)
        for j, h in enumerate(hooks):
            h.take_counted_row()  # counted earlier in this step: add to its row
            if h._zeroed:  # first forward since the reset: take the results (views), no add
                h._tokens_per_expert_E, h._entropy_sum, h._token_count = counts_GE[j], ent_G[j], count_G[j]
                h._zeroed = False
            else:
                h._tokens_per_expert_E.add_(counts_GE[j])
                h._entropy_sum.add_(ent_G[j])
                h._token_count.add_(n_tokens)
