"""The max-attention-logit precursor for Hugging Face transformers (5.x) models, opt in:
`attach(model, watch_logits=True)` (guard/integrations/transformers.py) calls `watch_logits`.

transformers 5 attention modules compute q and k (projections, q/k norms, RoPE) and hand them to
an attention function looked up by name in `AttentionInterface` (config._attn_implementation:
"sdpa", "eager", "flash_attention_2", ...), with the mask and the softmax `scaling` the model
uses. `watch_logits` registers a wrapper under "moeguard_watch_<name>" that, on the steps the
guard's sampler armed, passes those exact q, k, scaling and mask to a LogitWatch on the attention
module (guard/runtime/attention_logits.py), then calls the model's own function unchanged; the
model is switched to the wrapper with `set_attn_implementation` and back by `unwatch`. Between
sampled steps the wrapper costs one attribute test per layer.

Supported: every family whose attention calls the interface with (module, query, key, value,
attention_mask, scaling=...), i.e. the ones guard/integrations/tiny.py builds (Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V3's MLA, GPT-OSS), eager / sdpa / flash / flex implementations;
grouped-query heads; bool or additive masks (padding, sliding windows) as the model built them.
Not supported or not exact: eager's returned `attn_weights` are post-softmax probabilities and
are not used; GPT-OSS's per-head sink logits are not q.k and are left out; flash-attention with
packed sequences (no mask, documents told apart by position ids) is judged as one causal row, so
pairs across documents count (an over-estimate); a model that calls its attention kernel directly,
bypassing the interface, is not watched (attach raises naming the class).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from guard.runtime.attention_logits import LogitWatch

PREFIX = "moeguard_watch_"


def _attention_module(block: nn.Module) -> nn.Module | None:
    """A decoder block's self-attention: `self_attn` (every transformers 5 causal LM), else the
    first submodule whose class name ends in "Attention"."""
    attn = getattr(block, "self_attn", None)
    if isinstance(attn, nn.Module):
        return attn
    return next((m for m in block.modules() if type(m).__name__.endswith("Attention")), None)


def _inner(name: str, module: nn.Module) -> Callable[..., Any]:
    """The attention function `name` means for this module: the registered one, or for "eager"
    the model's own eager_attention_forward (each modeling file has its own)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{type(module).__name__}: no attention function {name!r} to wrap")
    return fn


def _register(name: str) -> str:
    """Register the watching wrapper of attention implementation `name` (and its mask function)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    watched = PREFIX + name

    def attention(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, **kw: Any) -> Any:
        w = getattr(module, "logit_watch", None)
        if w is not None and w.armed:
            w.observe(query, key, kw.get("scaling"), attention_mask)
        return _inner(name, module)(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(watched, attention)
    if name in ALL_MASK_ATTENTION_FUNCTIONS:  # the mask the model builds stays the inner one's
        AttentionMaskInterface.register(watched, ALL_MASK_ATTENTION_FUNCTIONS[name])
    return watched


def watch_logits(model: nn.Module, blocks: list[nn.Module]) -> Callable[[], None]:
    """Put a LogitWatch on every block's attention and route the model's attention through the
    watching wrapper. Returns the undo (the previous implementation back, the watches removed)."""
    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None) or "eager"
    if name.startswith(PREFIX):
        raise ValueError(f"{type(model).__name__}: its attention is already watched ({name!r})")
    attns = [_attention_module(b) for b in blocks]
    if not hasattr(model, "set_attn_implementation") or any(a is None for a in attns):
        raise ValueError(
            f"{type(model).__name__}: cannot watch attention logits (needs transformers 5's "
            f"set_attn_implementation and a self_attn module in each of its {len(blocks)} layers)"
        )
    for a in attns:
        p = next(a.parameters(), None)  # type: ignore[union-attr]
        a.logit_watch = LogitWatch().to(p.device if p is not None else "cpu")  # type: ignore[union-attr]
    model.set_attn_implementation(_register(name))

    def unwatch() -> None:
        model.set_attn_implementation(name)
        for a in attns:
            del a.logit_watch  # type: ignore[union-attr]

    return unwatch
