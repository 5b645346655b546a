"""FLOP accounting for MFU: analytic training FLOPs per token of moeguard's model.

Convention (torchtitan): training FLOPs per token = 6 * N_active + 12 * L * H * K * T.
- 6 * N_active: every matmul weight costs 2 FLOPs per token forward and 4 backward (input and
  weight gradients). N_active counts the matmul weights one token meets: router gates,
  attention projections, shared experts, routed experts * top_k / n_experts, dense FFNs and the
  output head. The input embedding is a lookup, not a matmul, and is excluded (a tied
  embedding is counted once, as the output head). Norm weights are elementwise and excluded.
- 12 * L * H * K * T: attention scores (Q K^T) and the weighted sum (P V) at 2*T*K FLOPs per
  token and head each, times 3 for forward + backward. No causal discount: the full T x T
  product is counted, as torchtitan and `torch.utils.flop_counter` do, although causal
  kernels skip about half of it. Compare MFU numbers only under the same convention.

Peak FLOP/s (the device's, shared with every integration) live in guard/runtime/peak.py;
`python -m trainer.flops --pin` is `python -m guard.runtime.peak --pin`.
"""

from __future__ import annotations

from trainer.model import ModelConfig

# ---------------------------------------------------------------------------------------------
# Analytic counts.


def active_params(cfg: ModelConfig) -> float:
    """Matmul parameters one token passes through (routed experts weighted by top_k/E)."""
    D = cfg.d_model
    n_moe = cfg.n_layers - cfg.dense_layers
    attn = 4 * D * D  # wq, wk, wv, wo
    swiglu = 3 * D  # per unit of hidden size: w1, w3 (D -> h) and w2 (h -> D)
    moe = D * cfg.n_experts + swiglu * cfg.d_expert * (cfg.top_k + cfg.n_shared_experts)
    dense = swiglu * cfg.d_dense
    head = D * cfg.vocab_size
    return float(cfg.n_layers * attn + n_moe * moe + cfg.dense_layers * dense + head)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """12 * n_layers * n_heads * head_dim * seq_len (fwd+bwd of QK^T and PV, no causal discount)."""
    return float(12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token: 6 * active_params + attention term."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return 6.0 * active_params(cfg) + attention_flops_per_token(cfg, seq_len)


# The peak rules moved to guard/runtime/peak.py (one MFU for every loop); re-exported for callers.
from guard.runtime.peak import (  # noqa: E402
    CPU_PEAKS_FILE,
    GPU_PEAK_BF16,
    cpu_machine_class,
    load_cpu_peaks,
    main,
    measure_cpu_core_peak,
    measure_cpu_peaks,
    peak_flops,
    pinned_cpu_peak,
    write_cpu_peaks,
)

__all__ = [
    "CPU_PEAKS_FILE",
    "GPU_PEAK_BF16",
    "active_params",
    "attention_flops_per_token",
    "cpu_machine_class",
    "flops_per_token",
    "load_cpu_peaks",
    "measure_cpu_core_peak",
    "measure_cpu_peaks",
    "peak_flops",
    "pinned_cpu_peak",
    "write_cpu_peaks",
]

if __name__ == "__main__":
    raise SystemExit(main())
