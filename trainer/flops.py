"""FLOP accounting for MFU: analytic training FLOPs per token and the device's peak FLOP/s.

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

Peak FLOP/s: a table of bf16 dense peaks per GPU model, matched on the CUDA device name; an
unknown GPU gets no peak (MFU is not computed rather than guessed). On CPU the peak is measured
with a matmul probe, once per process.
"""

from __future__ import annotations

import time

import torch

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


# ---------------------------------------------------------------------------------------------
# Peak FLOP/s.

# bf16 dense (no sparsity) peaks from vendor datasheets; see docs REFERENCE. Matched in order on
# the lower-cased device name; every listed token must appear. More specific entries first.
GPU_PEAK_BF16: list[tuple[tuple[str, ...], float, str]] = [
    (("gb200",), 2.5e15, "GB200"),
    (("b200",), 2.25e15, "B200"),
    (("b300",), 2.25e15, "B300"),
    (("h200",), 989e12, "H200"),
    (("h100", "nvl"), 835e12, "H100 NVL"),
    (("h100", "pcie"), 756e12, "H100 PCIe"),
    (("h100", "hbm3"), 989e12, "H100 SXM"),
    (("h100", "sxm"), 989e12, "H100 SXM"),
    (("a100",), 312e12, "A100"),
    # One MI250X package is two GCDs and torch sees each GCD as a device: 383e12 / 2 each.
    (("mi250x",), 383e12 / 2, "MI250X (one GCD: half of 383e12 per package)"),
    (("mi300x",), 1307e12, "MI300X"),
]
# Names that contain a table token but are a different part: never guess.
_NOT_IN_TABLE = ("h200 nvl", "gh200", "gb300", "mi300a")

_CACHE: dict[tuple[str, int | None, torch.dtype], tuple[float | None, str]] = {}


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> tuple[float | None, str]:
    """(peak FLOP/s or None, where the number came from). Cached per process."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    key = (device.type, index, dtype)
    if key not in _CACHE:
        if device.type == "cpu":
            _CACHE[key] = _cpu_probe(dtype)
        elif device.type == "cuda":
            _CACHE[key] = _gpu_table(torch.cuda.get_device_name(index), dtype)
        else:
            _CACHE[key] = (None, f"unknown device '{device}': MFU not computed")
    return _CACHE[key]


def _gpu_table(name: str, dtype: torch.dtype) -> tuple[float | None, str]:
    low = name.lower()
    if not any(bad in low for bad in _NOT_IN_TABLE):
        for tokens, peak, label in GPU_PEAK_BF16:
            if all(t in low for t in tokens):
                if dtype not in (torch.bfloat16, torch.float16):
                    return (
                        None,
                        f"'{name}': table has bf16/fp16 dense peaks only, not {dtype}: MFU not computed",
                    )
                return peak, f"table: {label} bf16 dense ('{name}')"
    return None, f"unknown device '{name}': MFU not computed"


def _cpu_probe(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> tuple[float, str]:
    """Best-of-N achieved FLOP/s of an n x n matmul on the threads torch uses."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool, allocator, kernel selection
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    return 2.0 * n**3 / best, f"measured: cpu matmul probe {name} {torch.get_num_threads()} threads"
