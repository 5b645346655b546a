"""The selection bias a collapse correction pushes on a router without one (LogitBias in
guard/integrations/router_push.py, issue #39): a no-op at bias 0, the router's own weights at the ids
it selects, a collapsed layer balanced within a few dozen pushes, bounded, never installed on a
layer that was not corrected, still balancing once the correction ends (logit_hold), refused on
a router whose output it cannot reproduce (which keeps the load-shift gradient), and kept across
a checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from guard.integrations.base import AuxGradCorrector, LogitBias, TopKRoutingHook


class Router(nn.Module):
    """A top-2 softmax router of 8 experts with a constant +offset on expert 0's logit."""

    def __init__(self, offset: float = 10.0, renorm: bool = True, score: str = "softmax") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(8, 16) * 0.3)
        self.offset, self.norm_topk_prob, self.score = offset, renorm, score

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = h @ self.weight.T + nn.functional.one_hot(torch.tensor(0), 8) * self.offset
        p = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        top, idx = p.topk(2, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return logits, top, idx


def inputs(seed: int = 1) -> torch.Tensor:
    return torch.randn(512, 16, generator=torch.Generator().manual_seed(seed))


def load(idx: torch.Tensor) -> torch.Tensor:
    return torch.bincount(idx.reshape(-1), minlength=8).float()


def maxvio(n: torch.Tensor) -> float:
    return float(n.max() / n.mean() - 1)


def test_no_change_at_bias_zero_and_a_bias_term_on_the_logits_once_pushed() -> None:
    for renorm in (True, False):
        router = Router(renorm=renorm)
        h = inputs()
        ref = router(h)
        lb = LogitBias(router, n_experts=8)
        out = router(h)
        assert lb.usable and lb.renorm is renorm
        assert all(torch.equal(a, b) for a, b in zip(ref, out, strict=True))
        lb.bias_E[0] = -10.0  # cancels the offset: the router it would be without it
        logits, w, idx = router(h)
        plain = Router(offset=0.0, renorm=renorm)(h)
        assert torch.allclose(logits, plain[0], atol=1e-5) and torch.allclose(w, plain[1], atol=1e-5)
        assert torch.equal(idx.sort(-1).values, plain[2].sort(-1).values)
        w.sum().backward()  # the weights still carry the router's gradient
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_selection_only_picks_with_the_bias_and_weighs_with_the_routers_own_scores() -> None:
    router = Router()
    h = inputs()
    ref = router(h)
    lb = LogitBias(router, n_experts=8, selection_only=True)
    lb.bias_E[0] = -10.0
    logits, w, idx = router(h)
    assert torch.equal(logits, ref[0])  # the logits (aux loss, entropy) are untouched
    p = logits.softmax(-1).gather(-1, idx)
    assert torch.allclose(w, p / p.sum(-1, keepdim=True))
    assert torch.equal(idx, (logits + lb.bias_E).topk(2, dim=-1).indices)


def test_a_collapsed_router_is_balanced_within_30_pushes_and_stays_bounded() -> None:
    router = Router(offset=10.0)
    lb = LogitBias(router, n_experts=8)
    n = load(router(inputs())[2])
    assert n[0] == 512 and maxvio(n) > 2.9  # every token on expert 0
    seen = []
    for step in range(60):
        n = load(router(inputs(step))[2])  # a fresh batch each step
        seen.append(maxvio(n))
        lb.push(n, rate=0.1, bound=4.0)
        assert float(lb.bias_E.abs().max()) <= 4.0 * float(lb.scale) + 1e-5  # the first push's spread
    first = next(i for i, v in enumerate(seen) if v < 1.0)
    assert first <= 30, seen
    assert max(seen[first + 10 :]) < 1.0, seen  # and stays balanced: the steps shrink on flips


def test_a_balanced_router_keeps_its_bias_near_zero() -> None:
    router = Router(offset=0.0)
    lb = LogitBias(router, n_experts=8)
    for step in range(50):
        lb.push(load(router(inputs(step))[2]), rate=0.1, bound=4.0)
    assert float(lb.bias_E.abs().max()) < 0.5 * float(lb.scale)


def test_a_router_it_cannot_reproduce_is_left_alone() -> None:
    router = Router(score="sigmoid", renorm=False)
    h = inputs()
    ref = router(h)
    lb = LogitBias(router, n_experts=8)
    lb.bias_E[0] = -10.0
    out = router(h)
    assert lb.usable is False and all(torch.equal(a, b) for a, b in zip(ref, out, strict=True))
    lb.push(torch.tensor([512.0] + [0.0] * 7), rate=0.1, bound=4.0)
    assert lb.bias_E[0] == -10.0  # no push either


def test_only_a_corrected_layer_gets_a_bias_which_outlives_the_correction_and_a_checkpoint() -> None:
    routers = {1: Router(offset=10.0), 2: Router(offset=0.0)}
    hooks = {k: TopKRoutingHook(r, n_experts=8) for k, r in routers.items()}
    corr = AuxGradCorrector(hooks=hooks, base_coef=1e-2)
    for step in range(20):
        outs = {k: r(inputs(step)) for k, r in routers.items()}
        loads = torch.stack([load(outs[k][2]) for k in corr.order])
        corr.correct({1: 10.0}, loads, applied=True)
    assert set(corr.logit_bias) == {1} and corr.logit_bias[1].bias_E[0] < -1.0
    b = corr.logit_bias[1].bias_E.clone()
    corr.correct({}, loads * 0 + 64.0, applied=True)  # recovered: the correction ends, the bias stays
    assert hooks[1].shift is None and hooks[1].aux_coef == 0.0 and set(corr.logit_bias) == {1}
    assert torch.allclose(corr.logit_bias[1].bias_E, b)  # a balanced load: no push
    # ... and keeps balancing (logit_hold): a load drifting back onto expert 0 lowers its bias
    corr.correct({}, loads * 0 + torch.tensor([120.0] + [56.0] * 7), applied=True)
    assert corr.logit_bias[1].bias_E[0] < b[0] and 2 not in corr.logit_bias
    b = corr.logit_bias[1].bias_E.clone()
    corr.logit_hold = False  # frozen once the correction ends
    corr.correct({}, loads * 0 + torch.tensor([120.0] + [56.0] * 7), applied=True)
    assert torch.equal(corr.logit_bias[1].bias_E, b)
    state = corr.state_dict()
    again = AuxGradCorrector(hooks={k: TopKRoutingHook(Router(), n_experts=8) for k in (1, 2)})
    again.load_state_dict(state)
    assert set(again.logit_bias) == {1} and torch.equal(again.logit_bias[1].bias_E, b)
    mine, theirs = corr.logit_bias[1], again.logit_bias[1]  # the push resumes where it was
    assert float(theirs.scale) == float(mine.scale) and torch.equal(theirs.step_E, mine.step_E)
    assert torch.equal(theirs.sign_E, mine.sign_E)
    corr.remove()
    assert all(len(r._forward_hooks) == 1 for r in routers.values())  # the counting hooks only


def test_a_router_that_takes_the_bias_gets_no_load_shift_and_one_that_cannot_does() -> None:
    ok, sig = Router(), Router(score="sigmoid", renorm=False)
    hooks = {1: TopKRoutingHook(ok, n_experts=8), 2: TopKRoutingHook(sig, n_experts=8)}
    corr = AuxGradCorrector(hooks=hooks, base_coef=1e-2)
    corr.correct({1: 10.0, 2: 10.0}, None, applied=True)
    assert hooks[1].shift is None and hooks[2].shift is None  # both not yet checked
    ok(inputs())
    sig(inputs())
    corr.correct({1: 10.0, 2: 10.0}, None, applied=True)
    assert corr.logit_bias[1].usable and hooks[1].shift is None
    assert corr.logit_bias[2].usable is False and hooks[2].shift is not None  # gradient only
