"""The max-attention-logit precursor (Kimi K2's QK-clip signal): the device computation against
materialised logits, the probe's every-k-th-step sampling in its one host copy, the run-store
columns, the detector, and a drill on the trainer where growing q/k weights make it fire while a
clean run stays silent."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guard.core import schema
from guard.core.config import GuardConfig, PrecursorConfig, SpikeConfig
from guard.core.detectors.precursor import MaxLogitDetector
from guard.core.detectors.suite import DetectorSuite
from guard.core.report import StepReport
from guard.core.rows import layer_columns, reports_from_columns, steps_columns
from guard.runtime.attention_logits import LogitWatch, max_logit
from guard.runtime.probe import Probe
from guard.store.reader import read_table
from tests.conftest import MICRO, REPO


def _reference(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor) -> float:
    """Materialised logits, max over what the mask allows (k's heads repeated, as GQA does)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return float(s.masked_fill(~allowed, -math.inf).amax())


@pytest.mark.parametrize("chunk", [1 << 24, 5])  # whole, and row chunks smaller than one head
def test_max_logit_matches_the_materialised_logits(chunk: int) -> None:
    torch.manual_seed(0)
    B, H, G, T, K = 3, 4, 2, 9, 8
    q, k = torch.randn(B, H, T, K), torch.randn(B, G, T, K)
    q[0, 0, 0] = 10 * k[0, 0, T - 1]  # the largest logit of all pairs is one the causal mask hides
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert float(max_logit(q, k, chunk_elems=chunk)) == pytest.approx(_reference(q, k, causal), rel=1e-6)
    assert float(max_logit(q, k, n_seqs=1, chunk_elems=chunk)) == pytest.approx(
        _reference(q[:1], k[:1], causal), rel=1e-6
    )
    # the causal mask matters
    assert _reference(q, k, torch.ones(T, T, dtype=torch.bool)) > _reference(q, k, causal)
    # a per-head bool mask, and an additive float mask (what attention functions are handed)
    m = torch.rand(B, H, T, T) > 0.5
    assert float(max_logit(q, k, mask=m, chunk_elems=chunk)) == pytest.approx(_reference(q, k, m), rel=1e-6)
    add = torch.zeros(B, 1, T, T).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert float(max_logit(q, k, mask=add, chunk_elems=chunk)) == pytest.approx(
        _reference(q, k, causal), rel=1e-6
    )
    # keys from earlier positions (S > T): query t sees keys up to t + S - T
    k_long = torch.randn(B, G, T + 3, K)
    allowed = torch.ones(T, T + 3, dtype=torch.bool).tril(diagonal=3)
    assert float(max_logit(q, k_long, chunk_elems=chunk)) == pytest.approx(
        _reference(q, k_long, allowed), rel=1e-6
    )


def test_max_logit_names_a_bad_head_count() -> None:
    with pytest.raises(ValueError, match="3 query heads is not a multiple of 2 key heads"):
        max_logit(torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8))


