"""The torchtitan adapter itself: attach (MoECounters over torchtitan's own counters, the bias
corrector), force_collapse, and OptimizersView (the guard's view of torchtitan's optimizer
container). The package's docstring (__init__.py) explains it; __init__.py re-exports every public
name, and trainer.py (GuardedTrainer) imports from here, not from the package, so the package's
lazy GuardedTrainer and the trainer form no import circle.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from guard.integrations.base import Attachment, BiasCorrector, score_entropy_sum


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # this rank's part of a DTensor


def _recomputed(block: nn.Module) -> bool:
    """Full activation checkpointing re-runs forward in backward and counts every token twice;
    torchtitan's own hook halves the counts then, and so do we (same test as torchtitan's)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    return getattr(block, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT


class MoECounters:
    """RoutingSource over one torchtitan MoE: its own counter, its own bias, our entropy."""

    def __init__(self, block: nn.Module, moe: nn.Module) -> None:
        self.block, self.moe = block, moe
        self.score_func = str(moe.router.score_func)  # scores_BLE are softmax(logits) or sigmoid(logits)
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"{type(moe.router).__name__}: unknown score_func {self.score_func!r}")
        device = _local(moe.tokens_per_expert_E).device
        self.entropy_sum = torch.zeros((), device=device)
        self.token_count = torch.zeros((), device=device)
        self._handle = moe.router.register_forward_hook(self._hook)

    @property
    def tokens_per_expert_E(self) -> torch.Tensor:  # noqa: N802 - the contract's name
        # Read live: torchtitan re-creates the buffer in init_weights / to_empty.
        t = _local(self.moe.tokens_per_expert_E)
        return t // 2 if _recomputed(self.block) else t

    @property
    def expert_bias_E(self) -> torch.Tensor:  # noqa: N802
        b = getattr(self.moe, "expert_bias_E", None)
        return _local(b) if isinstance(b, torch.Tensor) else torch.zeros_like(self.tokens_per_expert_E)

    def _hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if not module.training:  # torchtitan counts training forwards only; so do we
            return
        scores = _local(output[2]).detach()
        scores_NE = scores.reshape(-1, scores.shape[-1]).float()
        # The score distribution is scores / sum(scores) for both functions (softmax scores sum to
        # 1), i.e. softmax(log scores): what score_entropy_sum gives for the transformers adapters.
        with torch.no_grad():
            self.entropy_sum.add_(score_entropy_sum(scores_NE.clamp_min(1e-30).log(), "softmax"))
            self.token_count.add_(scores_NE.shape[0])

    def reset_stats(self) -> None:
        """Our own accumulators only; torchtitan's counter belongs to its hook and after_step."""
        self.entropy_sum.zero_()
        self.token_count.zero_()

    def remove(self) -> None:
        self._handle.remove()


