"""The model's config ([model] table): validated on load, without importing torch, so a bad
config is refused before the seconds torch takes to import (trainer/cli.py). trainer/model.py
builds the model from it and re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

from guard.core.tomlconf import check, check_choice

ATTENTION_CHOICES = ("auto", "math", "flash", "efficient", "cudnn")
EXPERTS_KERNELS = ("loop", "bmm", "grouped_mm")

SCORE_FUNCS = ("softmax", "sigmoid")
BIAS_MODES = ("off", "sign", "smebu")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 256
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 256  # F: hidden size of each routed (and each shared) expert
    n_shared_experts: int = 0  # always-on experts, merged into one SwiGLU of hidden n*d_expert
    dense_layers: int = 0  # the first N blocks use a dense SwiGLU of hidden d_dense
    d_dense: int = 512
    score_func: str = "softmax"
    route_norm: bool = True  # renormalise the top-k gate weights to sum to 1
    aux_loss_coef: float = 0.0  # switch-style load-balancing loss; 0 = off
    bias_mode: str = "off"  # aux-loss-free balancing: "sign" (DeepSeek-V3) or "smebu"
    bias_rate: float = 1e-3  # sign mode: u
    smebu_lambda: float = 5e-4
    smebu_kappa: float = 2.0
    smebu_beta: float = 0.5
    attention: str = "auto"
    experts_kernel: str = "loop"
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "n_experts"):
            check(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")
        check(
            self.d_model % self.n_heads == 0,
            "d_model",
            self.d_model,
            f"must be divisible by n_heads ({self.n_heads})",
        )
        check(
            (self.d_model // self.n_heads) % 2 == 0,
            "n_heads",
            self.n_heads,
            "head dim d_model/n_heads must be even for RoPE",
        )
        check(
            1 <= self.top_k <= self.n_experts,
            "top_k",
            self.top_k,
            f"must be in [1, n_experts={self.n_experts}]",
        )
        check(self.d_expert >= 1, "d_expert", self.d_expert, "must be >= 1")
        check(self.n_shared_experts >= 0, "n_shared_experts", self.n_shared_experts, "must be >= 0")
        check(
            0 <= self.dense_layers <= self.n_layers,
            "dense_layers",
            self.dense_layers,
            f"must be in [0, n_layers={self.n_layers}]",
        )
        check(self.d_dense >= 1, "d_dense", self.d_dense, "must be >= 1")
        check_choice("score_func", self.score_func, SCORE_FUNCS)
        check(self.aux_loss_coef >= 0, "aux_loss_coef", self.aux_loss_coef, "must be >= 0")
        check_choice("bias_mode", self.bias_mode, BIAS_MODES)
        check(self.bias_rate >= 0, "bias_rate", self.bias_rate, "must be >= 0")
        check(self.smebu_lambda >= 0, "smebu_lambda", self.smebu_lambda, "must be >= 0")
        check(self.smebu_kappa > 0, "smebu_kappa", self.smebu_kappa, "must be > 0")
        check(0 <= self.smebu_beta < 1, "smebu_beta", self.smebu_beta, "must be in [0, 1)")
        check_choice("attention", self.attention, ATTENTION_CHOICES)
        check_choice("experts_kernel", self.experts_kernel, EXPERTS_KERNELS)
        check(self.rope_theta > 0, "rope_theta", self.rope_theta, "must be > 0")
        check(self.init_std > 0, "init_std", self.init_std, "must be > 0")
        check(self.norm_eps > 0, "norm_eps", self.norm_eps, "must be > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
