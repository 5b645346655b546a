"""The router protocol for transformers 5 MoE families: where each layer's router is, what its
forward hands back, where its selection bias lives, proved on the model before training starts.

transformers 5.23 routers come in these shapes (read from its modeling code, issue #28):

  indices   `(logits, weights, indices[, ...])`: the top-k expert ids in the output (Mixtral,
            Qwen, OLMoE, DeepSeek-V3 and its descendants, afmoe, ernie4_5_moe, zaya, inkling...);
            LongCat-Flash adds zero-computation experts (10 logits for 8 experts + 2 identities)
            and zaya a null expert: every logit is a routing target and gets a load bin.
            ZayaRouter hands a skip-expert selection on as (expert 0, weight 0): where a dry
            forward with the last bin's bias raised shows that rewrite (null_rewrites), such a
            pair is counted on the last bin, not on expert 0.
  mask      `(scores, logits)`: Llama4; scores are sigmoid(top value) at the chosen experts
            and exactly 0 elsewhere, so the chosen set is the non-zero entries.
  counts    JetMoE's gating 5-tuple `(sorted order, batch index, gates, expert_size, logits)`:
            expert_size is the per-expert token count (a Python list) the model used.
  experts   logits only (DBRX): the block does the top-k and hands the ids to its experts
            module, whose forward pre-hook reads them.

A family none of these fits is refused at attach(), naming the router class and what its output
held. Every shape is found by one dry forward (a [1, 16] batch, no gradient, the RNG state put
back): hooks capture what each router returned, the form is chosen from that, the real hooks go
on, and a second dry forward checks that every MoE layer counted tokens x top-k assignments.

Selection bias: `e_score_correction_bias` on the router (DeepSeek-V3 family, glm4_moe, dots1,
longcat_flash...), on `router.moe_statics` (ernie4_5_moe), `expert_bias` /
`e_score_correction_bias` on the MoE block passed into the router (afmoe, lfm2_moe, hy_v3,
minimax_m2), `balancing_biases` (zaya). It is used only after a dry forward with expert 0's bias
raised sends every token to expert 0: proof that it selects and that pushing it moves routing.

JetMoE's attention experts (mixture of attention heads, routed by the same gating class) are
not observed: attach() lists them in Attachment.unobserved and warns once.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from guard.integrations.base import TopKRoutingHook

FORM_INDICES, FORM_MASK, FORM_COUNTS, FORM_EXPERTS = "indices", "mask", "counts", "experts_input"
ROUTER_CLASS = re.compile(r"(router|gate|gating)$", re.IGNORECASE)
ROUTER_NAMES = ("gate", "router")
BIAS_NAMES = ("e_score_correction_bias", "expert_bias", "balancing_biases")
_ROUTES_TO = ("num_experts", "n_routed_experts", "top_k")
DRY_TOKENS = 16
_BIAS_PROBE = 1e4  # added to expert 0's bias in the bias check: dominates any score


@dataclass(slots=True)
class Site:
    """One router in one decoder layer."""

    layer: int
    name: str  # qualified name inside the decoder layer
    router: nn.Module
    block: nn.Module  # the module holding the router (and its experts)
    experts: nn.Module | None
    attention: bool  # JetMoE's attention experts


@dataclass(slots=True)
class Reading:
    """How one router's forward is read (found by the dry forward)."""

    form: str
    n_experts: int  # logits width: every routing target, zero-computation experts included
    top_k: int
    logits_at: int | None  # position in the output tuple; None: the output is the logits
    ids_at: int | None = None  # indices / mask / counts position
    score_func: str = "softmax"
    weights_at: int | None = None  # the top-k weights beside the indices (FORM_INDICES)
    # a null target's selection rewritten by the router to (this id, weight 0), zaya's skip
    # expert to 0: such a pair is counted on the last bin (proved at attach: null_rewrites)
    null_as: int | None = None


@dataclass
class Found:
    """attach()'s view of the model: the observed sites and their readings, what was left out."""

    sites: list[Site] = field(default_factory=list)
    readings: dict[int, Reading] = field(default_factory=dict)
    unobserved: list[str] = field(default_factory=list)


