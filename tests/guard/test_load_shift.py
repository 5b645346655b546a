"""The collapse correction on a router without a selection bias (guard/integrations/base.py,
issue #39): the load-shift gradient reaches the collapsed router's weight only, lowers the
overloaded expert's logit where the switch loss's gradient has vanished, is zero on a balanced
layer, and is bounded by the weight's own gradient norm. (On a router that takes a LogitBias the
correction pushes that instead: tests/guard/test_logit_bias.py; here logit_rate = 0.)"""

from __future__ import annotations

import torch
from torch import nn

from guard.integrations.base import AuxGradCorrector, TopKRoutingHook, load_shift_grad_W, switch_loss_grad


class Router(nn.Module):
    """A Mixtral-style top-2 router with a constant +offset on expert 0's logit."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(8, 16) * 0.1)
        self.offset = offset

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = h @ self.weight.T + torch.nn.functional.one_hot(torch.tensor(0), 8) * self.offset
        top, idx = logits.softmax(-1).topk(2, dim=-1)
        return logits, top, idx


def h_mean() -> torch.Tensor:
    """The mean of grads()' inputs (which have a mean direction, as after a norm)."""
    return (torch.randn(256, 16, generator=torch.Generator().manual_seed(1)) + 2.0).mean(0)


def grads(offset: float, boost: float, shift: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    router = Router(offset)
    hook = TopKRoutingHook(router, n_experts=8)
    corr = AuxGradCorrector(hooks={1: hook}, base_coef=1e-2, logit_rate=0.0)  # gradient only
    corr.correct({1: boost} if boost else {}, None, applied=True)
    if not shift and hook.shift is not None:  # the switch-loss boost alone
        hook.shift.remove()
        hook.shift = None
    h = (torch.randn(256, 16, generator=torch.Generator().manual_seed(1)) + 2.0).requires_grad_()
    logits, top, _ = router(h)
    (top.sum() + logits[:, 1:].sum() * 1e-3).backward()  # some gradient reaches the weight
    return router.weight.grad.clone(), h.grad.clone(), logits.detach()


def test_the_shift_lowers_the_hot_experts_logit_where_the_switch_gradient_vanished() -> None:
    w0, h0, logits = grads(10.0, boost=0.0)
    w1, h1, _ = grads(10.0, boost=10.0)
    counts = torch.bincount(logits.softmax(-1).topk(2).indices.reshape(-1), minlength=8)
    assert counts[0] == 256  # collapsed: expert 0 takes every token
    # the switch loss's gradient on the logits is ~0 there (saturated softmax): it cannot move the router
    assert switch_loss_grad(logits, counts).abs().max() < 1e-3
    extra = w1 - w0
    # a descent step along -extra lowers expert 0's logit of the mean input most, and the logits'
    # shifts sum to zero over the experts (softmax-invariant: it moves load, not the scale)
    d_E = extra @ h_mean()
    assert d_E.argmax() == 0 and d_E[0] > 0 and abs(float(d_E.sum())) < 1e-4 * float(d_E.abs().max())
    # bounded: the added part's norm is the weight's own gradient norm (shift_ratio 1)
    assert torch.isclose(extra.norm(), w0.norm(), rtol=1e-2)  # (plus the switch part, ~0 here)
    # the weight alone: the hidden states below get exactly what the switch-loss boost gives them
    _, h_switch, _ = grads(10.0, boost=10.0, shift=False)
    assert torch.equal(h_switch, h1) and torch.allclose(h0, h1, atol=1e-6)


def test_no_shift_on_a_balanced_layer_or_once_the_correction_ends() -> None:
    counts = torch.full((8,), 64)
    assert load_shift_grad_W(counts, torch.randn(256, 16)).abs().max() == 0
    router = Router(0.0)
    hook = TopKRoutingHook(router, n_experts=8)
    corr = AuxGradCorrector(hooks={1: hook}, base_coef=1e-2, logit_rate=0.0)  # gradient only
    corr.correct({1: 10.0}, None, applied=True)
    assert hook.shift is not None and hook.aux_coef == 0.1
    corr.correct({}, None, applied=True)
    assert hook.shift is None and hook.aux_coef == 0.0 and not router._forward_pre_hooks