def blocks_of(model_or_parts: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The transformer blocks of a torchtitan model (or of its pipeline parts), in order."""
    parts = [model_or_parts] if isinstance(model_or_parts, nn.Module) else list(model_or_parts)
    blocks: list[nn.Module] = []
    for part in parts:
        layers = getattr(part, "layers", None)
        if not isinstance(layers, nn.ModuleDict | nn.ModuleList):
            raise ValueError(f"{type(part).__name__}: no `layers` ModuleDict (not a torchtitan decoder)")
        blocks += list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    return blocks


def _moe_of(block: nn.Module) -> nn.Module | None:
    moe = getattr(block, "moe", None)
    if getattr(block, "moe_enabled", moe is not None) and isinstance(moe, nn.Module):
        if isinstance(getattr(moe, "tokens_per_expert_E", None), torch.Tensor) and hasattr(moe, "router"):
            return moe
    return None


def attach(
    model_or_parts: nn.Module | Sequence[nn.Module], *, bias_rate: float = 1e-3, bias_max: float = 1.0
) -> Attachment:
    """Read every MoE layer of a torchtitan model (call after parallelize_fn/init_weights).
    Layer ids are block positions. Raises ValueError naming the class when there is no MoE.

    bias_rate / bias_max: the guard's bounded push on `expert_bias_E` of a collapsing layer.
    """
    blocks = blocks_of(model_or_parts)
    found = [(i, MoECounters(b, m)) for i, b in enumerate(blocks) if (m := _moe_of(b)) is not None]
    if not found:
        names = type(model_or_parts).__name__ if isinstance(model_or_parts, nn.Module) else "model parts"
        raise ValueError(
            f"{names}: no MoE layer in its {len(blocks)} blocks (looked for `moe_enabled` blocks "
            f"with a `.moe` holding `tokens_per_expert_E` and a `router`, as torchtitan's MoE has)"
        )
    biased = [src for _, src in found if isinstance(getattr(src.moe, "expert_bias_E", None), torch.Tensor)]
    corrector = None
    if len(biased) == len(found):  # load_balance_coeff set (torchtitan requires it on all or none)
        corrector = BiasCorrector(
            biases={i: (lambda s=s: s.expert_bias_E) for i, s in found},
            order=[i for i, _ in found],
            lam=bias_rate,
            bias_max=bias_max,
        )

    def after_step(applied: bool) -> None:
        for _, src in found:  # see the module docstring: zeroed after every step
            src.moe.tokens_per_expert_E.zero_()

    moe0 = found[0][1].moe
    part = model_or_parts if isinstance(model_or_parts, nn.Module) else model_or_parts[0]
    return Attachment(
        family=type(part).__name__.removeprefix("FSDP"),
        layers=blocks,
        routers=[(i, s) for i, s in found],
        corrector=corrector,
        n_experts=int(moe0.tokens_per_expert_E.numel()),
        top_k=int(moe0.router.top_k),
        after_step=after_step,
    )


def force_collapse(model: nn.Module | Sequence[nn.Module], layer: int, margin: float = 0.5) -> None:
    """Drill: send layer `layer`'s tokens to expert 0 from its next forward. `expert_bias_E[0]`
    gains `margin` (score units: softmax scores lie in [0, 1], so 0.5 is plenty); without a bias
    (no load_balance_coeff) gate row 0 gains `margin` logits along the mean of its next input."""
    moe = _moe_of(blocks_of(model)[layer])
    if moe is None:
        raise ValueError(f"block {layer} of {type(model).__name__} has no MoE")
    bias = getattr(moe, "expert_bias_E", None)
    if isinstance(bias, torch.Tensor):
        with torch.no_grad():
            bias[0] += margin
        return

    def once(module: nn.Module, args: tuple) -> None:
        u = args[0].detach().reshape(-1, args[0].shape[-1]).float().mean(0)
        with torch.no_grad():
            w = module.gate.weight
            w[0] += (margin * u / u.pow(2).sum().clamp_min(1e-12)).to(w.dtype)
        handle.remove()

    handle = moe.router.register_forward_pre_hook(once)


class _State(MutableMapping):
    """The inner optimizers' per-parameter state as one mapping (an OptimizersContainer's own
    `state` is empty), so the guard's snapshots and rollbacks hold the real AdamW moments."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._opts = list(optimizers)
        self._owner = {id(p): o for o in self._opts for g in o.param_groups for p in g["params"]}

    def __getitem__(self, p: torch.Tensor) -> Any:
        st = self._owner[id(p)].state
        if p not in st:  # a defaultdict: a read must not create an entry
            raise KeyError(p)
        return st[p]

    def __setitem__(self, p: torch.Tensor, v: Any) -> None:
        self._owner[id(p)].state[p] = v

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._owner[id(p)].state[p]

    def __iter__(self) -> Iterator[Any]:
        return (p for o in self._opts for p in list(o.state))

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._opts)


class OptimizersView:
    """torchtitan's OptimizersContainer as GuardedStep needs it: the inner optimizers' param groups
    (with the LRs its schedulers set) and state; step() is the container's, so torchtitan's step
    pre-hooks (the expert-bias update) run exactly when the guard applies a step."""

    def __init__(self, container: Any, *, set_to_none: bool = True) -> None:
        self.container, self.set_to_none = container, set_to_none
        self.param_groups = [g for o in container for g in o.param_groups]
        self.state = _State(list(container))

    def step(self) -> None:
        self.container.step()

    # The guard's update sampler (guard/runtime/precursor.py) hooks around step(): the container's
    # own hooks, which run when its step() does.
    def register_step_pre_hook(self, hook: Any) -> Any:
        return self.container.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        return self.container.register_step_post_hook(hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # set_to_none=False under CUDA graphs: the captured backward writes into the same grads
        self.container.zero_grad(set_to_none=set_to_none and self.set_to_none)
