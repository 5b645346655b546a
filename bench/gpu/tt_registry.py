"""torchtitan configs of the GPU bench: a DeepSeek-V3-style MoE sized for one H100/H200, and the
same builder tiny for `--dry` on CPU.

    python -m bench.gpu.tt_main --module bench.gpu.tt_registry --config gpu_moe --training.steps 40

`gpu_moe` (~1.36 B parameters, ~0.26 B active a token): dim 1024, 13 blocks (1 dense + 12 MoE),
MLA (16 heads, kv_lora_rank 512, qk 128 + 64 rope, v 128), 64 routed experts of hidden 512, top-6,
2 shared, sigmoid scores with torchtitan's aux-loss-free expert bias, bf16 autocast, batch 2 x
seq 4096. Attention is torchtitan's ScaledDotProductAttention (SDPA: flash on an H100/H200 in
bf16; bench/torchtitan_model.with_cpu_attention) so one config runs on CUDA and on the CPU of the
dry run. `dry_moe` is the same builder at dim 64, 3 blocks, 8 experts top-2, seq 64.

The Trainer.Config is bench/common/torchtitan_registry.py's job (byte tokenizer, stdlib windows, its
FaultyLoss with the step timer of $MOEGUARD_TT_TIMING_DIR, torchtitan's own balancing hook) with
this model swapped in, checkpointing off (a 1.4 B model's save would eat the time box).

Writes docs/BENCHMARKS.md › GPU, through `bench/gpu/report.py`: no section of its own.
"""

from __future__ import annotations

from typing import Any

from bench.common.torchtitan_model import SMALL_VOCAB, with_cpu_attention
from bench.common.torchtitan_registry import job

LOG_FREQ = 5  # torchtitan's log steps (its mfu(%), and a host sync the overhead window starts on)
# name: (dim, blocks, heads, kv_lora, qk_nope, qk_rope, v_head, dense hidden, moe hidden,
#        experts, shared, top-k, batch, seq)
SIZES: dict[str, tuple[int, ...]] = {
    "gpu": (1024, 13, 16, 512, 128, 64, 128, 2816, 512, 64, 2, 6, 2, 4096),
    "dry": (64, 3, 4, 32, 16, 16, 16, 128, 64, 8, 1, 2, 2, 64),
}


def moe_config(size: str) -> Any:
    """A DeepSeekV3Model.Config from torchtitan's own builders (bench/torchtitan_model.small_config's
    recipe at these sizes)."""
    import torchtitan.models.deepseek_v3 as ds
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim, blocks, heads, kv_lora, nope, rope, v, dense, hidden, experts, shared, k, _, seq = SIZES[size]
    layers = ds.build_mla_moe_layers(
        n_layers=blocks,
        n_dense_layers=1,
        dim=dim,
        n_heads=heads,
        q_lora_rank=0,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        mscale=1.0,
        dense_hidden_dim=dense,
        moe_hidden_dim=hidden,
        num_experts=experts,
        num_shared_experts=shared,
        router_top_k=k,
        router_score_func="sigmoid",
        attn_backend="flex",  # replaced by SDPA below
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=ds._LINEAR_INIT,
        norm_init=ds._NORM_INIT,
        depth_init=ds._depth_init,
        depth_experts_init=ds._depth_experts_init,
        rope=ComplexRoPE.Config(dim=rope, max_seq_len=seq, theta=10000.0),
    )
    return with_cpu_attention(
        ds.DeepSeekV3Model.Config(
            vocab_size=SMALL_VOCAB,
            dim=dim,
            layers=layers,
            mtp_layers=[],
            tok_embeddings=Embedding.Config(
                num_embeddings=SMALL_VOCAB, embedding_dim=dim, param_init=ds._EMBEDDING_INIT
            ),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=ds._NORM_INIT),
            lm_head=Linear.Config(
                in_features=dim, out_features=SMALL_VOCAB, param_init=ds._output_linear_init(dim)
            ),
        )
    )


def _job(size: str) -> Any:
    batch, seq = SIZES[size][-2:]
    cfg = job("small", steps=40, batch=batch, seq=seq, interval=100_000)
    cfg.model_spec.model = moe_config(size)
    cfg.model_spec.flavor = f"gpu-bench-{size}"
    cfg.checkpoint.enable = False
    cfg.metrics.log_freq = LOG_FREQ
    if size == "gpu":
        cfg.training.mixed_precision_param = "bfloat16"
    return cfg


def gpu_moe() -> Any:
    """The DeepSeek-V3-style MoE for one H100/H200 (module docstring)."""
    return _job("gpu")


def dry_moe() -> Any:
    """The same builder, tiny, for the CPU dry run."""
    return _job("dry")
