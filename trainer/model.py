"""A decoder-only Mixture-of-Experts transformer in plain PyTorch.

Reads top to bottom: config -> norm/RoPE/attention -> router -> experts -> MoE layer -> block
-> model; which attention backend and experts kernel run here is trainer/kernels.py's. Router math is fp32 even under autocast; router load and
entropy counters are buffers accumulated without a host sync and read outside `forward`
(the trainer's probe reads them once per step and calls `reset_stats()`).

Shape suffixes:
  B batch, T time, D model dim, H heads, K head dim, E experts, F expert hidden,
  N tokens (B*T), V vocab, k top-k, C per-expert capacity (bmm kernel), M grouped rows.
Expert weight layout: w1_EDF, w3_EDF (gate and up projections, D -> F) and w2_EFD (down,
F -> D), so a token row multiplies as `x_D @ w1_EDF[e]`; the same tensors feed the loop,
`torch.bmm` and `torch._grouped_mm` kernels without a transpose.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from guard.runtime.attention_logits import LogitWatch
from trainer.kernels import (
    default_compute_dtype,
    grouped_mm,
    resolve_attention_backend,
    resolve_experts_kernel,
    sdpa_backend,
)
from trainer.model_config import BIAS_MODES as BIAS_MODES
from trainer.model_config import SCORE_FUNCS as SCORE_FUNCS
from trainer.model_config import ModelConfig as ModelConfig

# ---------------------------------------------------------------------------------------------
# Building blocks.


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 mean-of-squares loses the small-activation tail.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).type_as(x)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin tables precomputed for max_seq_len (not checkpointed)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        inv_freq_K2 = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles_TK2 = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq_K2)
        self.register_buffer("cos_TK2", angles_TK2.cos().float(), persistent=False)
        self.register_buffer("sin_TK2", angles_TK2.sin().float(), persistent=False)

    def forward(self, x_BHTK: torch.Tensor) -> torch.Tensor:
        T = x_BHTK.shape[-2]
        cos, sin = self.cos_TK2[:T], self.sin_TK2[:T]
        x1, x2 = x_BHTK.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.type_as(x_BHTK)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.sdpa_backend: SDPBackend | None = None  # None = let SDPA choose ("auto")
        # the guard's max-logit sampler arms it on every k-th step; else one bool test per forward
        self.logit_watch = LogitWatch()

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q_BHTK = self.wq(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k_BHTK = self.wk(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v_BHTK = self.wv(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        q_BHTK, k_BHTK = self.rope(q_BHTK), self.rope(k_BHTK)
        if self.logit_watch.armed:  # the logits SDPA is about to use (causal, 1/sqrt(K))
            self.logit_watch.observe(q_BHTK, k_BHTK)
        if self.sdpa_backend is None:
            o_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        else:
            with sdpa_kernel(self.sdpa_backend):
                o_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        return self.wo(o_BHTK.transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    """Dense FFN (dense layers and the merged shared experts): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ---------------------------------------------------------------------------------------------
