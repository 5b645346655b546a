"""Training FLOPs per token of a transformers MoE model, for GuardedStep's `flops_per_token=`.

    GuardedStep(model, opt, ..., flops_per_token=flops_per_token(model, seq_len=2048))

The same convention as moeguard's trainer (trainer/flops.py) and torchtitan: 6 x the matmul
parameters one token passes through + 12 x layers x heads x head_dim x sequence length (attention
scores and the weighted sum, forward and backward, no causal discount). Active parameters only:
a routed expert's weights count top_k / n_experts of their size (an `experts` module, fused or a
list); shared experts, routers, attention and dense layers count whole; the input embedding is a
lookup and is left out unless tied to the output head (then counted once, as the head); norm
weights and biases (1-D) are elementwise and left out.
"""

from __future__ import annotations

from torch import nn

TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k")
N_EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts", "ffn_config")


def _first(cfg: object, keys: tuple[str, ...]) -> int | None:
    for k in keys:
        v = getattr(cfg, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
        if isinstance(v, list | tuple) and v and isinstance(v[0], int):  # per-layer lists (ernie)
            return int(v[0])
        if k == "ffn_config" and v is not None:  # dbrx keeps them in its ffn config
            return _first(v, ("moe_num_experts", "moe_top_k"))
    return None


def routing(model: nn.Module) -> tuple[int, int]:
    """(top_k, n_experts) from the model's config; ValueError naming what is missing."""
    cfg = getattr(model, "config", None)
    ffn = getattr(cfg, "ffn_config", None)
    top_k = _first(cfg, TOP_K_KEYS) or _first(ffn, ("moe_top_k",))
    n_exp = _first(cfg, N_EXPERT_KEYS[:-1]) or _first(ffn, ("moe_num_experts",))
    if not top_k or not n_exp:
        raise ValueError(
            f"{type(model).__name__}: no expert count or top-k in its config (looked for "
            f"{', '.join(TOP_K_KEYS)} and {', '.join(N_EXPERT_KEYS[:-1])}); pass flops_per_token yourself"
        )
    return top_k, n_exp


def active_params(model: nn.Module) -> float:
    """Matmul parameters one token passes through (routed experts weighted by top_k / n_experts)."""
    top_k, n_exp = routing(model)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_w = getattr(emb, "weight", None)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    total = 0.0
    for name, p in model.named_parameters():  # a tied weight appears once
        if p.ndim < 2 or (p is emb_w and not tied):
            continue
        routed = "experts" in name.split(".")
        total += p.numel() * (top_k / n_exp if routed else 1.0)
    return total


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    attention = 12.0 * cfg.num_hidden_layers * heads * head_dim * seq_len
    return 6.0 * active_params(model) + attention