def find_sites(blocks: list[nn.Module]) -> list[Site]:
    """Every router candidate per decoder layer: a module whose class ends in Router/Gate/Gating,
    or a `gate`/`router` child beside `experts` (attach() keeps the first readable one a layer)."""
    sites: list[Site] = []
    for i, blk in enumerate(blocks):
        seen: list[str] = []
        for pname, parent in blk.named_modules():
            for cname, child in parent.named_children():
                qual = f"{pname}.{cname}" if pname else cname
                if any(qual.startswith(s + ".") for s in seen):
                    continue  # inside a router already found (its linear layer, its statics)
                experts = getattr(parent, "experts", None)
                by_name = cname in ROUTER_NAMES and isinstance(experts, nn.Module)
                # a Router/Gate/Gating class counts beside experts or when it says how many it routes
                # to (JetMoE's gating); linear attention's forget gates do neither
                by_class = (
                    bool(ROUTER_CLASS.search(type(child).__name__))
                    and type(child) is not nn.Linear
                    and (isinstance(experts, nn.Module) or any(hasattr(child, a) for a in _ROUTES_TO))
                )
                if not (by_class or by_name) or "expert" in cname:
                    continue
                seen.append(qual)
                attention = "attn" in qual or "attention" in qual
                sites.append(
                    Site(
                        i, qual, child, parent, experts if isinstance(experts, nn.Module) else None, attention
                    )
                )
    return sites


def _desc(o: Any) -> str:
    if isinstance(o, torch.Tensor):
        return f"{'int' if not o.dtype.is_floating_point else 'float'}{list(o.shape)}"
    if isinstance(o, tuple | list):
        return "(" + ", ".join(_desc(x) for x in o[:6]) + (", ..." if len(o) > 6 else "") + ")"
    return type(o).__name__


def _score_func(*modules: nn.Module) -> str:
    """sigmoid when the router's (else the block's) forward applies one, else softmax."""
    for m in modules:
        try:
            src = inspect.getsource(type(m).forward)
        except (OSError, TypeError):
            continue
        if "sigmoid" in src:
            return "sigmoid"
        if "softmax" in src:
            return "softmax"
    return "softmax"


def _k_per_row(t: torch.Tensor) -> int:
    """k when every row of t has exactly k non-zero entries, 0 < k < width; else 0."""
    nz = (t != 0).sum(-1)
    k = int(nz.max()) if nz.numel() else 0
    return k if int(nz.min()) == k and 0 < k < t.shape[-1] else 0