# Router: token-choice top-k. The expert bias steers selection only; gate weights come from the
# unbiased scores (DeepSeek-V3 aux-loss-free balancing).


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E = cfg.n_experts
        self.n_experts, self.top_k = E, cfg.top_k
        self.score_func, self.route_norm = cfg.score_func, cfg.route_norm
        self.bias_mode, self.bias_rate = cfg.bias_mode, cfg.bias_rate
        self.smebu_lambda, self.smebu_kappa, self.smebu_beta = (
            cfg.smebu_lambda,
            cfg.smebu_kappa,
            cfg.smebu_beta,
        )
        self.gate = nn.Linear(cfg.d_model, E, bias=False)
        # Balancing state: checkpointed.
        self.register_buffer("expert_bias_E", torch.zeros(E), persistent=True)
        self.register_buffer("bias_momentum_E", torch.zeros(E), persistent=True)
        # Fault-injection drills add to the logits to simulate a drifted router.
        self.register_buffer("logit_offset_E", torch.zeros(E), persistent=False)
        # Stat accumulators since the last reset_stats(); read outside forward.
        self.register_buffer("tokens_per_expert_E", torch.zeros(E), persistent=False)
        self.register_buffer("entropy_sum", torch.zeros(()), persistent=False)
        self.register_buffer("token_count", torch.zeros(()), persistent=False)

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (gate weights_Nk fp32, expert ids_Nk, routing probs_NE fp32, counts_E fp32)."""
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            logits_NE = F.linear(x_ND.float(), self.gate.weight.float()) + self.logit_offset_E
            if self.score_func == "softmax":
                scores_NE = torch.softmax(logits_NE, dim=-1)
                probs_NE = scores_NE
            else:
                scores_NE = torch.sigmoid(logits_NE)
                probs_NE = scores_NE / scores_NE.sum(-1, keepdim=True)
            # The bias is a selection-only offset: no gradient, and not in the gate weights.
            _, experts_Nk = torch.topk(scores_NE.detach() + self.expert_bias_E, self.top_k, dim=-1)
            weights_Nk = scores_NE.gather(-1, experts_Nk)
            if self.route_norm:
                weights_Nk = weights_Nk / (weights_Nk.sum(-1, keepdim=True) + 1e-20)
        with torch.no_grad():
            counts_E = torch.zeros_like(self.tokens_per_expert_E).scatter_add_(
                0, experts_Nk.flatten(), torch.ones(experts_Nk.numel(), device=x_ND.device)
            )
            self.tokens_per_expert_E.add_(counts_E)
            self.entropy_sum.add_(torch.special.entr(probs_NE.detach()).sum())
            self.token_count.add_(x_ND.shape[0])
        return weights_Nk, experts_Nk, probs_NE, counts_E

    def reset_stats(self) -> None:
        self.tokens_per_expert_E.zero_()
        self.entropy_sum.zero_()
        self.token_count.zero_()

    @torch.no_grad()
    def update_bias(
        self, load_E: torch.Tensor, rate_scale: float = 1.0, bias_max: float | None = None
    ) -> None:
        """One balancing step from the global (already cross-rank-reduced) load per expert."""
        if self.bias_mode == "off":
            return
        n_E = load_E.detach().to(self.expert_bias_E.device, torch.float32)
        mean = n_E.mean()
        if self.bias_mode == "sign":
            # DeepSeek-V3: b_i += u * sign(mean - n_i); mean-centred (torchtitan) so b cannot drift.
            delta_E = self.bias_rate * rate_scale * torch.sign(mean - n_E)
            self.expert_bias_E.add_(delta_E - delta_E.mean())
        else:
            # SMEBU: bounded (tanh) relative violation, mean-centred, with momentum.
            v_E = (mean - n_E) / mean.clamp_min(1e-12)
            d_E = self.smebu_lambda * rate_scale * torch.tanh(self.smebu_kappa * v_E)
            d_E = d_E - d_E.mean()
            self.bias_momentum_E.mul_(self.smebu_beta).add_((1 - self.smebu_beta) * d_E)
            self.expert_bias_E.add_(self.bias_momentum_E)
        if bias_max is not None:
            self.expert_bias_E.clamp_(-bias_max, bias_max)


# ---------------------------------------------------------------------------------------------
# Routed experts: SwiGLU per expert, three interchangeable kernels with the same math.


class GroupedExperts(nn.Module):
    GROUP_ALIGN = 16  # rows per group rounded up for _grouped_mm on CUDA (16-byte strides)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, D, Fh = cfg.n_experts, cfg.d_model, cfg.d_expert
        self.n_experts = E
        self.w1_EDF = nn.Parameter(torch.empty(E, D, Fh))
        self.w3_EDF = nn.Parameter(torch.empty(E, D, Fh))
        self.w2_EFD = nn.Parameter(torch.empty(E, Fh, D))
        self.kernel = cfg.experts_kernel
        self.align = 1

    def forward(
        self, x_ND: torch.Tensor, weights_Nk: torch.Tensor, experts_Nk: torch.Tensor, counts_E: torch.Tensor
    ) -> torch.Tensor:
        N, k = experts_Nk.shape
        if self.kernel == "loop":
            return self._loop(x_ND, weights_Nk, experts_Nk)
        # Sort the N*k (token, expert) pairs by expert; a stable sort keeps token order per expert.
        expert_P = experts_Nk.flatten()  # P = N*k pairs
        order_P = torch.argsort(expert_P, stable=True)
        sorted_expert_P = expert_P[order_P]
        token_P = order_P // k
        gate_P = weights_Nk.flatten()[order_P]
        counts_i = counts_E.to(torch.int64)
        starts_E = torch.cumsum(counts_i, 0) - counts_i
        rank_P = torch.arange(N * k, device=x_ND.device) - starts_E[sorted_expert_P]
        x_PD = x_ND[token_P]
        if self.kernel == "bmm":
            y_PD = self._bmm(x_PD, sorted_expert_P, rank_P, counts_i)
        else:
            y_PD = self._grouped(x_PD, sorted_expert_P, rank_P, counts_i)
        out_ND = torch.zeros(N, x_ND.shape[1], device=x_ND.device, dtype=torch.float32)
        out_ND.index_add_(0, token_P, y_PD.float() * gate_P.unsqueeze(-1))
        return out_ND.type_as(x_ND)

    def _swiglu(self, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ w1) * (x @ w3)) @ w2

    def _loop(self, x_ND: torch.Tensor, weights_Nk: torch.Tensor, experts_Nk: torch.Tensor) -> torch.Tensor:
        # Per expert: gather its tokens, run the SwiGLU, scatter-add back (one host sync each).
        out_ND = torch.zeros(x_ND.shape, device=x_ND.device, dtype=torch.float32)
        for e in range(self.n_experts):
            token_idx, slot_idx = torch.where(experts_Nk == e)
            if token_idx.numel() == 0:
                continue
            y = self._swiglu(x_ND[token_idx], self.w1_EDF[e], self.w3_EDF[e], self.w2_EFD[e])
            out_ND.index_add_(0, token_idx, y.float() * weights_Nk[token_idx, slot_idx, None])
        return out_ND.type_as(x_ND)

    def _bmm(
        self, x_PD: torch.Tensor, expert_P: torch.Tensor, rank_P: torch.Tensor, counts_E: torch.Tensor
    ) -> torch.Tensor:
        # Pad every expert to the largest count C (one host sync) -> [E, C, D] batched matmuls.
        E, D = self.n_experts, x_PD.shape[1]
        C = max(int(counts_E.max()), 1)
        slot_P = expert_P * C + rank_P
        buf_MD = x_PD.new_zeros(E * C, D).index_copy(0, slot_P, x_PD)
        x_ECD = buf_MD.view(E, C, D)
        h_ECF = F.silu(torch.bmm(x_ECD, self.w1_EDF)) * torch.bmm(x_ECD, self.w3_EDF)
        y_MD = torch.bmm(h_ECF, self.w2_EFD).reshape(E * C, D)
        return y_MD[slot_P]

    def _grouped(
        self, x_PD: torch.Tensor, expert_P: torch.Tensor, rank_P: torch.Tensor, counts_E: torch.Tensor
    ) -> torch.Tensor:
        # Static row count M = P + E*(align-1): each group starts on an aligned row, padding rows
        # are zeros, and the last group runs to M, so no row is left outside a group and no
        # shape depends on the routing (no host sync; compile-friendly).
        P, D = x_PD.shape
        A = self.align
        M = (P + self.n_experts * (A - 1) + A - 1) // A * A
        padded_E = (counts_E + A - 1) // A * A
        ends_E = torch.cumsum(padded_E, 0)
        slot_P = (ends_E - padded_E)[expert_P] + rank_P
        offs_E = torch.cat([ends_E[:-1], ends_E.new_full((1,), M)]).to(torch.int32)
        dtype = x_PD.dtype
        if torch.is_autocast_enabled(x_PD.device.type):
            dtype = torch.get_autocast_dtype(x_PD.device.type)
        w1, w3, w2 = (w.to(dtype) for w in (self.w1_EDF, self.w3_EDF, self.w2_EFD))
        buf_MD = x_PD.to(dtype).new_zeros(M, D).index_copy(0, slot_P, x_PD.to(dtype))
        h_MF = F.silu(grouped_mm(buf_MD, w1, offs_E)) * grouped_mm(buf_MD, w3, offs_E)
        y_MD = grouped_mm(h_MF, w2, offs_E)
        return y_MD[slot_P]


class MoELayer(nn.Module):
    """Router + routed experts + optional shared expert; contributes a load-balancing aux loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg)
        self.shared = (
            SwiGLU(cfg.d_model, cfg.n_shared_experts * cfg.d_expert) if cfg.n_shared_experts else None
        )
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        # A buffer, not a float: the guard changes it at runtime without a torch.compile recompile.
        self.register_buffer("aux_loss_coef", torch.tensor(float(cfg.aux_loss_coef)), persistent=False)
        self.aux_enabled = cfg.aux_loss_coef > 0  # flips to True once; then only the buffer changes

    def set_aux_loss_coef(self, coef: float) -> None:
        self.aux_loss_coef.fill_(float(coef))
        self.aux_enabled = self.aux_enabled or coef > 0

    def forward(self, x_BTD: torch.Tensor, aux_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        weights_Nk, experts_Nk, probs_NE, counts_E = self.router(x_ND)
        out_ND = self.experts(x_ND, weights_Nk, experts_Nk, counts_E)
        if self.shared is not None:
            out_ND = out_ND + self.shared(x_ND)
        if self.aux_enabled:
            # Switch Transformer: E * sum_i f_i * P_i, f = fraction of routed slots, P = mean prob.
            f_E = counts_E / (B * T * self.top_k)
            aux_loss = aux_loss + self.aux_loss_coef * self.n_experts * (f_E * probs_NE.mean(0)).sum()
        return out_ND.view(B, T, D), aux_loss


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = layer_idx >= cfg.dense_layers
        self.ffn: MoELayer | SwiGLU = MoELayer(cfg) if self.moe else SwiGLU(cfg.d_model, cfg.d_dense)

    def forward(self, x_BTD: torch.Tensor, aux_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        h_BTD = self.ffn_norm(x_BTD)
        if isinstance(self.ffn, MoELayer):
            ffn_BTD, aux_loss = self.ffn(h_BTD, aux_loss)
        else:
            ffn_BTD = self.ffn(h_BTD)
        return x_BTD + ffn_BTD, aux_loss


# ---------------------------------------------------------------------------------------------
# The model.


class MoETransformer(nn.Module):
    """Decoder-only MoE LM. forward(tokens_BT) -> (logits_BTV, aux_loss scalar).

    `attention_backend` and `experts_kernel` name what actually runs; they are resolved when the
    model is built and again whenever it moves to another device or dtype (ValueError when a
    forced choice cannot run there). `compute_dtype` is the activation dtype assumed for that
    check (default bf16 on CUDA, where the trainer autocasts, else the parameter dtype).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_embeddings.weight
        self._init_weights()
        self._compute_dtype_override = compute_dtype
        self._resolved_for: tuple[torch.device, torch.dtype] | None = None
        self.attention_backend: str = cfg.attention
        self.experts_kernel: str = cfg.experts_kernel
        self.compute_dtype: torch.dtype = torch.float32
        if device is not None:
            self.to(device)  # _apply re-resolves
        self._resolve_backends()

    def _init_weights(self) -> None:
        # Deterministic given the global torch seed: modules are initialised in definition order.
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)  # residual-branch outputs (GPT-2)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for block in self.blocks:
            for name, p in block.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                is_out = name.endswith(("attn.wo.weight", "w2.weight", "w2_EFD"))
                nn.init.normal_(p, std=out_std if is_out else std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.head.weight, std=std)

    # -- backend resolution follows the model across devices -----------------------------------

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        out = super()._apply(fn, recurse)
        if getattr(self, "_resolved_for", None) is not None:
            self._resolve_backends()
        return out

    def _resolve_backends(self) -> None:
        p = self.tok_embeddings.weight
        key = (p.device, p.dtype)
        if key == self._resolved_for or p.device.type == "meta":
            return
        cd = self._compute_dtype_override
        if cd is None:
            cd = default_compute_dtype(p.device) if p.dtype == torch.float32 else p.dtype
        attn = resolve_attention_backend(
            self.cfg.attention,
            p.device,
            cd,
            n_heads=self.cfg.n_heads,
            head_dim=self.cfg.head_dim,
            seq_len=self.cfg.max_seq_len,
        )
        kernel = resolve_experts_kernel(
            self.cfg.experts_kernel, p.device, cd, d_model=self.cfg.d_model, d_expert=self.cfg.d_expert
        )
        forced = None if self.cfg.attention == "auto" else sdpa_backend(attn)
        for block in self.blocks:
            block.attn.sdpa_backend = forced
            if isinstance(block.ffn, MoELayer):
                block.ffn.experts.kernel = kernel
                block.ffn.experts.align = GroupedExperts.GROUP_ALIGN if p.device.type == "cuda" else 1
        self.attention_backend, self.experts_kernel, self.compute_dtype = attn, kernel, cd
        self._resolved_for = key

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, tokens_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_BTD = self.tok_embeddings(tokens_BT)
        aux_loss = torch.zeros((), device=tokens_BT.device, dtype=torch.float32)
        for block in self.blocks:
            x_BTD, aux_loss = block(x_BTD, aux_loss)
        logits_BTV = self.head(self.norm(x_BTD))
        return logits_BTV, aux_loss

    # -- hooks for the trainer and the guard ------------------------------------------------------

    def moe_layers(self) -> list[tuple[int, MoELayer]]:
        """(block index, MoE layer) for every MoE block, in order."""
        return [(i, b.ffn) for i, b in enumerate(self.blocks) if isinstance(b.ffn, MoELayer)]

    def reset_stats(self) -> None:
        for _, layer in self.moe_layers():
            layer.router.reset_stats()

    def set_aux_loss_coef(self, layer_idx: int | None, coef: float) -> None:
        """Change the load-balancing loss coefficient of one MoE block (by block index) or all."""
        layers = dict(self.moe_layers())
        if layer_idx is not None and layer_idx not in layers:
            raise ValueError(f"block {layer_idx} is not an MoE layer; MoE blocks: {sorted(layers)}")
        for i, layer in layers.items():
            if layer_idx is None or i == layer_idx:
                layer.set_aux_loss_coef(coef)

    def n_params(self, active: bool = False, include_embeddings: bool = False) -> int:
        """Parameter count; `active` scales routed experts by top_k/n_experts (per-token view).

        The input embedding is excluded unless `include_embeddings`; the output head counts
        (a tied head counts once, as the head).
        """
        emb_id = id(self.tok_embeddings.weight)
        tied = self.cfg.tie_embeddings
        total = 0.0
        seen: set[int] = set()
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) == emb_id and not tied and not include_embeddings:
                continue
            n = float(p.numel())
            if active and name.endswith(("w1_EDF", "w3_EDF", "w2_EFD")):
                n *= self.cfg.top_k / self.cfg.n_experts
            total += n
        return int(round(total))
