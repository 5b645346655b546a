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

import warnings
from collections.abc import Callable

import torch
from torch import nn

from guard.extras import require
from guard.integrations import hf_routing as rt
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
    """The model's decoder blocks (model.model.layers in most causal-LM families,
    transformer.blocks in DBRX)."""
    for path in LAYER_PATHS:
        obj: object = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList | nn.ModuleDict) and len(obj):
            return list(obj.values()) if isinstance(obj, nn.ModuleDict) else list(obj)
    raise ValueError(f"{type(model).__name__}: no decoder layers found (looked for {', '.join(LAYER_PATHS)})")


LAYER_PATHS = ("model.layers", "layers", "model.decoder.layers", "transformer.h", "transformer.blocks")


def attach(
    model: nn.Module,
    *,
    aux_coef: float | None = None,
    bias_rate: float = 1e-3,
    bias_max: float = 1.0,
    bias_update_rate: float = 0.0,
    balance_coef: float = 0.0,
    watch_logits: bool = False,
    bias_update: str | None = None,
    dry_run: bool = True,
) -> Attachment:
    """Hook every MoE router of a transformers model. Raises ValueError naming the class, and what
    was missing, when the model has no router this adapter can read: at attach, never later.

    How each router is read (indices in its output, Llama4's (scores, logits), JetMoE's gating
    tuple, DBRX's logits with the ids its experts are handed) and where the selection bias lives
    is found by a dry forward of one [1, 16] batch (guard/integrations/hf_routing.py), which also
    checks that every MoE layer counted tokens x top-k assignments. dry_run=False skips it and
    reads only the `(logits, weights, indices)` form.

    aux_coef: switch-loss weight of the per-layer correction before the policy's boost (default:
      the model's `router_aux_loss_coef`, at least 1e-2). bias_rate / bias_max: the bias push.
      On a model without a selection bias the correction also pushes a bounded bias on the
      collapsing layer's logits (guard/integrations/router_push.py LogitBias; the corrector's
      logit_rate = 0 turns it off).
    balance_coef: > 0 adds a standing per-layer switch balancing gradient of this weight to every
      router without a selection bias. transformers' `router_aux_loss_coef` loss balances the
      load pooled over ALL layers, so one layer can collapse while the pool looks balanced
      (measured on the tiny families: docs/NOTES.md); 1e-2 keeps each layer balanced.
    bias_update: transformers updates no selection bias in training (DeepSeek-V3, glm4_moe, dots1,
      ernie4_5_moe, afmoe, longcat_flash...): "sign" runs DeepSeek-V3's update
      b += u * sign(mean - n) (u = bias_update_rate or 1e-3), "smebu" Trinity's soft-clamped
      momentum update (lam 5e-4, kappa 2, beta 0.5), after every applied step. None (default)
      leaves the bias alone; bias_update_rate > 0 alone means "sign" (the earlier keyword).
    watch_logits: also measure the max attention logit per layer (a precursor, sampled every
      guard.precursor.max_logit_every-th step) by routing attention through a watching wrapper
      (guard/integrations/transformers_logits.py says what is and is not exact). Off by default:
      nothing is added to the model or its forward.
    """
    require("transformers", "guard.integrations.transformers.attach")
    name = type(model).__name__
    blocks = decoder_layers(model)
    hooks, biases, unobserved = (_read_dry if dry_run else _read_static)(model, blocks)
    if not hooks:
        raise ValueError(
            f"{name}: no MoE router found in its {len(blocks)} layers (looked for a module whose class "
            f"ends in Router/Gate/Gating, or a `gate`/`router` beside `experts`, whose output holds "
            f"top-k indices, counts or a selection mask); pass routers= to GuardedStep for a custom block"
            + (f"; left out: {'; '.join(unobserved)}" if unobserved else "")
        )
    if unobserved:
        warnings.warn(f"{name}: not observed: {'; '.join(unobserved)}", stacklevel=2)
    order = sorted(hooks)
    corrector: Corrector
    if len(biases) == len(hooks):
        corrector = BiasCorrector(
            biases=biases,
            lam=bias_rate,
            bias_max=bias_max,
            order=order,
            update_rate=bias_update_rate,
            update=bias_update,
        )
    else:
        if bias_update is not None:
            raise ValueError(
                f"{name}: bias_update = {bias_update!r} but {len(hooks) - len(biases)} of its {len(hooks)} MoE "
                f"layers have no selection bias"
            )
        base = getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0) or 0.0
        corrector = AuxGradCorrector(
            hooks=hooks,
            base_coef=aux_coef if aux_coef is not None else max(base, 1e-2),
            balance_coef=balance_coef,
            order=order,
        )
    cfg = getattr(model, "config", None)
    first = hooks[order[0]]
    top_k = getattr(getattr(first, "reading", None), "top_k", 0) or int(
        getattr(cfg, "num_experts_per_tok", 0) or 0
    )
    undo = [watch_logits_of(model, blocks)] if watch_logits else []
    att = Attachment(
        family=name,
        layers=blocks,
        routers=[(i, hooks[i]) for i in order],
        corrector=corrector,
        n_experts=first.n_experts,
        top_k=top_k,
        undo=undo,
    )
    att.unobserved = unobserved
    # drills: `inject collapse@S:LAYER` (guard/runtime/inject.py) pushes that layer's router
    att.force_collapse = lambda layer: force_collapse(model, layer)  # type: ignore[attr-defined]
    return att


