"""Tests for trainer/flops.py (the analytic count against torch's FLOP counter) and guard/runtime/peak.py (peak FLOP/s)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import guard.runtime.peak as peak
import trainer.flops as flops
from trainer.flops import active_params, attention_flops_per_token, flops_per_token, peak_flops
from trainer.model import ModelConfig, MoETransformer


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls: one thread is as fast, and immune to OpenMP oversubscription on a busy box.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def measured_train_flops(cfg: ModelConfig, B: int, T: int) -> int:
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter:
        logits, aux = model(tokens)
        (logits.square().mean() + aux).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(n_shared_experts=1, dense_layers=1, aux_loss_coef=0.01),
        dict(tie_embeddings=True, n_experts=4, top_k=1, route_norm=False, score_func="sigmoid"),
    ],
)
def test_analytic_flops_match_flop_counter(extra: dict) -> None:
    # Why the match is exact here rather than approximate:
    # - the loop kernel runs every expert on exactly the tokens routed to it, N*k token-expert
    #   pairs in all, which is what 6 * top_k * (3*D*F) per token assumes; whichever experts
    #   are picked, the count is the same (the bmm kernel would also count its zero padding,
    #   and FlopCounterMode has no formula for torch._grouped_mm, so it would count nothing);
    # - attention="math": the CPU flash SDPA kernel has no FLOP formula in FlopCounterMode,
    #   the math path is plain bmm and counts the full T x T products (no causal discount),
    #   as the analytic 12*L*H*K*T term does;
    # - every matmul has both gradients computed (the embedding output requires grad), so
    #   backward is exactly 2x forward; norms, softmax, RoPE and the loss are elementwise and
    #   neither side counts them.
    cfg = ModelConfig(attention="math", experts_kernel="loop", **extra)
    B, T = 2, 64
    measured = measured_train_flops(cfg, B, T)
    analytic = flops_per_token(cfg, T) * B * T
    assert measured == pytest.approx(analytic, rel=0.10)
    assert measured == pytest.approx(analytic, rel=1e-9)  # and in fact exactly


def test_attention_term_and_active_params() -> None:
    cfg = ModelConfig(n_shared_experts=2, dense_layers=1)
    T = 128
    assert attention_flops_per_token(cfg, T) == 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * T
    assert flops_per_token(cfg, T) == 6 * active_params(cfg) + attention_flops_per_token(cfg, T)
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    norm_weights = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert active_params(cfg) == model.n_params(active=True) - norm_weights
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(cfg, 0)


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peak, "_CACHE", {})


def fake_gpu(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)


def test_unknown_gpu_gets_no_peak(monkeypatch: pytest.MonkeyPatch, fresh_cache: None) -> None:
    fake_gpu(monkeypatch, "Frobnitz X9000")
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16) == (
        None,
        "unknown device 'Frobnitz X9000': MFU not computed",
    )


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA B300 SXM6 AC", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("AMD Instinct MI300X", 1307e12),
        ("AMD Instinct MI250X/MI250", 383e12 / 2),
        # Parts that share a token with the table but are different chips: no guess.
        ("NVIDIA H100", None),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA GH200 480GB", None),
        ("AMD Instinct MI300A", None),
        ("NVIDIA A10", None),
    ],
)
def test_gpu_table(monkeypatch: pytest.MonkeyPatch, fresh_cache: None, name: str, peak: float | None) -> None:
    fake_gpu(monkeypatch, name)
    value, source = peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert value == peak
    assert name in source
    if peak is None:
        assert "MFU not computed" in source


def test_gpu_table_is_bf16_only(monkeypatch: pytest.MonkeyPatch, fresh_cache: None) -> None:
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    value, source = peak_flops(torch.device("cuda", 0), torch.float32)
    assert value is None and "MFU not computed" in source


def test_cpu_peak_is_pinned_per_machine_class(
    monkeypatch: pytest.MonkeyPatch, fresh_cache: None, tmp_path
) -> None:
    """Issue #17: no run measures its own CPU peak; the peak comes from the pinned file, or there is none."""

    def no_measuring(*a, **k):
        raise AssertionError("a run must not measure its own CPU peak")

    monkeypatch.setattr(peak, "measure_cpu_core_peak", no_measuring)
    value, source = peak_flops("cpu", torch.float32)
    # the run's share of the class's cores: a 1-thread run on a pinned 2-core class gets half
    assert (value, source) == flops.pinned_cpu_peak(torch.float32, threads=torch.get_num_threads())
    assert peak_flops(torch.device("cpu"), torch.float32) == (value, source)  # cached
    assert flops.cpu_machine_class() in source
    if value is None:
        assert "MFU not computed" in source and "--pin" in source
    else:
        assert source.startswith("pinned: ") and "configs/cpu_peaks.toml" in source

    f = tmp_path / "peaks.toml"
    flops.write_cpu_peaks(
        {"cpu-x-8c": {"cores": 8, "fp32": 1.5e11, "measured": "2026-01-02", "method": 'm \\ "q"'}}, f
    )
    assert flops.load_cpu_peaks(f)["cpu-x-8c"]["method"] == 'm \\ "q"'
    assert flops.pinned_cpu_peak(torch.float32, "cpu-x-8c", f) == (
        1.5e11,
        f'pinned: cpu-x-8c fp32 in {f}, measured 2026-01-02 (m \\ "q")',
    )
    v, why = flops.pinned_cpu_peak(torch.bfloat16, "cpu-x-8c", f)  # no bf16 entry: no guess
    assert v is None and "no pinned bf16 peak for CPU class cpu-x-8c" in why
    assert flops.pinned_cpu_peak(torch.float32, "cpu-y-2c", f)[0] is None


def test_machine_class_is_cpu_model_and_cores_never_the_host() -> None:
    import socket

    info = {"vendor_id": "AuthenticAMD", "cpu family": "26", "model": "2", "model name": "AMD EPYC"}
    assert flops.cpu_machine_class(info, 2) == "cpu-authenticamd-amd-epyc-f26-m2-2c"
    assert flops.cpu_machine_class(info, 4) != flops.cpu_machine_class(info, 2)
    assert flops.cpu_machine_class({**info, "model": "17"}, 2) != flops.cpu_machine_class(info, 2)
    assert socket.gethostname().lower() not in flops.cpu_machine_class()


def test_committed_cpu_peaks_file_is_valid() -> None:
    classes = flops.load_cpu_peaks()
    assert classes, "configs/cpu_peaks.toml pins no machine class"
    for cls, e in classes.items():
        assert cls.startswith("cpu-") and cls.endswith(f"-{e['cores']}c"), cls
        assert e["fp32"] > 1e9 and e["measured"] and e["method"], cls