def read_form(site: Site, router_in: tuple, out: Any, experts_in: tuple | None) -> Reading | str:
    """The Reading for one router from what one forward showed, or why none fits."""
    x = next((a for a in router_in if isinstance(a, torch.Tensor) and a.dtype.is_floating_point), None)
    if x is None:
        return "its input held no hidden states"
    n = x.numel() // x.shape[-1]
    items = list(out) if isinstance(out, tuple | list) else [out]
    floats = [
        (j, t)
        for j, t in enumerate(items)
        if isinstance(t, torch.Tensor)
        and t.dtype.is_floating_point
        and t.ndim >= 1
        and t.numel() == n * t.shape[-1]
    ]
    masks = [j for j, t in floats if _k_per_row(t.reshape(n, t.shape[-1])) and len(floats) > 1]
    logits = next(((j, t) for j, t in floats if t.shape[-1] >= 2 and j not in masks), None)
    if logits is None:
        return f"its output {_desc(out)} held no [tokens, experts] logits"
    lj, lt = logits
    e = int(lt.shape[-1])
    logits_at = lj if isinstance(out, tuple | list) else None
    score = _score_func(site.router, site.block)
    for j, t in enumerate(items):  # top-k ids in the output
        if isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and t.numel() and t.numel() % n == 0:
            if 0 <= int(t.min()) and int(t.max()) < e:
                w_at = next((i for i, w in floats if i != lj and w.shape == t.shape), None)
                return Reading(FORM_INDICES, e, t.numel() // n, logits_at, j, score, w_at)
    for j, t in enumerate(items):  # per-expert counts (JetMoE's expert_size)
        if (
            isinstance(t, list | tuple)
            and len(t) == e
            and all(isinstance(c, int) for c in t)
            and sum(t) % n == 0
        ):
            return Reading(FORM_COUNTS, e, sum(t) // n, logits_at, j, score)
    for j, t in floats:  # a selection mask: the same number of non-zero scores in every row (Llama4)
        if j in masks and t.shape[-1] == e:
            return Reading(FORM_MASK, e, _k_per_row(t.reshape(n, e)), logits_at, j, score)
    for t in experts_in or ():  # the ids the block handed its experts (DBRX)
        if isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and t.numel() and t.numel() % n == 0:
            if 0 <= int(t.min()) and int(t.max()) < e:
                return Reading(FORM_EXPERTS, e, t.numel() // n, logits_at, None, score)
    return (
        f"its output {_desc(out)} held no top-k indices, per-expert counts or selection mask, and its "
        f"experts module was handed no expert ids"
    )


class FormHook(TopKRoutingHook):
    """A TopKRoutingHook that reads any Reading's form (module docstring)."""

    def __init__(self, site: Site, reading: Reading, bias: torch.Tensor | None) -> None:
        super().__init__(site.router, n_experts=reading.n_experts, score_func=reading.score_func, bias=bias)
        self.reading = reading
        self._stash: torch.Tensor | None = None
        self._pre = None
        if reading.form == FORM_EXPERTS:
            assert site.experts is not None
            self._pre = site.experts.register_forward_pre_hook(self._experts_pre)

    def _logits(self, output: Any) -> torch.Tensor:
        at = self.reading.logits_at
        return output if at is None else output[at]

    def _hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        r = self.reading
        logits = self._logits(output)
        if r.form == FORM_EXPERTS:
            self._stash = logits
            return
        got = output[r.ids_at]
        if r.form == FORM_INDICES:
            idx = got
            if r.null_as is not None:  # the router's (null_as, weight 0) is its null target
                w = output[r.weights_at]
                idx = torch.where((got == r.null_as) & (w == 0), r.n_experts - 1, got)
        elif r.form == FORM_MASK:  # the k non-zero entries of each row: topk of the 0/1 mask
            idx = (got.detach().reshape(-1, r.n_experts) != 0).to(torch.float32).topk(r.top_k, dim=-1).indices
        else:  # FORM_COUNTS: ids whose bincount is the model's own per-expert counts
            counts = torch.as_tensor(list(got), device=logits.device)
            idx = torch.repeat_interleave(torch.arange(r.n_experts, device=logits.device), counts)
        self.record(logits, idx)

    def _experts_pre(self, module: nn.Module, args: tuple) -> None:
        if self._stash is None:
            return
        idx = next(a for a in args if isinstance(a, torch.Tensor) and not a.dtype.is_floating_point)
        logits, self._stash = self._stash, None
        self.record(logits, idx)

    def remove(self) -> None:
        super().remove()
        if self._pre is not None:
            self._pre.remove()


def find_bias(site: Site, n_experts: int) -> tuple[nn.Module, str] | None:
    """(owner, attribute) of a selection-bias tensor of n_experts values near the router."""
    owners = [site.router, *site.router.children(), site.block]
    for owner in owners:
        for name in BIAS_NAMES:
            t = getattr(owner, name, None)
            if isinstance(t, torch.Tensor) and t.numel() == n_experts:
                return owner, name
    return None


def null_rewrites(
    model: nn.Module,
    sites: dict[int, Site],
    readings: dict[int, Reading],
    found: dict[int, tuple[nn.Module, str]],
    x: torch.Tensor,
) -> dict[int, int]:
    """Layers whose router hands a selection of its last target (a null expert that computes
    nothing) on as another id with weight 0, {layer: that id}: zaya's ZayaRouter rewrites its skip
    expert to (0, 0.0), which a reader of the ids alone counts on expert 0 and never on the skip
    bin. Proved by one dry forward with every last-bin bias raised far above any score: each row
    then holds one weight-0 slot, all on one id that is not the last bin. Biases put back bit for
    bit; the real hooks counted that forward, so the caller resets them."""
    probe = {
        i: f
        for i, f in found.items()
        if readings[i].form == FORM_INDICES and readings[i].weights_at is not None
    }
    if not probe:
        return {}
    kept = {i: bias_tensor(*f).detach().clone() for i, f in probe.items()}
    try:
        with torch.no_grad():
            for f in probe.values():
                bias_tensor(*f)[-1] += _BIAS_PROBE
        seen = capture(model, [sites[i] for i in probe], x)
    finally:
        with torch.no_grad():
            for i, f in probe.items():
                bias_tensor(*f).copy_(kept[i])
    out: dict[int, int] = {}
    for i in probe:
        got = seen.get((i, sites[i].name))
        if got is None:
            continue
        r, o = readings[i], got[1]
        ids = o[r.ids_at].reshape(-1, r.top_k)
        w = o[r.weights_at].reshape(-1, r.top_k)
        zero = w == 0
        if bool((ids == r.n_experts - 1).any()) or not bool((zero.sum(-1) == 1).all()):
            continue  # the last target is counted as itself, or no one null slot per row
        at = ids[zero]
        if bool((at == at[0]).all()):
            out[i] = int(at[0])
    return out


def bias_tensor(owner: nn.Module, name: str) -> torch.Tensor:
    """The live bias as a flat view (ernie keeps [1, E]); read again each time (to() replaces it)."""
    return getattr(owner, name).view(-1)


def dry_batch(model: nn.Module) -> torch.Tensor:
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", 256)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, int(vocab), (1, DRY_TOKENS), generator=g).to(device)


def dry_forward(model: nn.Module, x: torch.Tensor) -> None:
    """One forward that changes nothing the user can see: no gradient, RNG state put back."""
    devices = [torch.cuda.current_device()] if x.is_cuda else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model(input_ids=x)


def capture(
    model: nn.Module, sites: list[Site], x: torch.Tensor
) -> dict[tuple[int, str], tuple[tuple, Any, tuple | None]]:
    """What each site's router took and returned (and its experts were handed) in one dry forward,
    by (layer, name): the first call of each."""
    seen: dict[tuple[int, str], tuple[tuple, Any]] = {}
    exp_in: dict[tuple[int, str], tuple] = {}
    handles = []
    for s in sites:
        key = (s.layer, s.name)

        def fwd(m: nn.Module, a: tuple, o: Any, key: tuple[int, str] = key) -> None:
            seen.setdefault(key, (a, o))

        handles.append(s.router.register_forward_hook(fwd))
        if s.experts is not None:

            def pre(m: nn.Module, a: tuple, key: tuple[int, str] = key) -> None:
                exp_in.setdefault(key, a)

            handles.append(s.experts.register_forward_pre_hook(pre))
    try:
        dry_forward(model, x)
    finally:
        for h in handles:
            h.remove()
    return {k: (a, o, exp_in.get(k)) for k, (a, o) in seen.items()}


def biases_select(
    model: nn.Module, hooks: dict[int, FormHook], found: dict[int, tuple[nn.Module, str]], x: torch.Tensor
) -> dict[int, bool]:
    """Raise expert 0's bias far above any score in every layer at once for one dry forward: a
    selection bias sends every token of its layer to expert 0 (counted by the real hook), whatever
    the other layers do. The biases are put back bit for bit; every hook is reset."""
    kept = {i: bias_tensor(*f).detach().clone() for i, f in found.items()}
    try:
        with torch.no_grad():
            for f in found.values():
                bias_tensor(*f)[0] += _BIAS_PROBE
        for h in hooks.values():
            h.reset_stats()
        dry_forward(model, x)
        out = {}
        for i in found:
            load = hooks[i].tokens_per_expert_E
            total = float(load.sum())
            out[i] = total > 0 and float(load[0]) * hooks[i].reading.top_k >= total - 1e-6
        return out
    finally:
        with torch.no_grad():
            for i, f in found.items():
                bias_tensor(*f).copy_(kept[i])
        for h in hooks.values():
            h.reset_stats()
