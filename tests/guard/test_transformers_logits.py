"""The max-attention-logit precursor on transformers 5 MoE families (tiny, random init, CPU):
`attach(model, watch_logits=True)` measures the logits the model's own attention used (its q, k
after RoPE and q/k norms, its scaling, its mask), leaves the model's outputs unchanged, reaches
the run store through GuardedStep, and is fully undone by `remove()`; without the flag nothing
is added."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from guard.api import GuardedStep  # noqa: E402
from guard.core import schema  # noqa: E402
from guard.core.config import GuardConfig, PrecursorConfig  # noqa: E402
from guard.integrations.tiny import FAMILIES, build  # noqa: E402
from guard.integrations.transformers import attach, decoder_layers  # noqa: E402
from guard.integrations.transformers_logits import PREFIX  # noqa: E402
from guard.runtime.probe import Probe  # noqa: E402
from guard.store.reader import read_table  # noqa: E402


def _brute_force(q: torch.Tensor, k: torch.Tensor, scaling: float, mask: torch.Tensor | None) -> float:
    """Materialised logits with the model's scaling and mask (causal when it passed none)."""
    q, k = q.detach(), k.detach().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * scaling
    T, S = s.shape[-2:]
    if mask is None:
        s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), -math.inf)
    elif mask.dtype == torch.bool:
        s = s.masked_fill(~mask, -math.inf)
    else:
        s = s + mask.float()
    return float(s.amax())


def _record(model: torch.nn.Module) -> list[list[float]]:
    """Per layer, the brute-force max logit of every call the watches saw."""
    got: list[list[float]] = []
    for blk in decoder_layers(model):
        w = blk.self_attn.logit_watch
        calls: list[float] = []
        got.append(calls)
        real = w.observe

        def observe(q, k, scaling=None, mask=None, real=real, calls=calls):  # type: ignore[no-untyped-def]
            calls.append(_brute_force(q, k, scaling, mask))
            real(q, k, scaling, mask)

        w.observe = observe
    return got


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_guard_measures_the_logits_the_model_used(family: str, impl: str) -> None:
    if family == "gpt_oss" and impl == "sdpa":
        pytest.skip("transformers' GPT-OSS has no SDPA attention (its sinks): eager only")
    torch.manual_seed(0)
    model = build(family, seed=0)
    model.set_attn_implementation(impl)
    x = torch.randint(0, 200, (2, 24))
    pad = torch.ones_like(x)
    pad[1, :5] = 0  # left padding: the mask the model builds, not a plain causal one
    before = model(input_ids=x, attention_mask=pad).logits
    att = attach(model, watch_logits=True)
    assert model.config._attn_implementation == PREFIX + impl
    probe = Probe(
        model, dead_window=10, device=torch.device("cpu"), layers=att.layers, routers=att.routers,
        precursor=PrecursorConfig(max_logit_seqs=0),
    )  # fmt: skip
    want = _record(model)
    out = model(input_ids=x, attention_mask=pad).logits
    assert torch.equal(out, before)  # watching changes nothing the model computes
    out.float().pow(2).mean().backward()
    got = probe.collect(torch.tensor(0.0), 1).precursors["max_logit_L"]
    assert all(len(c) == 1 for c in want), want
    np.testing.assert_allclose(got, [c[0] for c in want], rtol=1e-4)
    assert np.isfinite(got).all() and (got > 0).all()
    # the next step is not sampled (every 10th): the wrapper does not call the watch
    model(input_ids=x, attention_mask=pad)
    assert all(len(c) == 1 for c in want)
    att.remove()
    assert model.config._attn_implementation == impl
    assert not any(hasattr(b.self_attn, "logit_watch") for b in decoder_layers(model))


def test_attach_adds_nothing_unless_asked() -> None:
    model = build("mixtral", seed=0)
    att = attach(model)
    assert model.config._attn_implementation == "eager" and not att.undo
    assert not any(hasattr(b.self_attn, "logit_watch") for b in decoder_layers(model))
    probe = Probe(model, dead_window=10, device=torch.device("cpu"), layers=att.layers, routers=att.routers)
    assert probe.logits is None


def test_guarded_step_stores_the_sampled_max_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build("qwen3_moe", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = GuardConfig(precursor=PrecursorConfig(max_logit_every=5))
    guarded = GuardedStep(model, opt, attach=attach(model, watch_logits=True), run_dir=tmp_path, config=cfg)
    for _ in range(11):
        x = torch.randint(0, 200, (2, 16))
        model(input_ids=x, labels=x).loss.backward()
        guarded.step(model(input_ids=x, labels=x).loss.detach(), tokens=x.numel())
    guarded.close()
    steps = read_table(tmp_path, schema.TABLE_STEPS)["max_logit"].to_numpy()
    assert np.isfinite(steps[[0, 5, 10]]).all() and np.isnan(np.delete(steps, [0, 5, 10])).all(), steps
    layers = read_table(tmp_path, schema.TABLE_LAYERS)
    assert layers.filter(layers["step"] == 5)["max_logit"].is_finite().all()
