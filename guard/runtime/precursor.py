"""Precursor signals on the device: how big each optimizer update was, per optimizer group grad
norms, and (optionally) Adam's second-moment spikes. They ride in the probe's one host copy.

Shapes: P parameters (the probe's order), L blocks, G optimizer parameter groups, S sampled
weights (about N / update_sample_every of the N weights).

Update ratio ||W_t - W_{t-1}|| / ||W_{t-1}||. The update is only known after optimizer.step(),
and a copy of every weight per step to diff against would cost as much memory and bandwidth as
the weights themselves. So the sampler keeps a FIXED strided sample of every parameter (one
weight in `update_sample_every`, a prime so the sample walks across all columns of 2^k-wide
matrices; tensors of at most `full_below` elements whole): an optimizer step pre-hook gathers
the S sampled weights into a preallocated buffer, a post-hook gathers them again, subtracts,
squares, and takes one segmented sum per parameter of (W_new - W_old)^2 and W_old^2, scaled by
numel / samples: 2P numbers held on the device until the next `collect()` ships them with
everything else. The post-hook's sample is the next update's W_old unless something else wrote
the weights in between (their version counters say so), so most steps gather once. Host:
per-layer, per-group and total ratios are bincounts over P. The same
positions every step, so the sampling error is a fixed bias of a few percent (it cancels in a
ratio against the run's own baseline), not step-to-step noise.

Cost per applied update, default settings (S ~ N/61: a sample buffer is about 1.6% of fp32
weights' bytes, 3.3% of bf16's); nothing when the step is skipped. On a GPU: 3S fp32 of memory;
a copy, a gather of S strided weights, a subtract, a square, one segmented sum, one multiply (6
kernels, none as large as the weights). On a CPU: 4S fp32; the same arithmetic in 6 numpy calls
on the buffers' memory (UpdateSampler says why); on the tiny model (guard/integrations/tiny.py
mixtral, 0.87M weights, S = 16,874) ~0.12 ms of the post-hook per step, measured in the step
(bench/overhead/precursor_overhead.py measures the total).

Adam second moments (off by default): at collect time, a gather of `exp_avg_sq` at the same
sampled positions and one segmented sum (~0.1 ms on the CPU tiny model), and on the host each
parameter's bias-corrected mean(v) against its running median over `adam_v_window` steps
(~0.03 ms of numpy medians over window x P).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from guard.core.config import PrecursorConfig


def next_prime(n: int) -> int:
    """The smallest prime >= n (n >= 1; 1 counts as 'every weight')."""
    if n <= 2:
        return max(n, 1)
    while any(n % d == 0 for d in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def strided_views(tensors: list[torch.Tensor], cfg: PrecursorConfig) -> list[torch.Tensor]:
    """A fixed sample of each tensor as a view (so a gather reads its current values): whole when
    it has at most `full_below` elements, else one element in next_prime(update_sample_every).
    A non-contiguous tensor has no flat view (reshape would copy, and a copy goes stale): it is
    left out (an empty view). Parameters and optimizer states are contiguous in practice."""
    stride = next_prime(cfg.update_sample_every)
    out = []
    for t in tensors:
        t = _local(t).detach()
        if t.numel() == 0 or not t.is_contiguous():
            out.append(t.new_zeros(0))
        else:
            flat = t.view(-1)
            out.append(flat if t.numel() <= cfg.full_below else flat[::stride])
    return out


class UpdateSampler:
    """A fixed strided sample of every parameter, diffed across each optimizer.step().

    One way to take the per-parameter sums per device kind (the CPU pays per op, the GPU per
    launch and per byte shipped):
      CPU   two sample buffers that swap roles each update (this update's W_new becomes the
            next one's W_old without a copy); the gather, the subtract, the squares and both
            rows' segmented sums run in numpy on the tensors' memory (np.concatenate of float32
            views and np.add.reduceat: ~2x cheaper in the step than torch's cat, segment_reduce
            and the ops around them, which pay a dispatch each after a backward).
      GPU   the sums stay on the device (the sample is ~N/61 floats, too big to ship each step):
            W_old copied into a [2, S] buffer beside the diff, one segment_reduce over both rows.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        cfg: PrecursorConfig,
        *,
        host_sums: bool | None = None,
    ) -> None:
        """`host_sums`: take the sums the CPU way (default: when the weights are on the CPU)."""
        self.views = strided_views(params, cfg)  # one per parameter (empty when left out)
        self.n_P = [v.numel() for v in self.views]
        self.n_sampled = sum(self.n_P)
        numel = np.array([_local(p).numel() for p in params], dtype=np.float64)
        # numel / samples per parameter: the sums estimate the whole tensor's (for both rows)
        scale = np.where(np.array(self.n_P) > 0, numel / np.maximum(self.n_P, 1), 0.0)
        device = params[0].device if params else torch.device("cpu")
        self.on_host = device.type == "cpu" if host_sums is None else host_sums
        # The sample taken after the last update: the next update's W_old, as long as nothing
        # else wrote the weights since (tracked by their version counters: a rollback, a resume,
        # a user's own in-place change bump them). Saves one gather per step.
        self.last_S = torch.zeros(self.n_sampled, device=device)
        self.buf_2S = torch.zeros(2, self.n_sampled, device=device)  # [new - old, old] (fp32)
        # [(the last sample, its numpy view)], and on the CPU the spare buffer after it
        self._samples: list[tuple[torch.Tensor, np.ndarray | None]] = [(self.last_S, None)]
        self._np_views: list[np.ndarray] | None = None
        if self.on_host:
            self._init_host(scale)
        else:
            self.scale_2P = torch.tensor(np.concatenate([scale, scale]), dtype=torch.float32, device=device)
            # segment lengths for both rows (a segmented sum: one kernel; an index_add would be a
            # serial scatter, per-parameter norms one launch per tensor)
            self.lengths_2P = torch.tensor(self.n_P, device=device).expand(2, len(params)).contiguous()
        self._last_versions: list[int] | None = None
        self._params = params
        self.armed = False  # set by collect(): only updates the probe reports on are sampled
        self.pending: torch.Tensor | None = None  # [2P]: sum dW^2 per parameter, then sum W_old^2
        self._have_old = False
        self._hooks = [
            optimizer.register_step_pre_hook(self._before),
            optimizer.register_step_post_hook(self._after),
        ]

    def _init_host(self, scale_P: np.ndarray) -> None:
        spare_S = torch.zeros_like(self.last_S)  # the next W_new; swaps roles with last_S
        self._samples = [(self.last_S, self.last_S.numpy()), (spare_S, spare_S.numpy())]
        self._sq_2S = self.buf_2S.numpy()  # [dW^2, W_old^2]
        # numpy views of the sample (float32 only: numpy has no bfloat16); else torch.cat gathers
        fp32 = all(v.dtype == torch.float32 for v in self.views)
        self._np_views = [v.numpy() for v in self.views] if fp32 else None
        # reduceat sums [start_i, start_(i+1)): only over the sampled parameters (an empty segment
        # would read its neighbour's first element); the others' sums stay zero
        n_P = np.array(self.n_P)
        sampled = np.flatnonzero(n_P > 0)
        self._sampled_P = None if sampled.size == n_P.size else sampled
        self._starts = np.concatenate([[0], np.cumsum(n_P[sampled])[:-1]]).astype(np.intp)
        self._scale_2X = np.stack([scale_P[sampled]] * 2).astype(np.float32)
        # the result buffer (the probe's concatenation copies it before the next update lands)
        self._pending_2P = self.last_S.new_zeros(2 * n_P.size)
        self._pending_np = self._pending_2P.numpy().reshape(2, n_P.size)

    def _versions(self) -> list[int]:
        return [p._version for p in self._params]

    def _gather(self, into_S: torch.Tensor, into_np: np.ndarray | None) -> None:
        """The current weights at the sampled positions, into a sample buffer (and its numpy view)."""
        if into_np is not None and self._np_views is not None:
            np.concatenate(self._np_views, out=into_np)
        else:
            torch.cat(self.views, out=into_S)

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not (self.armed and self.n_sampled):
            return
        if self._last_versions is None or self._versions() != self._last_versions:
            self._gather(*self._samples[0])  # W_old
        self._have_old = True

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._have_old:
            return
        self._have_old = self.armed = False
        self.pending = self._host_sums() if self.on_host else self._device_sums()
        self._last_versions = self._versions()

    def _host_sums(self) -> torch.Tensor:
        (_, old), new = self._samples
        self._gather(*new)  # W_new: this update's result, the next one's W_old
        self._samples.reverse()
        self.last_S = new[0]
        sq = self._sq_2S
        np.subtract(new[1], old, out=sq[0])
        np.square(sq[0], out=sq[0])
        np.square(old, out=sq[1])
        sums = np.add.reduceat(sq, self._starts, axis=1)
        if self._sampled_P is None:
            np.multiply(sums, self._scale_2X, out=self._pending_np)
        else:  # parameters left out of the sample keep zero sums
            self._pending_np[:, self._sampled_P] = sums * self._scale_2X
        return self._pending_2P

    def _device_sums(self) -> torch.Tensor:
        diff, old = self.buf_2S[0], self.buf_2S[1]
        old.copy_(self.last_S)
        self._gather(self.last_S, None)  # W_new: this update's result, the next one's W_old
        torch.sub(self.last_S, old, out=diff)
        sums = torch.segment_reduce(self.buf_2S.square_(), "sum", lengths=self.lengths_2P, axis=1)
        return sums.reshape(-1).mul_(self.scale_2P)

    def take(self) -> torch.Tensor | None:
        """The last update's [2P] sums (once), or None when no update was sampled since. On the
        CPU a buffer the next update overwrites: copy it (the probe's concatenation does)."""
        out, self.pending = self.pending, None
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


