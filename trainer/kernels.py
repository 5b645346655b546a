"""Kernels the model can run, and which of them run here: SDPA backend probing, the experts
kernel check, and the row-grouped matmul op.

Each choice is resolved once per (device, dtype) with a tiny forward+backward, so a kernel this
device, dtype or torch build cannot run fails at model build with a clear message instead of
mid-step. trainer/model.py calls these; it holds no kernel knowledge of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from guard.core.tomlconf import check_choice
from trainer.model_config import ATTENTION_CHOICES as ATTENTION_CHOICES
from trainer.model_config import EXPERTS_KERNELS as EXPERTS_KERNELS

# ---------------------------------------------------------------------------------------------
# Backend resolution: decide once per (device, dtype) what will actually run, and fail early.

_SDPA_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
_SDPA_NAMES = {int(v.value): k for k, v in _SDPA_BACKENDS.items()}


def default_compute_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype activations have in attention and experts: bf16 autocast on GPU, fp32 on CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _probe_qkv(
    device: torch.device, dtype: torch.dtype, n_heads: int, head_dim: int, seq_len: int
) -> torch.Tensor:
    return torch.randn(1, n_heads, seq_len, head_dim, device=device, dtype=dtype)


def resolve_attention_backend(
    cfg_value: str,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    n_heads: int = 4,
    head_dim: int = 32,
    seq_len: int = 64,
) -> str:
    """Name of the SDPA backend that causal attention uses for `cfg_value` on `device`/`dtype`.

    "auto" asks SDPA's own dispatcher (`torch._fused_sdp_choice`, the function
    `scaled_dot_product_attention` calls) for a representative shape; a forced backend is
    probed with a tiny forward+backward and raises ValueError when it cannot run there.
    """
    check_choice("attention", cfg_value, ATTENTION_CHOICES)
    device = torch.device(device)
    # requires_grad: training inputs; on CUDA the choice can depend on backward support.
    q = _probe_qkv(device, dtype, n_heads, head_dim, min(seq_len, 64)).requires_grad_(True)
    if cfg_value == "auto":
        try:
            choice = int(torch._fused_sdp_choice(q, q, q, None, 0.0, True))
        except (AttributeError, RuntimeError, TypeError):
            choice = -1
        if choice in _SDPA_NAMES:
            return _SDPA_NAMES[choice]
        # Dispatcher not introspectable here: the first backend that runs, in SDPA's order.
        order = ("cudnn", "flash", "efficient", "math") if device.type == "cuda" else ("flash", "math")
        for name in order:
            if _sdpa_runs(name, q):
                return name
        raise ValueError(f"attention='auto': no SDPA backend runs on {device} with {dtype}")
    if not _sdpa_runs(cfg_value, q):
        raise ValueError(
            f"attention={cfg_value!r} is not available on {device} with {dtype} (torch {torch.__version__})"
        )
    return cfg_value


def _sdpa_runs(name: str, q: torch.Tensor) -> bool:
    q = q.detach().requires_grad_(True)
    try:
        with sdpa_kernel(_SDPA_BACKENDS[name]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError:
        return False
    return True


def resolve_experts_kernel(
    cfg_value: str, device: torch.device | str, dtype: torch.dtype, *, d_model: int = 16, d_expert: int = 32
) -> str:
    """Check that the experts kernel can run on `device`/`dtype`; ValueError when it cannot.

    grouped_mm is probed (forward + backward against per-group matmuls, with an empty group)
    at the model's own D and F: CUDA kernels also constrain strides (16-byte alignment).
    """
    check_choice("experts_kernel", cfg_value, EXPERTS_KERNELS)
    device = torch.device(device)
    if cfg_value == "grouped_mm" and not _grouped_mm_runs(device, dtype, d_model, d_expert):
        raise ValueError(
            f"experts_kernel='grouped_mm' is not available on {device} with torch {torch.__version__}"
            f" (dtype {dtype}, D={d_model}, F={d_expert}); use 'bmm' or 'loop'"
        )
    return cfg_value


_GROUPED_MM_OK: dict[tuple[torch.device, torch.dtype, int, int], bool] = {}


def _grouped_mm_runs(device: torch.device, dtype: torch.dtype, d_model: int = 16, d_expert: int = 32) -> bool:
    key = (device, dtype, d_model, d_expert)
    if key not in _GROUPED_MM_OK:
        _GROUPED_MM_OK[key] = _probe_grouped_mm(device, dtype, d_model, d_expert)
    return _GROUPED_MM_OK[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype, D: int, Fh: int) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(32, D, generator=gen).to(device, dtype).requires_grad_(True)
        w = torch.randn(3, D, Fh, generator=gen).to(device, dtype).requires_grad_(True)
        offs = torch.tensor([16, 16, 32], device=device, dtype=torch.int32)
        y = grouped_mm(x, w, offs)
        (y * y.detach()).sum().backward()
        ref = torch.cat([x[:16] @ w[0], x[16:] @ w[2]])
        ok = torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * D**0.5)
        return bool(ok and w.grad is not None and torch.isfinite(w.grad).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def sdpa_backend(name: str) -> SDPBackend:
    """The SDPBackend a resolved attention name forces (`resolve_attention_backend` returns names)."""
    return _SDPA_BACKENDS[name]


def unavailable_backend(
    e: ValueError, device: torch.device, dtype: torch.dtype, *, n_heads: int, head_dim: int, seq_len: int
) -> str:
    """'model.attention = 'cudnn' is not available on cpu ...; available here: auto, math, flash'."""
    msg = f"model.{e}"
    if str(e).startswith("attention="):
        ok = []
        for name in ATTENTION_CHOICES:
            try:
                resolve_attention_backend(
                    name, device, dtype, n_heads=n_heads, head_dim=head_dim, seq_len=seq_len
                )
                ok.append(name)
            except ValueError:
                pass
        msg += f"; available here: {', '.join(ok) or 'none'} (set it with --set model.attention=...)"
    return msg


# ---------------------------------------------------------------------------------------------
# The row-grouped matmul of the grouped_mm experts kernel.


def grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Row-grouped matmul: rows offs[e-1]:offs[e] of x_MK times w_EKN[e] -> [M, N].

    CUDA bf16 calls `torch._grouped_mm` directly (autograd and inductor know it). Elsewhere it
    goes through a custom op, because in torch 2.13 the fake (meta) kernel of `_grouped_mm`
    accepts only bf16, so the fp32 CPU kernel that runs eagerly would not trace under compile.
    """
    if x_MK.is_cuda and x_MK.dtype == torch.bfloat16:
        return torch._grouped_mm(x_MK, w_EKN, offs=offs_E)
    return _grouped_mm_op(x_MK, w_EKN, offs_E)


@torch.library.custom_op("moeguard::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # 2D x 3D: groups of rows of a; 2D x 2D: groups along the shared K dim -> [E, M, N].
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


def _grouped_mm_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _grouped_mm_backward(ctx, grad_MN: torch.Tensor):  # type: ignore[no-untyped-def]
    x_MK, w_EKN, offs = ctx.saved_tensors
    grad_MN = grad_MN.contiguous()  # the kernel rejects expanded (stride 0) gradients
    grad_x = _grouped_mm_op(grad_MN, w_EKN.transpose(-2, -1).contiguous(), offs)
    grad_w = _grouped_mm_op(x_MK.t(), grad_MN, offs)  # empty groups give zeros
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)
