"""Precursor signals: the probe's sampled update ratio, per-group grad norms, Adam's second-moment
ratio, their run-store columns, and the precursor detector that records without acting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from guard.core import schema
from guard.core.config import GuardConfig, PrecursorConfig, SpikeConfig
from guard.core.detectors.precursor import UpdateRatioDetector
from guard.core.engine import Engine
from guard.core.report import StepReport
from guard.core.rows import group_columns, layer_columns, reports_from_columns, steps_columns
from guard.runtime.precursor import UpdateSampler, next_prime
from guard.runtime.probe import Probe


class Blocks(nn.Module):
    """Three blocks of different widths (one with a tiny parameter sampled whole), and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(96, 160), nn.LayerNorm(160), nn.Linear(160, 96)) for _ in range(3)]
        )
        self.head = nn.Linear(96, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x).squeeze(-1)


def _setup(cfg: PrecursorConfig | None = None) -> tuple[Blocks, torch.optim.Optimizer, Probe]:
    torch.manual_seed(0)
    model = Blocks()
    # two groups whose updates differ by 100x in LR: what a Muon / AdamW split looks like
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    opt = torch.optim.AdamW([{"params": mats, "lr": 1e-2}, {"params": rest, "lr": 1e-4}])
    probe = Probe(model, dead_window=10, device=torch.device("cpu"), optimizer=opt, precursor=cfg)
    return model, opt, probe