class Attn(nn.Module):
    """Causal self-attention that lets a LogitWatch see its q and k, as trainer/model.py's does."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.logit_watch = LogitWatch()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # what the watch was shown

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.logit_watch.armed:
            self.logit_watch.observe(q, k)
            self.seen.append((q.detach().clone(), k.detach().clone()))
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [Attn(), nn.Sequential(nn.Linear(32, 32)), Attn()]
        )  # layer 1: no attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def _probe(every: int, seqs: int = 1) -> tuple[Net, torch.optim.Optimizer, Probe]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    cfg = PrecursorConfig(max_logit_every=every, max_logit_seqs=seqs)
    return net, opt, Probe(net, dead_window=10, device=torch.device("cpu"), optimizer=opt, precursor=cfg)


def test_the_probe_samples_every_kth_step_in_its_one_copy() -> None:
    net, opt, probe = _probe(every=3, seqs=2)
    attn = [net.blocks[0], net.blocks[2]]
    got = []
    for step in range(7):
        for _ in range(2):  # two micro-batches fold into one running max
            net(torch.randn(4, 6, 32)).backward()
        pr = probe.collect(torch.tensor(0.0), 2)
        opt.step()
        opt.zero_grad()
        got.append(pr.precursors)
        sampled = step % 3 == 0
        for a in attn:
            assert len(a.seen) == (2 if sampled else 0), step  # observe() ran only on sampled steps
        if sampled:
            want = [
                max(_reference(q[:2], k[:2], torch.ones(6, 6, dtype=torch.bool).tril()) for q, k in a.seen)
                for a in attn
            ]
            np.testing.assert_allclose(pr.precursors["max_logit_L"][[0, 2]], want, rtol=1e-5)
            assert math.isnan(pr.precursors["max_logit_L"][1])  # no attention in layer 1
            assert pr.precursors["max_logit"] == pytest.approx(max(want), rel=1e-5)
        else:
            assert np.isnan(pr.precursors["max_logit_L"]).all() and math.isnan(pr.precursors["max_logit"])
        for a in attn:
            a.seen.clear()
    probe.close()
    assert not any(a.logit_watch.armed for a in attn)


def test_nothing_is_watched_when_off() -> None:
    net, _, probe = _probe(every=0)
    assert probe.logits is None and not net.blocks[0].logit_watch.armed
    net(torch.randn(2, 6, 32)).backward()
    pr = probe.collect(torch.tensor(0.0), 1)
    assert "max_logit_L" not in pr.precursors and not net.blocks[0].seen


def test_max_logit_round_trips_through_json_and_the_run_store_rows() -> None:
    rep = StepReport(
        step=3,
        time=1.0,
        loss=2.0,
        grad_norm=1.0,
        lr=1e-3,
        tokens=8,
        layer_ids_L=np.array([0, 1, 2], np.int32),
        layer_grad_norm_L=np.ones(3),
        max_logit_L=np.array([4.0, math.nan, 7.5]),
        max_logit=7.5,
    )
    back = StepReport.from_json(rep.to_json())
    np.testing.assert_array_equal(back.max_logit_L, rep.max_logit_L)
    steps, layers = steps_columns([back]), layer_columns([back])
    assert steps["max_logit"] == [7.5]
    (again,) = reports_from_columns(steps, layers, {})
    np.testing.assert_array_equal(again.max_logit_L, rep.max_logit_L)
    assert again.max_logit == 7.5
    with pytest.raises(ValueError, match="max_logit_L has shape"):
        StepReport.from_json({**rep.to_json(), "max_logit_L": [1.0]})


def _report(step: int, logit_L: list[float]) -> StepReport:
    n = len(logit_L)
    return StepReport(
        step=step,
        time=float(step),
        loss=2.0,
        grad_norm=1.0,
        lr=1e-3,
        tokens=8,
        layer_ids_L=np.arange(n, dtype=np.int32),
        layer_grad_norm_L=np.ones(n),
        max_logit_L=np.array(logit_L),
        max_logit=max(logit_L),
    )


def test_the_detector_fires_once_per_episode_of_growth() -> None:
    det = MaxLogitDetector(PrecursorConfig().max_logit_spike)
    rng = np.random.default_rng(0)
    level = 5.0
    fired = []
    for s in range(60):
        grow = 1.4 ** max(0, s - 40)  # layer 1's logit grows 40% a sample from sample 41
        out = det.update(_report(s, [level * rng.lognormal(0, 0.05), level * grow * rng.lognormal(0, 0.05)]))
        fired += [(s, v) for v in out]
    (s, v), *rest = fired
    assert not rest, fired  # one episode, one verdict
    assert 41 <= s <= 44 and v.evidence["layers"] == [1] and v.evidence["precursor"]
    assert v.severity == "warning" and v.detector == schema.DET_MAX_LOGIT
    # unsampled steps (NaN, or no per-layer values) are ignored, not judged
    assert det.update(_report(60, [math.nan, math.nan])) == []
    state = det.state_dict()
    again = MaxLogitDetector(PrecursorConfig().max_logit_spike)
    again.load_state_dict(state)
    assert again.open and again.state_dict() == state


def test_the_detector_flags_a_saturating_logit_whatever_its_history() -> None:
    det = MaxLogitDetector(PrecursorConfig().max_logit_spike)
    assert det.update(_report(0, [3.0, 150.0]))[0].evidence["rule"] == "abs_max"  # Kimi K2's tau = 100
    quiet = MaxLogitDetector(SpikeConfig(abs_max=None, warmup=4))
    assert quiet.update(_report(0, [3.0, 150.0])) == []


def test_the_detector_is_registered_only_when_sampling() -> None:
    assert "max_logit" in DetectorSuite(GuardConfig()).detectors
    for pre in (PrecursorConfig(max_logit_every=0), PrecursorConfig(detect=False)):
        assert "max_logit" not in DetectorSuite(GuardConfig(precursor=pre)).detectors


# ---- the drill: trainer/model.py's attention, q/k weights grown on purpose -------------------
START = 40


def _train(root: Path, grow: bool) -> Path:
    from trainer.callbacks.callback import Callback
    from trainer.config import load_config
    from trainer.loop import Trainer

    class QKGrowth(Callback):
        """Scales layer 1's W_q and W_k by 1.25 before every step from START: its logits grow
        1.56x a step, the MaxLogit explosion QK-clip exists for, at drill speed."""

        name = "qk_growth"

        def pre_step(self, step: int) -> None:
            if step >= START:
                attn = self.trainer.model.blocks[1].attn
                with torch.no_grad():
                    attn.wq.weight.mul_(1.25)
                    attn.wk.weight.mul_(1.25)

    cfg = load_config(MICRO, {"train.steps": 64, "guard.precursor.max_logit_every": 2})
    cfg.guard.mode = "observe"
    run = root / ("grow" if grow else "clean")
    Trainer(cfg, run, progress=False, callbacks=[QKGrowth()] if grow else []).run()
    return run


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    return _train(root, grow=True), _train(root, grow=False)


def test_growing_qk_weights_fire_the_precursor_and_a_clean_run_stays_silent(drill: tuple[Path, Path]) -> None:
    grown, clean = drill
    ev = read_table(grown, schema.TABLE_EVENTS)
    hits = ev.filter((pl.col("kind") == schema.EV_VERDICT) & (pl.col("detector") == schema.DET_MAX_LOGIT))
    assert hits.height == 1, hits  # one episode
    step = int(hits["step"][0])
    assert START < step <= START + 10 and step % 2 == 0, step  # a sampled step, within 5 samples
    assert hits["action"].to_list() == [schema.ACT_NONE]  # a warning: recorded, never acted on
    layers = read_table(grown, schema.TABLE_LAYERS)
    logit = layers.filter(pl.col("layer") == 1).sort("step")["max_logit"].to_numpy()
    assert np.isnan(logit[1::2]).all() and np.isfinite(logit[::2]).all()  # every 2nd step sampled
    assert logit[62] > 100 * logit[START]
    steps = read_table(grown, schema.TABLE_STEPS)
    assert steps["max_logit"][step] == pytest.approx(
        np.nanmax(layers.filter(pl.col("step") == step)["max_logit"])
    )
    quiet = read_table(clean, schema.TABLE_EVENTS)
    assert quiet.filter(pl.col("detector") == schema.DET_MAX_LOGIT).height == 0


def test_the_health_page_draws_the_max_logits_of_the_drill(
    drill: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamlit.testing.v1 import AppTest

    from dashboards.data import config
    from tests.dashboards.app_helpers import charts

    grown, _ = drill
    monkeypatch.setenv(config.ENV_RUNS, str(grown.parent))
    monkeypatch.delenv(config.ENV_HISTORY, raising=False)
    at = AppTest.from_file(str(REPO / "dashboards" / "app.py"), default_timeout=60).run()
    at.switch_page("page_health.py")
    at.query_params["run"] = grown.name
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    figs = charts(at)
    pre = next(f for f in figs if str(f["layout"]["title"]["text"]).startswith("Precursors"))
    traces = {t.get("name"): t for t in pre["data"]}
    want = {"max logit (all layers)", "layer 0 max logit", "layer 1 max logit", "precursor: max logit growth"}
    assert want <= set(traces), list(traces)
    # sampled steps only (every 2nd), no NaN gaps between them; the marker at the verdict's step
    assert traces["layer 1 max logit"]["x"][:3] == [0, 2, 4]
    assert None not in traces["layer 1 max logit"]["y"]
    (step,) = traces["precursor: max logit growth"]["x"]
    assert START < step <= START + 10
    assert any("max attention logit" in c.value.lower() for c in at.caption), [c.value for c in at.caption]