def _read_dry(
    model: nn.Module, blocks: list[nn.Module]
) -> tuple[dict[int, TopKRoutingHook], dict[int, Callable[[], torch.Tensor]], list[str]]:
    """Find, read and prove every router by dry forwards (hf_routing's module docstring)."""
    name = type(model).__name__
    sites = rt.find_sites(blocks)
    unobserved = [
        f"layer {s.layer} {s.name} ({type(s.router).__name__}): attention experts (JetMoE-style), not observed"
        for s in sites
        if s.attention
    ]
    sites = [s for s in sites if not s.attention]
    if not sites:
        return {}, {}, unobserved
    x = rt.dry_batch(model)
    try:
        seen = rt.capture(model, sites, x)
    except Exception as e:  # the model's own forward failed: nothing of ours is on it now
        raise ValueError(f"{name}: the dry forward at attach failed ({type(e).__name__}: {e})") from e
    hooks: dict[int, TopKRoutingHook] = {}
    readings: dict[int, rt.Reading] = {}
    keep: dict[int, rt.Site] = {}
    for s in sites:
        if s.layer in keep:
            continue
        if (s.layer, s.name) not in seen:
            continue  # a candidate that did not run in the dry forward (an unused module)
        args, out, exp_in = seen[(s.layer, s.name)]
        r = rt.read_form(s, args, out, exp_in)
        if isinstance(r, str):
            if s.experts is not None:  # an MoE router beside experts that cannot be read: refuse
                raise ValueError(f"{name}: layer {s.layer} router {s.name} ({type(s.router).__name__}): {r}")
            continue
        keep[s.layer], readings[s.layer] = s, r
    biases: dict[int, Callable[[], torch.Tensor]] = {}
    for i, s in keep.items():
        found = rt.find_bias(s, readings[i].n_experts)
        hooks[i] = rt.FormHook(s, readings[i], rt.bias_tensor(*found) if found else None)
        if found:
            biases[i] = lambda found=found: rt.bias_tensor(*found)
    try:
        _prove(model, x, hooks, keep)
        where = {i: f for i, s in keep.items() if (f := rt.find_bias(s, readings[i].n_experts)) is not None}
        for i, null_id in rt.null_rewrites(model, keep, readings, where, x).items():
            readings[i].null_as = null_id  # the hook reads the same Reading object
        for h in hooks.values():
            h.reset_stats()
        if where:  # a bias that does not move selection is not used to correct
            for i, ok in rt.biases_select(model, hooks, where, x).items():
                if not ok:
                    biases.pop(i)
                    unobserved.append(f"layer {i} {keep[i].name}.{where[i][1]}: moves no selection, not used")
    except Exception:
        for h in hooks.values():
            h.remove()
        raise
    return hooks, biases, unobserved


