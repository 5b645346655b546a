"""torchtitan DeepSeek-V3 models that train on CPU, for the torchtitan tests and benches.

Both are built from torchtitan's own config builders, with torchtitan's own
ScaledDotProductAttention as each layer's inner attention: torchtitan refuses "sdpa" as a
language model's attn_backend, FlexAttention has no CPU backward and varlen needs CUDA.

One builder (`moe_config` of a `MoEShape`) serves `small` and the GPU bench's models
(bench/gpu/tt_registry.py).

  small:      dim 64, 4 blocks (1 dense + 3 MoE), 8 experts top-2 + 1 shared, softmax scores,
              expert_bias_E (torchtitan's aux-loss-free balancing), byte vocabulary (256)
  debugmodel: torchtitan 0.3.0's own DeepSeek-V3 "debugmodel" flavor, as its model registry
              builds it (dim 256, 6 blocks: 1 dense + 5 MoE, 8 experts top-3 + 2 shared, MLA,
              yarn RoPE, vocab 2048; byte tokens use its first 256 ids)

torchtitan's ParallelDims (which its load-balancing hook needs) wants a process group:
`one_process_group` starts a one-rank gloo group when none is up.

Not under guard/: these are test and bench builders, and guard must not carry them.

Writes docs/BENCHMARKS.md: no section of its own; the models of Overhead › Guard overhead on
torchtitan DeepSeek-V3 (small), 256 tokens a step and of the GPU bench.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MODELS = ("small", "debugmodel")
SMALL_VOCAB, SMALL_DIM, SMALL_SEQ = 256, 64, 64


def with_cpu_attention(config: Any) -> Any:
    """The same config with every layer's inner attention swapped for torchtitan's own SDPA."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


@dataclass(kw_only=True, slots=True)
class MoEShape:
    """The sizes of a DeepSeek-V3-style MoE: MLA attention (no q LoRA), one dense block, then MoE
    blocks of routed experts plus shared ones."""

    dim: int
    blocks: int
    heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    dense_hidden: int
    moe_hidden: int
    experts: int
    shared_experts: int
    top_k: int
    score_func: str = "softmax"  # or "sigmoid" (DeepSeek-V3's own)

    def __post_init__(self) -> None:
        if self.blocks < 2:
            raise ValueError(f"MoEShape.blocks = {self.blocks}: one dense block and at least one MoE block")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"MoEShape.top_k = {self.top_k}: between 1 and experts ({self.experts})")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEShape.score_func = {self.score_func!r}: softmax or sigmoid")


SMALL = MoEShape(
    dim=SMALL_DIM,
    blocks=4,
    heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    dense_hidden=128,
    moe_hidden=64,
    experts=8,
    shared_experts=1,
    top_k=2,
)


def moe_config(shape: MoEShape, *, max_seq_len: int, vocab: int = SMALL_VOCAB) -> Any:
    """A DeepSeekV3Model.Config of `shape` from torchtitan's own builders, with CPU-capable
    attention (`with_cpu_attention`); max_seq_len sizes the RoPE table."""
    import torchtitan.models.deepseek_v3 as ds
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    s, dim = shape, shape.dim
    layers = ds.build_mla_moe_layers(
        n_layers=s.blocks,
        n_dense_layers=1,
        dim=dim,
        n_heads=s.heads,
        q_lora_rank=0,
        kv_lora_rank=s.kv_lora_rank,
        qk_nope_head_dim=s.qk_nope_head_dim,
        qk_rope_head_dim=s.qk_rope_head_dim,
        v_head_dim=s.v_head_dim,
        mscale=1.0,
        dense_hidden_dim=s.dense_hidden,
        moe_hidden_dim=s.moe_hidden,
        num_experts=s.experts,
        num_shared_experts=s.shared_experts,
        router_top_k=s.top_k,
        router_score_func=s.score_func,
        attn_backend="flex",  # replaced by SDPA below
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=ds._LINEAR_INIT,
        norm_init=ds._NORM_INIT,
        depth_init=ds._depth_init,
        depth_experts_init=ds._depth_experts_init,
        rope=ComplexRoPE.Config(dim=s.qk_rope_head_dim, max_seq_len=max_seq_len, theta=10000.0),
    )
    return with_cpu_attention(
        ds.DeepSeekV3Model.Config(
            vocab_size=vocab,
            dim=dim,
            layers=layers,
            mtp_layers=[],
            tok_embeddings=Embedding.Config(
                num_embeddings=vocab, embedding_dim=dim, param_init=ds._EMBEDDING_INIT
            ),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=ds._NORM_INIT),
            lm_head=Linear.Config(
                in_features=dim, out_features=vocab, param_init=ds._output_linear_init(dim)
            ),
        )
    )


def small_config(*, max_seq_len: int = SMALL_SEQ) -> Any:
    """A DeepSeekV3Model.Config smaller than debugmodel (SMALL), from torchtitan's own builders."""
    return moe_config(SMALL, max_seq_len=max_seq_len)


def debugmodel_config() -> Any:
    """torchtitan's own DeepSeek-V3 debugmodel flavor, as its model registry builds it."""
    from torchtitan.models.deepseek_v3 import model_registry

    return with_cpu_attention(model_registry("debugmodel").model)


def model_config(name: str, *, max_seq_len: int = SMALL_SEQ) -> Any:
    """The config of one of MODELS; max_seq_len sizes the small model's RoPE table (debugmodel's
    own covers 16384 positions)."""
    if name == "small":
        return small_config(max_seq_len=max_seq_len)
    if name == "debugmodel":
        return debugmodel_config()
    raise ValueError(f"unknown torchtitan model {name!r}: one of {', '.join(MODELS)}")


def build(config: Any, *, seed: int = 0) -> nn.Module:
    """The model in train mode, its weights initialised by torchtitan from `seed`."""
    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


@contextmanager
def one_process_group() -> Iterator[Any]:
    """torchtitan's ParallelDims for one rank, over a one-process gloo group started (and torn
    down) here unless one is already up."""
    from torchtitan.distributed import ParallelDims

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    finally:
        if started:
            dist.destroy_process_group()
