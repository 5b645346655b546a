"""torchtitan configs of the GPU bench: a DeepSeek-V3-style MoE sized for one H100/H200, and the
same builder tiny for `--dry` on CPU.

    python -m bench.gpu.tt_main --module bench.gpu.tt_registry --config gpu_moe --training.steps 40

`gpu_moe` (~1.36 B parameters, ~0.26 B active a token): dim 1024, 13 blocks (1 dense + 12 MoE),
MLA (16 heads, kv_lora_rank 512, qk 128 + 64 rope, v 128), 64 routed experts of hidden 512, top-6,
2 shared, sigmoid scores with torchtitan's aux-loss-free expert bias, bf16 autocast, batch 2 x
seq 4096. Attention is torchtitan's ScaledDotProductAttention (SDPA: flash on an H100/H200 in
bf16) so one config runs on CUDA and on the CPU of the dry run. `dry_moe` is the same shape at dim
64, 3 blocks, 8 experts top-2, seq 64. Both are built by bench/common/torchtitan_model.py's
`moe_config`, the one DeepSeek-V3 builder of the torchtitan tests and benches.

The Trainer.Config is bench/common/torchtitan_registry.py's job (byte tokenizer, stdlib windows, its
FaultyLoss with the step timer of $MOEGUARD_TT_TIMING_DIR, torchtitan's own balancing hook) with
this model swapped in, checkpointing off (a 1.4 B model's save would eat the time box).

Writes docs/BENCHMARKS.md › GPU, through `bench/gpu/report.py`: no section of its own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench.common.torchtitan_model import SMALL, MoEShape, moe_config
from bench.common.torchtitan_registry import job

LOG_FREQ = 5  # torchtitan's log steps (its mfu(%), and a host sync the overhead window starts on)
# name: (shape, batch, seq)
SIZES: dict[str, tuple[MoEShape, int, int]] = {
    "gpu": (
        MoEShape(
            dim=1024,
            blocks=13,
            heads=16,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            dense_hidden=2816,
            moe_hidden=512,
            experts=64,
            shared_experts=2,
            top_k=6,
            score_func="sigmoid",
        ),
        2,
        4096,
    ),
    # the test model's shape (bench/common/torchtitan_model.SMALL), one block less, with the GPU
    # shape's sigmoid router, so the dry run drives the same router code as the GPU run
    "dry": (
        replace(SMALL, blocks=3, score_func="sigmoid"),
        2,
        64,
    ),
}


def _job(size: str) -> Any:
    shape, batch, seq = SIZES[size]
    cfg = job("small", steps=40, batch=batch, seq=seq, interval=100_000)
    cfg.model_spec.model = moe_config(shape, max_seq_len=seq)
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