class SecondMoments:
    """Adam's exp_avg_sq per parameter: its bias-corrected mean now against its running median.
    Bias-corrected (v / (1 - beta2^t)) because v starts at zero and grows for its first ~1/(1-beta2)
    steps: against a raw running median every early step would look like a spike. The mean is
    estimated from the same strided sample positions as the update ratio (views into the
    optimizer's state, rebuilt when the optimizer replaces a state tensor, e.g. on a resume)."""

    def __init__(
        self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, cfg: PrecursorConfig
    ) -> None:
        self.params = params
        self.optimizer = optimizer
        self.cfg = cfg
        window = cfg.adam_v_window
        self.numel_P = np.array([max(p.numel(), 1) for p in params], dtype=np.float64)
        where = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.beta2_P = np.array(
            [where[id(p)].get("betas", (0.9, 0.999))[1] if id(p) in where else 0.999 for p in params]
        )
        self.history = np.full((window, len(params)), np.nan)  # ring of per-parameter means
        self.filled = 0
        self.steps = 0  # optimizer steps seen by this probe (the state's own count when on the host)
        self._hook = optimizer.register_step_post_hook(self._count)
        self._src: list[Any] = []  # the state tensors the views below look into
        self._views: list[torch.Tensor] = []

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1

    def _t(self) -> int:
        """Adam's step count t: the state's own (a resumed run) when it is a host tensor; reading a
        device tensor would be a sync, so then the steps this probe counted."""
        for p in self.params:
            st = self.optimizer.state.get(p, {}).get("step")
            if st is not None:
                return int(st) if not isinstance(st, torch.Tensor) or st.device.type == "cpu" else self.steps
        return self.steps

    def device_sums(self) -> torch.Tensor | None:
        """sum(exp_avg_sq) per parameter [P] (estimated from the sample), or None before the
        optimizer has any."""
        state = self.optimizer.state
        vs = [state[p].get("exp_avg_sq") if p in state else None for p in self.params]
        if not any(v is not None for v in vs):
            return None
        if len(vs) != len(self._src) or any(a is not b for a, b in zip(vs, self._src, strict=True)):
            self._rebuild(vs)
        torch.cat(self._views, out=self._buf)
        return torch.segment_reduce(self._buf, "sum", lengths=self._lengths, axis=0).mul_(self._scale)

    def _rebuild(self, vs: list[torch.Tensor | None]) -> None:
        some = next(v for v in vs if v is not None)
        self._src = vs
        self._views = strided_views([v if v is not None else some.new_zeros(0) for v in vs], self.cfg)
        n = np.array([v.numel() for v in self._views])
        numel = np.array([_local(v).numel() if v is not None else 0 for v in vs], dtype=np.float64)
        self._lengths = torch.tensor(n, device=some.device)
        self._scale = torch.tensor(
            np.where(n > 0, numel / np.maximum(n, 1), 0.0), dtype=torch.float32, device=some.device
        )
        self._buf = torch.empty(int(n.sum()), device=some.device)

    def ratio(self, sums_P: np.ndarray) -> float:
        """max over parameters of mean(v_hat) / median of its recent means; NaN while warming up."""
        t = max(self._t(), 1)
        mean_P = sums_P / self.numel_P / (1.0 - self.beta2_P**t)
        w = len(self.history)
        out = math.nan
        if self.filled >= w:  # a full window: early training moves v by 10x in a few steps
            with np.errstate(invalid="ignore", divide="ignore"):
                med = np.median(self.history, axis=0)  # full window: no NaN rows left
                r = np.where(med > 0, mean_P / med, np.nan)
            out = float(np.nanmax(r)) if np.isfinite(r).any() else math.nan
        self.history[self.filled % w] = mean_P
        self.filled += 1
        return out


