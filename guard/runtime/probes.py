"""RouterProbe: MoE routing statistics from ANY router, via a forward hook on its gate.

Attach it to the module that produces router logits of shape [..., E] (Mixtral's and
DeepSeek's `gate`, an `nn.Linear`, or any module; `output_index` picks the logits out of a
tuple output). It keeps device-side accumulators with the same names moeguard's own Router
uses (tokens_per_expert_E, entropy_sum, token_count, expert_bias_E), so the Probe reads both
the same way and still makes one host copy per step:

    probes = [RouterProbe(layer.block_sparse_moe.gate, n_experts=8, top_k=2)
              for layer in model.model.layers]

If the implementation selects experts with a bias (aux-loss-free balancing), pass that bias
tensor as `bias` so the probe's top-k agrees with the model's.

This probe RE-DERIVES top-k from the logits, so it is right only for plain softmax/sigmoid top-k
routers: grouped routing or renormalised selection makes it count wrongly. For transformers and
torchtitan models use guard.integrations (they read what the router chose); keep this for a
custom gate that outputs logits alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from guard.runtime.routing import RoutingCounters


class RouterProbe(RoutingCounters):
    def __init__(
        self,
        gate: nn.Module,
        *,
        n_experts: int,
        top_k: int,
        score_func: str = "softmax",
        output_index: int | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func = {score_func!r}: must be 'softmax' or 'sigmoid'")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k = {top_k}: must be in 1..n_experts ({n_experts})")
        super().__init__(gate, n_experts)
        self.top_k = top_k
        self.score_func = score_func
        self.output_index = output_index
        self.bias = bias
        self.expert_bias_E = bias if bias is not None else torch.zeros_like(self.tokens_per_expert_E)

    @torch.no_grad()
    def _hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        logits = output[self.output_index] if self.output_index is not None else output
        if logits.shape[-1] != self.n_experts:
            raise ValueError(
                f"RouterProbe: gate output has {logits.shape[-1]} experts in its last dim, "
                f"expected n_experts = {self.n_experts} (set output_index for tuple outputs)"
            )
        x_NE = logits.detach().reshape(-1, self.n_experts).float()
        if self.score_func == "softmax":
            p_NE = x_NE.softmax(-1)
        else:
            s = x_NE.sigmoid()
            p_NE = s / s.sum(-1, keepdim=True).clamp_min(1e-12)
        sel = p_NE + self.expert_bias_E if self.bias is not None else p_NE
        idx = sel.topk(self.top_k, dim=-1).indices.reshape(-1)
        self.tokens_per_expert_E.index_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))
        self.entropy_sum.add_(-(p_NE * p_NE.clamp_min(1e-12).log()).sum())
        self.token_count.add_(x_NE.shape[0])

    def update_bias(
        self, load_E: torch.Tensor, rate_scale: float = 1.0, bias_max: float | None = None
    ) -> None:
        """Third-party routers own their balancing; the probe only observes."""
