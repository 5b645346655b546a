"""Hugging Face transformers (5.x) MoE models: find every router, read what it chose.

    from guard.integrations.transformers import attach
    att = attach(model)                       # Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ...
    guarded = GuardedStep(model, optimizer, attach=att, run_dir="runs/my-run")

In transformers 5 every sparse MoE block holds a router (`gate`, or `router` in GPT-OSS) that
returns `(router_logits, top_k_weights, top_k_indices)` and an `experts` module that consumes
them. A forward hook on the router counts the indices the model itself selected (group-limited
routing and `e_score_correction_bias` included, since the model applied them), one bincount on
the device per layer and micro-batch; the entropy comes from the logits.

Collapse correction: DeepSeek-V3-style routers (a selection-only `e_score_correction_bias`) get
a bounded bias push; every other family gets a per-layer balancing gradient on its router logits
(an aux-loss boost for that layer only; see guard/integrations/base.py).
"""

from __future__ import annotations

import torch
from torch import nn

from guard.integrations.base import (
    Attachment,
    AuxGradCorrector,
    BiasCorrector,
    Corrector,
    TopKRoutingHook,
)
from guard.integrations.transformers_logits import watch_logits as watch_logits_of

# Attribute names transformers 5 uses for the router inside a sparse MoE block.
ROUTER_NAMES = ("gate", "router")


def _router_of(block: nn.Module) -> nn.Module | None:
    """The router of a sparse MoE block: a child `gate`/`router` beside an `experts` child."""
    if not hasattr(block, "experts"):
        return None
    for name in ROUTER_NAMES:
        r = getattr(block, name, None)
        if isinstance(r, nn.Module) and _n_experts(r):
            return r
    return None


def _n_experts(router: nn.Module) -> int:
    n = getattr(router, "num_experts", None) or getattr(router, "n_routed_experts", None)
    if n:
        return int(n)
    w = getattr(router, "weight", None)
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.ndim == 2 else 0


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder blocks (model.model.layers in every causal-LM family)."""
    for path in ("model.layers", "layers", "model.decoder.layers", "transformer.h"):
        obj: object = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList | nn.ModuleDict) and len(obj):
            return list(obj.values()) if isinstance(obj, nn.ModuleDict) else list(obj)
    raise ValueError(
        f"{type(model).__name__}: no decoder layers found (looked for model.layers, layers, "
        f"model.decoder.layers, transformer.h)"
    )


def attach(
    model: nn.Module,
    *,
    aux_coef: float | None = None,
    bias_rate: float = 1e-3,
    bias_max: float = 1.0,
    bias_update_rate: float = 0.0,
    balance_coef: float = 0.0,
    watch_logits: bool = False,
) -> Attachment:
    """Hook every MoE router of a transformers model. Raises ValueError naming the class when the
    model has no router this adapter knows.

    aux_coef: switch-loss weight of the per-layer correction before the policy's boost (default:
      the model's `router_aux_loss_coef`, at least 1e-2). bias_rate / bias_max: the bias push.
    balance_coef: > 0 adds a standing per-layer switch balancing gradient of this weight to every
      router without a selection bias. transformers' `router_aux_loss_coef` loss balances the
      load pooled over ALL layers, so one layer can collapse while the pool looks balanced
      (measured on the tiny families: docs/NOTES.md); 1e-2 keeps each layer balanced.
    bias_update_rate: transformers' DeepSeek-V3 never updates `e_score_correction_bias` during
      training (its aux-loss-free balancing is left to the trainer); > 0 runs DeepSeek-V3's own
      sign update with this u (1e-3 in the paper) after every applied step. 0 leaves it alone.
    watch_logits: also measure the max attention logit per layer (a precursor, sampled every
      guard.precursor.max_logit_every-th step) by routing attention through a watching wrapper
      (guard/integrations/transformers_logits.py says what is and is not exact). Off by default:
      nothing is added to the model or its forward.
    """
    blocks = decoder_layers(model)
    found: list[tuple[int, nn.Module]] = []
    for i, blk in enumerate(blocks):
        for m in blk.modules():
            r = _router_of(m)
            if r is not None:
                found.append((i, r))
                break
    if not found:
        raise ValueError(
            f"{type(model).__name__}: no MoE router found in its {len(blocks)} layers (looked for a "
            f"`gate`/`router` module beside an `experts` module, as transformers 5's Mixtral, Qwen2/3-MoE, "
            f"OLMoE, DeepSeek-V3 and GPT-OSS have); pass routers= to GuardedStep for a custom block"
        )
    hooks: dict[int, TopKRoutingHook] = {}
    biases = {}
    for i, r in found:
        bias = getattr(r, "e_score_correction_bias", None)
        # Sigmoid-scored routers carry the selection bias (DeepSeek-V3 and its descendants).
        score = "sigmoid" if isinstance(bias, torch.Tensor) else "softmax"
        hooks[i] = TopKRoutingHook(
            r,
            n_experts=_n_experts(r),
            score_func=score,
            bias=bias if isinstance(bias, torch.Tensor) else None,
        )
        if isinstance(bias, torch.Tensor):
            biases[i] = lambda r=r: r.e_score_correction_bias
    corrector: Corrector
    if len(biases) == len(found):
        corrector = BiasCorrector(
            biases=biases,
            lam=bias_rate,
            bias_max=bias_max,
            order=[i for i, _ in found],
            update_rate=bias_update_rate,
        )
    else:
        base = getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0) or 0.0
        corrector = AuxGradCorrector(
            hooks=hooks,
            base_coef=aux_coef if aux_coef is not None else max(base, 1e-2),
            balance_coef=balance_coef,
        )
    cfg = getattr(model, "config", None)
    undo = [watch_logits_of(model, blocks)] if watch_logits else []
    return Attachment(
        family=type(model).__name__,
        layers=blocks,
        routers=[(i, hooks[i]) for i, _ in found],
        corrector=corrector,
        n_experts=_n_experts(found[0][1]),
        top_k=int(getattr(cfg, "num_experts_per_tok", 0) or 0),
        undo=undo,
    )


def force_collapse(model: nn.Module, layer: int, margin: float = 4.0) -> None:
    """Drill: push layer `layer`'s router towards expert 0 at its next forward (for tests and fire
    drills, like `moeguard train --inject collapse`). A selection bias is raised by `margin`;
    a bias-free router's row 0 gains `margin` along the mean direction of its inputs."""
    blocks = decoder_layers(model)
    r = next((_router_of(m) for m in blocks[layer].modules() if _router_of(m) is not None), None)
    if r is None:
        raise ValueError(f"layer {layer} of {type(model).__name__} has no MoE router")
    for name in ("e_score_correction_bias", "bias"):
        b = getattr(r, name, None)
        if isinstance(b, torch.Tensor):
            with torch.no_grad():
                b[0] += margin
            return

    def once(module: nn.Module, args: tuple) -> None:
        h = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        u = h.mean(0)
        with torch.no_grad():
            module.weight[0] += (margin * u / u.pow(2).sum().clamp_min(1e-12)).to(module.weight.dtype)
        handle.remove()

    handle = r.register_forward_pre_hook(once)