class Precursors:
    """What the probe adds to its transfer for the precursor signals, and what it derives from it."""

    def __init__(
        self,
        params: list[torch.Tensor],
        segments_P: np.ndarray,
        n_layers: int,
        optimizer: torch.optim.Optimizer,
        cfg: PrecursorConfig,
    ) -> None:
        self.n_params = len(params)
        self.segments_P = segments_P  # block index per parameter (n_layers: outside every block)
        self.n_layers = n_layers
        where = {id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]}
        self.group_P = np.array([where.get(id(p), -1) for p in params], dtype=np.int64)
        self.n_groups = len(optimizer.param_groups)
        self.updates = UpdateSampler(params, optimizer, cfg)
        self.moments = SecondMoments(params, optimizer, cfg) if cfg.adam_v_ratio else None
        self._layout = (0, 0)  # (update sums, second-moment sums) in the last device_part
        # Host side in one bincount: each parameter's dW^2 and W^2 go to its layer's bin (n_layers:
        # outside every block), its group's and the total's; W^2 in a second copy of the bins.
        p_count = len(params)
        grouped = np.flatnonzero(self.group_P >= 0)
        self._n_bins = n_layers + 1 + self.n_groups + 1
        bins_X = np.concatenate(
            [segments_P, n_layers + 1 + self.group_P[grouped], np.full(p_count, self._n_bins - 1)]
        )
        take_X = np.concatenate([np.arange(p_count), grouped, np.arange(p_count)])
        self._bins_2X = np.concatenate([bins_X, bins_X + self._n_bins])
        self._take_2X = np.concatenate([take_X, take_X + p_count])
        # the parameters in an optimizer group (None: all of them, the usual case: no indexing)
        self._grouped = None if grouped.size == p_count else grouped

    def device_part(self, like: torch.Tensor) -> torch.Tensor:
        """This step's precursor numbers as one flat device vector (goes into the probe's single
        copy, and its all-reduce when gradients are sharded), and arms the sampler for this
        step's update."""
        parts = []
        upd = self.updates.take()
        if upd is not None:
            parts.append(upd)
        v = self.moments.device_sums() if self.moments is not None else None
        if v is not None:
            parts.append(v)
        self._layout = (0 if upd is None else 2 * self.n_params, 0 if v is None else self.n_params)
        self.updates.armed = True
        if not parts:
            return like.new_zeros(0)
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(like.device)

    def derive(self, h: np.ndarray, sq_grad_P: np.ndarray) -> dict[str, Any]:
        """StepReport fields from the host copy of device_part (`h`) and the squared grad norms."""
        n_u, n_v = self._layout
        g, n_l = self.n_groups, self.n_layers
        if self._grouped is None:
            gsq = np.bincount(self.group_P, weights=sq_grad_P, minlength=g)
        else:
            gsq = np.bincount(self.group_P[self._grouped], weights=sq_grad_P[self._grouped], minlength=g)
        out: dict[str, Any] = {"group_grad_norm_G": np.sqrt(gsq)}
        if n_u:
            b = self._n_bins
            sums = np.bincount(self._bins_2X, weights=h[self._take_2X], minlength=2 * b)
            ratio = _ratio(sums[:b], sums[b:])  # [layers..., outside, groups..., total]
            out["update_ratio"] = float(ratio[-1])
            out["update_ratio_L"] = ratio[:n_l]
            out["group_update_ratio_G"] = ratio[n_l + 1 : n_l + 1 + g]
        else:
            out["update_ratio"] = math.nan
            out["update_ratio_L"] = np.full(n_l, math.nan)
            out["group_update_ratio_G"] = np.full(g, math.nan)
        out["adam_v_ratio"] = (
            self.moments.ratio(h[n_u : n_u + n_v]) if self.moments is not None and n_v else math.nan
        )
        return out

    def close(self) -> None:
        self.updates.close()
        if self.moments is not None:
            self.moments._hook.remove()


def _ratio(d_sq: np.ndarray, w_sq: np.ndarray) -> np.ndarray:
    """sqrt(sum dW^2 / sum W^2), NaN where the weights are all zero (nothing to be relative to)."""
    out = np.full_like(d_sq, math.nan)
    with np.errstate(invalid="ignore"):  # inf / inf: weights that overflowed
        np.divide(d_sq, w_sq, out=out, where=w_sq > 0)
    return np.sqrt(out, out=out)