def _prove(
    model: nn.Module, x: torch.Tensor, hooks: dict[int, TopKRoutingHook], sites: dict[int, rt.Site]
) -> None:
    """A dry forward with the real hooks on: each MoE layer counted tokens x top-k assignments."""
    name = type(model).__name__
    try:
        rt.dry_forward(model, x)
    except Exception as e:
        raise ValueError(
            f"{name}: the model's forward failed with moeguard's hooks on ({type(e).__name__}: {e})"
        ) from e
    bad = []
    for i, h in hooks.items():
        r = h.reading  # type: ignore[attr-defined]
        got = float(h.tokens_per_expert_E.sum())
        n = float(h.token_count) if r.form != rt.FORM_COUNTS else got / r.top_k
        if got == 0 or abs(got - n * r.top_k) > 0.5:
            bad.append(f"layer {i} {sites[i].name}: counted {got:g} assignments, expected tokens x {r.top_k}")
        h.reset_stats()
    if bad:
        raise ValueError(f"{name}: the dry forward's counts do not add up: {'; '.join(bad)}")


def _read_static(
    model: nn.Module, blocks: list[nn.Module]
) -> tuple[dict[int, TopKRoutingHook], dict[int, Callable[[], torch.Tensor]], list[str]]:
    """The `(logits, weights, indices)` form only, found without a forward (dry_run=False)."""
    hooks: dict[int, TopKRoutingHook] = {}
    biases: dict[int, Callable[[], torch.Tensor]] = {}
    for i, blk in enumerate(blocks):
        r = next((_router_of(m) for m in blk.modules() if _router_of(m) is not None), None)
        if r is None:
            continue
        bias = getattr(r, "e_score_correction_bias", None)
        score = "sigmoid" if isinstance(bias, torch.Tensor) else "softmax"
        hooks[i] = TopKRoutingHook(
            r,
            n_experts=_n_experts(r),
            score_func=score,
            bias=bias if isinstance(bias, torch.Tensor) else None,
        )
        if isinstance(bias, torch.Tensor):
            biases[i] = lambda r=r: r.e_score_correction_bias
    return hooks, biases, []


def force_collapse(model: nn.Module, layer: int, margin: float = 4.0) -> None:
    """Drill: push layer `layer`'s router towards expert 0 at its next forward (for tests and fire
    drills, like `moeguard train --inject collapse`). A selection bias is raised by `margin`;
    a bias-free router's row 0 gains `margin` along the mean direction of its inputs."""
    blocks = decoder_layers(model)
    sites = [s for s in rt.find_sites([blocks[layer]]) if not s.attention]
    if not sites:
        raise ValueError(f"layer {layer} of {type(model).__name__} has no MoE router")
    site = sites[0]
    lin = router_linear(site.router)
    n = lin.weight.shape[0] if lin is not None else 0
    found = rt.find_bias(site, n) if n else None
    if found is None and isinstance(getattr(site.router, "e_score_correction_bias", None), torch.Tensor):
        found = (site.router, "e_score_correction_bias")
    if found is not None:
        with torch.no_grad():
            rt.bias_tensor(*found)[0] += margin
        return
    if lin is None:
        raise ValueError(f"layer {layer} of {type(model).__name__}: no router weight to push")

    def once(module: nn.Module, args: tuple) -> None:
        h = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        u = h.mean(0)
        with torch.no_grad():
            lin.weight[0] += (margin * u / u.pow(2).sum().clamp_min(1e-12)).to(lin.weight.dtype)
        handle.remove()

    handle = site.router.register_forward_pre_hook(once)


def router_linear(router: nn.Module) -> nn.Module | None:
    """The router's logits projection: itself when it holds a 2-D weight, else its last Linear
    (zaya's router is an MLP: down_proj, fc1, fc2, then out_proj to the logits; pushing its first
    Linear's row 0 moved a hidden unit, not expert 0, and every later layer through its router
    states)."""
    if isinstance(getattr(router, "weight", None), torch.Tensor) and router.weight.ndim == 2:
        return router
    return next((m for m in reversed(list(router.modules())) if isinstance(m, nn.Linear)), None)
