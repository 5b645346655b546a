"""Max attention logit per layer, on the device: Kimi K2's QK-clip signal, as a precursor.

Shapes: B batch, H query heads, G key/value heads (H = G * r, grouped-query attention), T query
positions, S key positions, K head dim, W watched layers.

    S_max(layer) = max over sequences b, heads h and allowed pairs (i, j) of  scale * q_i^h . k_j^h

with the q and k the attention itself uses (after RoPE and any q/k norm), `scale` its softmax
scale (1/sqrt(K) by default) and "allowed" its mask (causal: j <= i). MuonClip (Kimi K2) clips a
head's W_q, W_k after every step where this passes tau = 100; logits that grow without bound
saturate the softmax (one key takes all the attention) and came before their loss spikes.

SDPA and flash attention never materialise the logits, so computing them is extra work: a
B*H*T*S*K matmul per layer. The cost is bounded three ways: only every `max_logit_every`-th step
(PrecursorConfig; the sampler arms the watches for that step's forward, nothing runs otherwise),
under no_grad, from the q and k the layer already holds (no projection is recomputed), over the
first `max_logit_seqs` sequences of each micro-batch, in row chunks of at most CHUNK_ELEMS fp32
logits. Each watch keeps a running max in a 0-d device buffer (micro-batches fold in); at the
probe's collect the sampler stacks the W buffers into the probe's one host copy (with several
ranks: one MAX all-reduce of W numbers on sampled steps) and resets them. Off-sample steps add
nothing to the transfer.

How a layer is watched: its attention forward calls `watch.observe(q, k, scale, mask)` when
`watch.armed` (moeguard's trainer/model.py Attention does; guard/integrations/transformers.py
wraps the model's attention function with `attach(model, watch_logits=True)`). The probe finds
every LogitWatch inside each of its layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

CHUNK_ELEMS = 1 << 24  # fp32 logits materialised at once (64 MiB): a long sequence goes in row chunks


@torch.no_grad()
def max_logit(
    q_BHTK: torch.Tensor,
    k_BGSK: torch.Tensor,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    n_seqs: int = 0,
    chunk_elems: int = CHUNK_ELEMS,
) -> torch.Tensor:
    """The largest allowed attention logit (0-d fp32 on q's device).

    `mask`: None for causal attention (key j <= query i + S - T); else a bool mask (True: attend)
    or an additive float mask, broadcastable to [B, 1 or H, T, S], as attention functions take
    it. `n_seqs`: only the first n sequences (0: all). -inf when nothing is allowed."""
    B, H, T, K = q_BHTK.shape
    G, S = k_BGSK.shape[1], k_BGSK.shape[2]
    if H % G:
        raise ValueError(f"max_logit: {H} query heads is not a multiple of {G} key heads")
    n = B if n_seqs <= 0 else min(n_seqs, B)
    r = H // G
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    # the r query heads that share one key head as rows of one matmul: [n, G, r*T, K]
    q = q_BHTK[:n].float().reshape(n, G, r * T, K)
    k_nGKS = k_BGSK[:n].float().transpose(-1, -2)
    rows = max(1, min(r * T, chunk_elems // max(1, n * G * S)))
    best = q.new_full((), -math.inf)
    for lo in range(0, r * T, rows):
        hi = min(r * T, lo + rows)
        s = torch.matmul(q[:, :, lo:hi], k_nGKS).mul_(scale)  # [n, G, hi-lo, S]
        row_R = torch.arange(lo, hi, device=q.device)
        if mask is None:  # causal; the query at position t sees keys up to t + (S - T)
            allowed = torch.arange(S, device=q.device)[None, :] <= (row_R % T)[:, None] + (S - T)
            s = s.masked_fill_(~allowed, -math.inf)
        else:
            s = _apply_mask(s, mask[:n] if mask.dim() == 4 and mask.shape[0] > 1 else mask, row_R, r, T)
        best = torch.maximum(best, s.amax())
    return best


def _apply_mask(
    s_nGRS: torch.Tensor, mask: torch.Tensor, row_R: torch.Tensor, r: int, T: int
) -> torch.Tensor:
    """A [b, 1 or H, T, S] attention mask on a chunk of rows of the grouped logits (row_R: the
    chunk's row indices into r*T; row rho of key group g is query head g*r + rho // T at
    position rho % T)."""
    m = mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    t_R = row_R % T
    if m.shape[1] == 1:  # one mask for every head
        m_R = m[:, :, t_R]  # [b, 1, R, S]
    else:
        G = s_nGRS.shape[1]
        head_GR = torch.arange(G, device=row_R.device)[:, None] * r + (row_R // T)[None, :]
        m_R = m[:, head_GR, t_R[None, :].expand_as(head_GR)]  # [b, G, R, S]
    if m_R.dtype == torch.bool:
        return s_nGRS.masked_fill_(~m_R, -math.inf)
    return s_nGRS.add_(m_R.float())


class LogitWatch(nn.Module):
    """The running max attention logit of one attention layer since the sampler last read it.

    The attention forward calls `observe` only while `armed` (one bool test otherwise). A module,
    so `.to(device)` moves its buffer with the model; the buffer is not persistent (no state_dict
    entry, checkpoints unchanged) and it has no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.n_seqs = 1  # set by the sampler from PrecursorConfig.max_logit_seqs
        self.register_buffer("max_logit", torch.tensor(-math.inf), persistent=False)

    @torch.no_grad()
    def observe(
        self,
        q_BHTK: torch.Tensor,
        k_BGSK: torch.Tensor,
        scale: float | None = None,
        mask: torch.Tensor | None = None,
    ) -> None:
        """Fold this forward's max logit into the running max (no autograd, no host sync)."""
        m = max_logit(q_BHTK.detach(), k_BGSK.detach(), scale=scale, mask=mask, n_seqs=self.n_seqs)
        torch.maximum(self.max_logit, m.to(self.max_logit), out=self.max_logit)


def find_watches(layers: list[nn.Module]) -> list[tuple[int, LogitWatch]]:
    """(layer index, watch) for every LogitWatch inside each layer (the first one of a layer)."""
    out = []
    for i, layer in enumerate(layers):
        w = next((m for m in layer.modules() if isinstance(m, LogitWatch)), None)
        if w is not None:
            out.append((i, w))
    return out


class MaxLogitSampler:
    """Arms the watches for every `every`-th step's forward and ships their maxima in the probe's
    transfer: [W] on a sampled step, nothing otherwise. Steps are counted in collects (a rerun's
    recompute counts as one)."""

    def __init__(
        self,
        watches: list[tuple[int, LogitWatch]],
        n_layers: int,
        *,
        every: int,
        n_seqs: int,
        all_reduce: Callable[..., Any],
    ) -> None:
        if every < 1:
            raise ValueError(f"max_logit_every = {every}: the sampler needs >= 1 (0 means no sampler)")
        self.watches = [w for _, w in watches]
        self.layer_W = np.array([i for i, _ in watches], dtype=np.int64)
        self.n_layers = n_layers
        self.every = every
        self.all_reduce = all_reduce
        self.collects = 0
        for w in self.watches:
            w.n_seqs = n_seqs
        self._arm(True)  # the first step is sampled
        self._sampled = False  # whether the last device_part carried a sample

    def _arm(self, on: bool) -> None:
        for w in self.watches:
            w.armed = on

    def device_part(self, like: torch.Tensor) -> torch.Tensor:
        """This step's [W] maxima (MAX-reduced across ranks) when it was sampled, else empty;
        resets the watches and arms them for the next sampled step."""
        self._sampled = bool(self.watches) and self.watches[0].armed
        out = like.new_zeros(0)
        if self._sampled:
            out = torch.stack([w.max_logit for w in self.watches]).float().to(like.device)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                self.all_reduce(out, op=dist.ReduceOp.MAX)
            for w in self.watches:
                w.max_logit.fill_(-math.inf)
        self.collects += 1
        self._arm(self.collects % self.every == 0)
        return out

    @property
    def n_values(self) -> int:
        """How many numbers the last device_part added to the transfer."""
        return len(self.watches) if self._sampled else 0

    def derive(self, h: np.ndarray) -> dict[str, Any]:
        """StepReport fields: max_logit_L (NaN where a layer has no watch, ran no attention, or the
        step was not sampled) and max_logit, the max over layers."""
        out_L = np.full(self.n_layers, math.nan)
        if self._sampled:
            vals = np.where(np.isfinite(h[: len(self.watches)]), h[: len(self.watches)], math.nan)
            np.fmax.at(out_L, self.layer_W, vals)
        top = float(np.nanmax(out_L)) if np.isfinite(out_L).any() else math.nan
        return {"max_logit_L": out_L, "max_logit": top}

    def close(self) -> None:
        self._arm(False)
