"""Tiny random-init transformers MoE models of every sparse-MoE causal-LM family of transformers
5.23, for drills, tests and benchmarks: built from a config, nothing downloaded. 4 layers, hidden
64, 8 experts, top-2 by default (the shape the real-model issues were measured on).

    model = build("mixtral", seed=0)
    FAMILIES      the six families the guard was first measured on (configs kept as they were)
    ALL_FAMILIES  every sparse-MoE causal-LM model type of transformers 5.23 (issue #28)

The six keep their hand-written configs (benchmarks compare against them); every other family is
its config class's defaults shrunk by one table (`_SHRINK`: a key is set only where the family's
config has it) plus the few keys a family needs on top (`_EXTRA`: multi-head latent attention
wants as many KV heads as heads, group-limited routers a group count that divides 8, hybrids
their layer patterns...). Token ids are cleared (defaults point past a 256-token vocab).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")

# Multi-head latent attention, shrunk (deepseek_v2/v3 descendants).
_MLA: dict[str, Any] = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
)
_MLA_Q = {**_MLA, "q_lora_rank": 16}  # families whose config insists on a query LoRA
_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}

# model type -> keys on top of _SHRINK (only for families whose shrunk defaults do not build/run)
_EXTRA: dict[str, dict[str, Any]] = {
    "axk1": {**_MLA_Q, "head_dim": 8},
    "axk2": _MLA_Q,
    "deepseek_v2": {**_MLA, **_ROPE},
    "deepseek_v32": _MLA_Q,
    "glm4_moe_lite": _MLA,
    "glm_moe_dsa": _MLA_Q,
    "dots3_note_text": _MLA_Q,
    "deepseek_v4": {
        "q_lora_rank": 16,
        "o_lora_rank": 16,
        "o_groups": 2,
        "index_n_heads": 2,
        "index_head_dim": 16,
    },
    "kimi_linear": {
        **_MLA,
        "n_group": 1,
        "topk_group": 1,
        "linear_head_dim": 16,
        "linear_num_heads": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2,
    },
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"] * 2},
    "bailing_hybrid": {**_MLA, "layer_group_size": 2},
    "hy_v4": {**_MLA_Q, "n_group": 1, "topk_group": 1, "index_head_dim": 16, "index_n_heads": 2},
    "longcat_flash": {
        **_MLA_Q,
        "num_layers": 2,  # each longcat layer holds two attention blocks and one MoE
        "ffn_hidden_size": 128,
        "expert_ffn_hidden_size": 128,
        "moe_topk": 2,
        "zero_expert_num": 2,
        "head_dim": 8,
    },
    "beam": {"n_group": 4, "topk_group": 2},
    "dots1": {"n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 32},
    "gemma4_text": {
        "enable_moe_block": True,
        "top_k_experts": 2,
        "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 16,
        "sliding_window": 64,
    },
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 4,
        "max_seq_len": 512,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 8, "moe_top_k": 2},
    },
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "use_mamba_kernels": False},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"]},
    "qwen4_exp_text": {
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "hc_lowrank": 16,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 64,
        "indexer_compress_ratio": 4,
    },
}

_SHRINK: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    num_experts=8,
    n_routed_experts=8,
    num_local_experts=8,
    moe_num_experts=8,
    num_experts_per_tok=2,
    moe_top_k=2,
    tie_word_embeddings=False,
)


def _moe_model_types() -> tuple[str, ...]:
    """Every causal-LM model type of this transformers whose tiny build has a sparse MoE block
    (fixed list for 5.23; tests check it against the installed package)."""
    return (
        "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "dbrx",
        "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "doge", "dots1", "dots3_note_text",
        "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "gemma4_text", "glm4_moe", "glm4_moe_lite",
        "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
        "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling2_text", "inkling_text", "jamba", "jetmoe",
        "kimi_linear", "kolibri1", "laguna", "lfm2_moe", "llama4_text", "longcat_flash", "mellum",
        "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "mixtral", "nemotron_h", "olmoe",
        "phimoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen4_exp_text",
        "solar_open", "zaya",
    )  # fmt: skip


ALL_FAMILIES = _moe_model_types()


def _six(family: str, *, layers: int, hidden: int, experts: int, top_k: int, vocab: int) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_experts_per_tok=top_k,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=2 * hidden, num_local_experts=experts)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=2 * hidden,
            shared_expert_intermediate_size=2 * hidden,
            num_experts=experts,
        )
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=2 * hidden,
            num_experts=experts,
            head_dim=hidden // 4,
        )
    if family == "olmoe":
        return tf.OlmoeConfig(**common, intermediate_size=2 * hidden, num_experts=experts)
    if family == "deepseek_v3":
        common["num_key_value_heads"] = 4  # multi-head latent attention: as many KV heads as heads
        return tf.DeepseekV3Config(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            intermediate_size=2 * hidden,
            moe_intermediate_size=2 * hidden,
            n_routed_experts=experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        )
    if family == "gpt_oss":
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        return tf.GptOssConfig(
            **common,
            intermediate_size=2 * hidden,
            num_local_experts=experts,
            head_dim=16,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        )
    raise AssertionError(family)


def _config(family: str, *, layers: int, hidden: int, experts: int, top_k: int, vocab: int) -> Any:
    if family in FAMILIES:
        return _six(family, layers=layers, hidden=hidden, experts=experts, top_k=top_k, vocab=vocab)
    if family not in ALL_FAMILIES:
        raise ValueError(f"family = {family!r}: must be one of {', '.join(ALL_FAMILIES)}")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    defaults = cls().to_dict()
    scale = {
        **_SHRINK,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": 2 * hidden,
        "shared_expert_intermediate_size": 2 * hidden,
        "head_dim": hidden // 4,
    }
    for k in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"):
        scale[k] = experts
    for k in (
        "num_experts_per_tok",
        "num_experts_per_token",
        "moe_top_k",
        "moe_topk",
        "top_k_experts",
        "moe_k",
    ):
        scale[k] = top_k
    kw = {k: v for k, v in scale.items() if k in defaults}
    kw.update(_EXTRA.get(family, {}))
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if k in defaults:
            kw[k] = None
    return cls(**kw)


def build(
    family: str,
    *,
    seed: int = 0,
    layers: int = 4,
    hidden: int = 64,
    experts: int = 8,
    top_k: int = 2,
    vocab: int = 256,
    aux_loss_coef: float = 0.01,
) -> nn.Module:
    """A random-init causal LM of `family` (fp32, CPU, eager attention), trained as people train
    them from scratch: with the family's load-balancing aux loss on (`output_router_logits`,
    weight `aux_loss_coef`; 0 turns it off) where the family has one. Selection-bias families
    (DeepSeek-V3 and descendants, afmoe, ernie4_5_moe...) balance through their bias instead
    (see attach(bias_update=...))."""
    import transformers as tf

    cfg = _config(family, layers=layers, hidden=hidden, experts=experts, top_k=top_k, vocab=vocab)
    cfg._attn_implementation = "eager"
    cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = None  # defaults point past a 256-token vocab
    if family != "deepseek_v3" and hasattr(cfg, "router_aux_loss_coef"):
        cfg.output_router_logits = aux_loss_coef > 0
        cfg.router_aux_loss_coef = aux_loss_coef
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    _fill_hash_tables(model, seed)
    return model


def _fill_hash_tables(model: nn.Module, seed: int) -> None:
    """DeepSeek-V4's hash-routed layers pick experts by a frozen token -> experts table
    (`tid2eid`) that a random init leaves all zeros ("real values come from the checkpoint"): every
    token to expert 0, a collapse by construction that no router or bias can move. Fill it as a
    checkpoint would: each token its own top_k distinct experts, drawn per layer from `seed`."""
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        table = getattr(mod, "tid2eid", None)
        n_experts = getattr(mod, "num_experts", 0)
        if isinstance(table, torch.Tensor) and n_experts and not table.is_floating_point():
            vocab, k = table.shape
            draws = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(vocab)])
            table.copy_(draws.to(table.dtype))
