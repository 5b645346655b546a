"""The two pushes an aux-loss-balanced router without a bias of its own (Mixtral, Qwen2/3-MoE,
OLMoE, GPT-OSS) gets while AuxGradCorrector corrects its layer (guard/integrations/base.py):

  LoadShift   the load-shift gradient on the router's weight, bounded by the weight's own
              gradient norm, on its way to the optimizer;
  LogitBias   a bounded per-expert bias on the router's logits (aux-loss-free balancing, as
              DeepSeek-V3's expert bias and Trinity's SMEBU), which acts on the next forward.

Shapes: N tokens, E experts, D the router's input width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def load_shift_grad_W(counts_E: torch.Tensor, h_ND: torch.Tensor) -> torch.Tensor:
    """[E, D]: a gradient for a bias-free router's weight that lowers every token's logit of an
    overloaded expert and raises an underloaded one's along the mean router input:
    (f_e - 1/E) x mean_t h_t, f = this forward's assignment shares. Zero on a balanced layer,
    mean-free over experts (softmax-invariant). It is what a selection bias's update would do,
    in weight space: unlike the switch loss's gradient p * (f - p.f) it does not vanish when the
    softmax saturates (a router sending every token to one expert with p ~ 1, e.g. a logit 10
    above the rest), and it reaches the router's weight only, never the hidden states below it
    (issue #39: through the logits it raised earlier layers' gradients 50x and was skipped)."""
    e = counts_E.numel()
    f_E = counts_E.float() / counts_E.sum().clamp_min(1.0)
    return (f_E - 1.0 / e).unsqueeze(1) * h_ND.detach().float().mean(0).unsqueeze(0)


class LoadShift:
    """The load-shift gradient (load_shift_grad_W) on one router's weight while a correction is
    open: a forward pre-hook keeps the router's input, the routing hook's record() turns it and
    the ids into the [E, D] gradient, and a hook on the weight adds it, scaled to `ratio` x the
    norm of the weight's own gradient, on its way to the optimizer (so DDP reduces it with the
    rest). Bounded that way it never dominates the layer's gradient norm (no spike verdict, no
    clipping of the other weights) while Adam, which normalises per element, still moves the
    weight along it at about its learning rate."""

    def __init__(self, router: nn.Module, weight: torch.Tensor, ratio: float) -> None:
        self.weight, self.ratio = weight, ratio
        self.pending: torch.Tensor | None = None
        self._h: torch.Tensor | None = None
        self._handles = [
            router.register_forward_pre_hook(self._keep_input),
            weight.register_hook(self._add),
        ]

    def _keep_input(self, module: nn.Module, args: tuple) -> None:
        self._h = next((a for a in args if isinstance(a, torch.Tensor)), None)

    def record(self, idx: torch.Tensor, n_experts: int) -> None:
        if self._h is None or self._h.shape[-1] != self.weight.shape[1]:
            return
        with torch.no_grad():
            counts_E = torch.bincount(idx.reshape(-1), minlength=n_experts)[:n_experts]
            g_ED = load_shift_grad_W(counts_E, self._h.reshape(-1, self._h.shape[-1]))
        self.pending = g_ED if self.pending is None else self.pending + g_ED
        self._h = None

    def _add(self, g: torch.Tensor) -> torch.Tensor:
        if self.pending is None or self.pending.shape != g.shape:
            return g
        extra, self.pending = self.pending, None
        scale = self.ratio * g.detach().float().norm() / extra.norm().clamp_min(1e-12)
        return g + (extra * scale).to(g.dtype)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _rank_mean(x: torch.Tensor) -> torch.Tensor:
    """x averaged over the default process group's ranks (x itself on one process)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        n = torch.distributed.get_world_size()
        if n > 1:
            torch.distributed.all_reduce(x)
            x /= n
    return x


class LogitBias:
    """A bias term on one bias-free softmax top-k router's logits: aux-loss-free balancing
    (DeepSeek-V3's expert bias, Trinity's SMEBU) for a family that has no bias of its own
    (Mixtral, Qwen2/3-MoE, OLMoE), pushed only while a layer is corrected (AuxGradCorrector). A
    forward hook on the router (prepended, so the counting hook and the family's own router-logit
    capture see its output) returns logits + bias_E and the top-k ids and weights of their
    softmax (renormalised when the router renormalises): the router it would be with a bias in its
    linear layer, e.g. a constant offset on one expert's logit cancelled. `selection_only` is
    DeepSeek-V3's form instead (the bias picks the ids, the router's unbiased scores weigh them,
    the logits are left alone); on a saturated softmax it leaves the re-routed tokens' weights at
    ~e^-offset (Qwen3 does not renormalise), so it is not the default.

    A push (one per applied step of the correction, from the step's per-expert load): the
    direction is sign((mean - n) / mean), mean-centred; each expert's step starts at rate x the
    layer's logit spread (per token std over experts, mean over tokens, of the forward before the
    first push, averaged over the ranks: a softmax router's logits have no fixed scale), grows x1.2 while its direction holds and halves
    when it flips (Rprop: fast from a far collapse, no limit cycle near balance, still on a noisy
    balanced load), capped at one spread; the bias is mean-centred and clamped to |b| <= bound
    spreads. It acts on the next forward, where a gradient on the weight moves a logit by about
    the learning rate a step (a +10 offset: 96-195 steps, issue #39). Only a corrected layer is
    ever pushed; the bias stays when the correction ends (the cause it offsets may stay), and a
    later correction pushes it again, either way.

    The first hooked forward checks that the router's output is this reconstruction at bias 0
    (the same ids, the same weights); a router whose output is not (another score function, a
    null expert, grouped routing) is left untouched (`usable` False) and the correction stays
    gradient-only. At bias 0 the hook returns nothing: the router's own output, exactly."""

    def __init__(
        self,
        router: nn.Module,
        *,
        n_experts: int,
        logits_at: int = 0,
        weights_at: int = 1,
        ids_at: int = 2,
        selection_only: bool = False,
    ) -> None:
        device = next((p.device for p in router.parameters()), torch.device("cpu"))
        self.n_experts = n_experts
        self.at = (logits_at, weights_at, ids_at)
        self.bias_E = torch.zeros(n_experts, device=device)
        self.spread = torch.zeros((), device=device)
        norm = getattr(router, "norm_topk_prob", None)
        self.renorm: bool | None = None if norm is None else bool(norm)
        self.usable: bool | None = None  # checked on the first forward
        self.selection_only = selection_only
        # per-expert step (logit units) and the last step's direction (push); the unit of both
        # and of the bound: the logit spread at the first push, the same on every rank (the
        # loads the pushes follow are reduced, so every rank's bias is the same)
        self.step_E: torch.Tensor | None = None
        self.sign_E: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self._handle = router.register_forward_hook(self._hook, prepend=True)

    def _check(self, probs: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> bool:
        k = idx.shape[-1]
        top, sel = probs.topk(k, dim=-1)
        if not torch.equal(sel.sort(-1).values, idx.sort(-1).values.to(sel.dtype)):
            return False
        got = w.detach().float().gather(-1, idx.argsort(-1))  # both in expert-id order
        top = top.gather(-1, sel.argsort(-1))
        err = {
            r: float((got - (top / top.sum(-1, keepdim=True) if r else top)).abs().max())
            for r in (True, False)
        }
        if self.renorm is None:  # no attribute says: the closer form (a tie: renormalised)
            self.renorm = err[True] <= err[False]
        return err[self.renorm] <= 1e-3 * max(1.0, float(got.abs().max()))

    def _hook(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        la, wa, ia = self.at
        if self.usable is False or not isinstance(output, tuple | list) or len(output) <= max(self.at):
            return None
        logits, w, idx = output[la], output[wa], output[ia]
        if not isinstance(w, torch.Tensor) or idx.dtype.is_floating_point:
            self.usable = False
            return None
        x_NE = logits.reshape(-1, self.n_experts)
        probs = x_NE.float().softmax(-1)
        idx_NK = idx.reshape(x_NE.shape[0], -1)
        if self.usable is None:
            self.usable = idx_NK.shape[0] == x_NE.shape[0] and self._check(
                probs.detach(), w.reshape(idx_NK.shape), idx_NK
            )
            if not self.usable:
                return None
        with torch.no_grad():
            xs = x_NE.detach().float()
            self.spread = xs.std(-1).mean() if xs.shape[0] else self.spread
            if not bool(self.bias_E.any()):  # bias 0: the router's own output, exactly
                return None
        out = list(output)
        k = idx_NK.shape[-1]
        if self.selection_only:  # DeepSeek-V3's form: the bias picks, the unbiased scores weigh
            with torch.no_grad():
                sel = (xs + self.bias_E).topk(k, dim=-1).indices
            top = probs.gather(-1, sel)
        else:  # a bias term on the router's logits: selection, weights and the logits it returns
            xb_NE = x_NE + self.bias_E.to(x_NE.dtype)
            top, sel = xb_NE.float().softmax(-1).topk(k, dim=-1)
            out[la] = xb_NE.reshape(logits.shape)
        if self.renorm:
            top = top / top.sum(-1, keepdim=True)
        out[wa] = top.to(w.dtype).reshape(w.shape)
        out[ia] = sel.to(idx.dtype).reshape(idx.shape)
        return tuple(out) if isinstance(output, tuple) else out

    @torch.no_grad()
    def push(
        self,
        load_E: torch.Tensor,
        *,
        rate: float,
        bound: float,
        kappa: float = 2.0,
        grow: float = 1.2,
        shrink: float = 0.5,
    ) -> None:
        """One bounded balancing step from this step's per-expert load (see the class docstring)."""
        if not self.usable:
            return
        n_E = load_E.detach().to(self.bias_E.device, torch.float32)
        mean = n_E.mean().clamp_min(1e-12)
        d_E = torch.tanh(kappa * (mean - n_E) / mean)
        sign_E = torch.sign(d_E - d_E.mean())
        if self.scale is None:  # once: the spread, averaged over the ranks (their biases agree)
            self.scale = _rank_mean(self.spread.float().clone())
        s = self.scale
        if self.step_E is None:
            self.step_E, self.sign_E = torch.full_like(d_E, rate) * s, sign_E
        agree = sign_E * self.sign_E
        self.step_E = torch.where(
            agree > 0, self.step_E * grow, torch.where(agree < 0, self.step_E * shrink, self.step_E)
        )
        self.step_E = torch.minimum(torch.maximum(self.step_E, 1e-3 * rate * s), s)
        self.sign_E = sign_E
        self.bias_E.add_(self.step_E * sign_E)
        self.bias_E.sub_(self.bias_E.mean())
        self.bias_E.copy_(torch.maximum(torch.minimum(self.bias_E, bound * s), -bound * s))

    def remove(self) -> None:
        self._handle.remove()
