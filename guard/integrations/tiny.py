"""Tiny random-init transformers MoE models of every supported family, for drills, tests and
benchmarks: built from a config, nothing downloaded. 4 layers, hidden 64, 8 experts, top-2 by
default (the shape the real-model issue was measured on).

    model = build("mixtral", seed=0)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def _config(family: str, *, layers: int, hidden: int, experts: int, top_k: int, vocab: int) -> Any:
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
    raise ValueError(f"family = {family!r}: must be one of {FAMILIES}")


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
    weight `aux_loss_coef`; 0 turns it off). DeepSeek-V3 balances through its selection bias
    instead (see attach(bias_update_rate=...))."""
    import transformers as tf

    cfg = _config(family, layers=layers, hidden=hidden, experts=experts, top_k=top_k, vocab=vocab)
    cfg._attn_implementation = "eager"
    cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = None  # defaults point past a 256-byte vocab
    if family != "deepseek_v3":
        cfg.output_router_logits = aux_loss_coef > 0
        cfg.router_aux_loss_coef = aux_loss_coef
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg)