def _backward(model: Blocks) -> torch.Tensor:
    x = torch.randn(32, 96)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def _exact_ratio(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    d = sum(float((a.detach() - b).pow(2).sum()) for a, b in zip(after, before, strict=True))
    w = sum(float(b.pow(2).sum()) for b in before)
    return math.sqrt(d / w)


def test_sampled_update_ratio_matches_the_exact_one_within_a_few_percent() -> None:
    model, opt, probe = _setup()
    sampler = probe.precursors.updates  # type: ignore[union-attr]
    n = sum(p.numel() for p in model.parameters())
    assert sampler.n_sampled < n / 20  # a sample, not a copy of the weights
    for _ in range(3):
        loss = _backward(model)
        probe.collect(loss, 1)
        before = [p.detach().clone() for p in model.parameters()]
        per_block = [[p.detach().clone() for p in b.parameters()] for b in model.blocks]
        opt.step()
        opt.zero_grad()
        after_blocks = [list(b.parameters()) for b in model.blocks]
        exact = _exact_ratio(before, list(model.parameters()))
        exact_L = [_exact_ratio(b, a) for b, a in zip(per_block, after_blocks, strict=True)]
        pr = probe.collect(_backward(model), 1)
        opt.zero_grad()
        got = pr.precursors
        assert got["update_ratio"] == pytest.approx(exact, rel=0.05)
        assert got["update_ratio_L"] == pytest.approx(exact_L, rel=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_and_the_gpu_way_of_summing_the_sample_agree_with_the_exact_sums(dtype: torch.dtype) -> None:
    """The sampler sums on the host when the weights are on the CPU (numpy, double-buffered) and
    on the device elsewhere; both run here on the CPU, on the same updates, against the sums of
    the sampled positions computed directly. One parameter is non-contiguous (left out of the
    sample: zero sums), one is small (sampled whole); bfloat16 weights are gathered by torch."""
    torch.manual_seed(0)
    params = [
        nn.Parameter(torch.randn(200, 64, dtype=dtype)),
        nn.Parameter(torch.randn(64, 200).t()),
        nn.Parameter(torch.randn(5)),
        nn.Parameter(torch.randn(300, 70)),
    ]
    opt = torch.optim.AdamW(params, lr=1e-2)
    cfg = PrecursorConfig()
    host = UpdateSampler(params, opt, cfg, host_sums=True)
    device = UpdateSampler(params, opt, cfg, host_sums=False)
    assert host.n_P == device.n_P and host.n_P[1] == 0 and host.n_P[2] == 5
    stride = next_prime(cfg.update_sample_every)
    for _ in range(3):
        sum(p.float().pow(3).sum() for p in params).backward()  # type: ignore[union-attr]
        host.armed = device.armed = True
        old = [p.detach().float().reshape(-1).clone() for p in params]
        opt.step()
        opt.zero_grad()
        got_host, got_device = host.take(), device.take()
        assert got_host is not None and got_device is not None
        exact = []
        for row in ("dW", "W"):
            for p, w_old, n in zip(params, old, host.n_P, strict=True):
                idx = slice(None) if n == p.numel() else slice(None, None, stride)
                x = (p.detach().float().reshape(-1) - w_old if row == "dW" else w_old)[idx][:n]
                exact.append(float(x.double().pow(2).sum()) * p.numel() / max(n, 1))
        torch.testing.assert_close(
            got_host.double(), torch.tensor(exact, dtype=torch.float64), rtol=1e-5, atol=0
        )
        torch.testing.assert_close(got_host, got_device, rtol=1e-5, atol=0)
        assert got_host[1] == got_host[5] == 0  # the parameter left out of the sample


@pytest.mark.parametrize("write", ["rollback", "load_state_dict", "in_place"])
def test_the_update_after_an_outside_write_to_the_weights_is_measured_from_the_written_weights(
    write: str,
) -> None:
    """The sampler reuses the last update's sample as the next W_old; a write between updates (a
    snapshot restore, a checkpoint load, a user's in-place change) must not count as an update."""
    from guard.runtime.snapshot import SnapshotRing

    model, opt, probe = _setup()
    ring = SnapshotRing(model, opt, 2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    ring.take(0)
    for _ in range(3):  # steady steps: the reused sample is exact
        probe.collect(_backward(model), 1)
        opt.step()
        opt.zero_grad()
    if write == "rollback":
        ring.restore(0)
    elif write == "load_state_dict":
        model.load_state_dict(saved)
    else:
        with torch.no_grad():
            model.blocks[0][0].weight.mul_(3.0)
    probe.collect(_backward(model), 1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    exact = _exact_ratio(before, list(model.parameters()))
    got = probe.collect(_backward(model), 1).precursors["update_ratio"]
    assert got == pytest.approx(exact, rel=0.05)


def test_group_grad_norms_sum_the_per_parameter_norms_by_optimizer_group() -> None:
    model, opt, probe = _setup()
    pr = probe.collect(_backward(model), 1)
    want = [
        math.sqrt(sum(float(p.grad.pow(2).sum()) for p in g["params"]))  # type: ignore[union-attr]
        for g in opt.param_groups
    ]
    assert pr.precursors["group_grad_norm_G"] == pytest.approx(want, rel=1e-5)
    assert pr.grad_norm == pytest.approx(math.sqrt(sum(w * w for w in want)), rel=1e-5)
    # no update measured yet: NaN, not zero
    assert math.isnan(pr.precursors["update_ratio"]) and np.isnan(pr.precursors["update_ratio_L"]).all()
    opt.step()
    opt.zero_grad()
    ratios = probe.collect(_backward(model), 1).precursors["group_update_ratio_G"]
    assert ratios[0] > 20 * ratios[1]  # the 100x LR split shows per group


def test_a_skipped_step_reports_no_update_and_collect_stays_one_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, opt, probe = _setup()
    probe.collect(_backward(model), 1)
    opt.zero_grad()  # the guard skipped: no optimizer.step()
    assert math.isnan(probe.collect(_backward(model), 1).precursors["update_ratio"])
    opt.step()
    opt.zero_grad()
    calls = {"cpu": 0, "item": 0, "tolist": 0}
    for name in calls:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    pr = probe.collect(_backward(model), 1)
    monkeypatch.undo()
    assert calls == {"cpu": 1, "item": 0, "tolist": 0}
    assert pr.precursors["update_ratio"] > 0


def test_adam_second_moment_ratio_is_off_by_default_and_flags_a_jump() -> None:
    model, opt, probe = _setup()
    for _ in range(3):
        pr = probe.collect(_backward(model), 1)
        opt.step()
        opt.zero_grad()
    assert math.isnan(pr.precursors["adam_v_ratio"])

    model, opt, probe = _setup(PrecursorConfig(adam_v_ratio=True, adam_v_window=8))
    seen = []
    for step in range(30):
        loss = _backward(model)
        if step == 28:  # a 100x gradient: v jumps by ~(1 - beta2) * 1e4 = 10x
            for p in model.parameters():
                p.grad.mul_(100)  # type: ignore[union-attr]
        seen.append(probe.collect(loss, 1).precursors["adam_v_ratio"])
        opt.step()
        opt.zero_grad()
    assert math.isnan(seen[0])  # no optimizer state yet
    assert np.isnan(seen[:9]).all()  # warming up: a full window of history first
    assert max(seen[16:29]) < 3, seen
    assert seen[29] > 5, seen


def test_next_prime() -> None:
    assert [next_prime(n) for n in (1, 2, 4, 61, 64, 90)] == [1, 2, 5, 61, 67, 97]


# ---- report fields and run-store rows --------------------------------------------------------
def _report(step: int, ratio_L: list[float], groups: list[float] | None = None) -> StepReport:
    return StepReport(
        step=step,
        time=0.0,
        loss=2.0,
        grad_norm=1.0,
        lr=1e-3,
        tokens=1,
        layer_ids_L=np.arange(len(ratio_L), dtype=np.int32),
        layer_grad_norm_L=np.ones(len(ratio_L)),
        update_ratio=float(np.mean(ratio_L)),
        update_ratio_L=np.array(ratio_L),
        group_grad_norm_G=np.array(groups or []),
        group_update_ratio_G=np.array(groups or []) / 100,
    )


def test_precursor_fields_round_trip_through_json_and_the_run_store_rows() -> None:
    reps = [_report(0, [0.01, 0.02], [1.0, 0.01]), _report(1, [0.011, 0.019], [2.0, 0.02])]
    back = StepReport.from_json(reps[1].to_json())
    assert back.update_ratio_L.tolist() == [0.011, 0.019] and back.group_grad_norm_G.tolist() == [2.0, 0.02]
    layers, groups = layer_columns(reps), group_columns(reps)
    assert layers["update_ratio"].tolist() == [0.01, 0.02, 0.011, 0.019]
    assert groups["group"].tolist() == [0, 1, 0, 1] and groups["grad_norm"].tolist() == [1.0, 0.01, 2.0, 0.02]
    rebuilt = list(reports_from_columns(steps_columns(reps), layers, {}, groups))
    for a, b in zip(reps, rebuilt, strict=True):
        assert b.update_ratio == a.update_ratio
        assert b.update_ratio_L.tolist() == a.update_ratio_L.tolist()
        assert b.group_grad_norm_G.tolist() == a.group_grad_norm_G.tolist()
    # not measured: NaN rows in the layers table, nothing in the groups table
    plain = _report(2, [0.0, 0.0])
    plain.update_ratio_L = np.zeros(0)
    assert np.isnan(layer_columns([plain])["update_ratio"]).all()
    assert group_columns([plain])["step"].size == 0


# ---- the detector and the policy --------------------------------------------------------------
def _ratios(n: int, spike_at: int, factor: float) -> list[list[float]]:
    rng = np.random.default_rng(0)
    out = []
    for s in range(n):
        base = 0.01 * (1 + 0.03 * rng.standard_normal(2))
        out.append((base * (factor if s == spike_at else 1.0)).tolist())
    return out


def test_update_ratio_detector_flags_a_2x_jump_once_per_step_and_not_the_noise() -> None:
    det = UpdateRatioDetector(PrecursorConfig().update_spike)
    fired = {s: det.update(_report(s, r)) for s, r in enumerate(_ratios(80, 60, 2.5))}
    assert [s for s, v in fired.items() if v] == [60]
    (v,) = fired[60]
    assert v.detector == schema.DET_UPDATE_RATIO and v.severity == "warning" and v.layer is None
    assert v.evidence["layers"] == [0, 1] and v.evidence["precursor"]
    # NaN (no update applied, e.g. after a skip) is neither judged nor learned
    assert det.update(_report(81, [math.nan, math.nan])) == []


@pytest.mark.parametrize("act", [False, True])
def test_a_precursor_records_an_event_and_acts_only_when_configured(act: bool) -> None:
    cfg = GuardConfig(precursor=PrecursorConfig(act=act, update_spike=SpikeConfig(warmup=16, rel_min=2.0)))
    engine = Engine(cfg)
    actions, events = {}, []
    for s, r in enumerate(_ratios(80, 60, 3.0)):
        d = engine.decide(_report(s, r))
        actions[s] = d.action
        events += [e for e in d.events if e.detector == schema.DET_UPDATE_RATIO]
    assert [e.step for e in events] == [60]
    assert events[0].kind == schema.EV_VERDICT
    if act:
        assert actions[60] == schema.ACT_SKIP and events[0].action == schema.ACT_SKIP
    else:
        assert set(actions.values()) == {schema.ACT_APPLY} and events[0].action == schema.ACT_NONE


def test_close_removes_the_optimizer_hooks() -> None:
    model, opt, probe = _setup()
    probe.collect(_backward(model), 1)
    probe.close()
    opt.step()
    assert probe.precursors.updates.take() is None  # type: ignore[union-attr]
