"""The library API on a plain PyTorch loop and a MoE that is not moeguard's (Mixtral-style gate)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from guard.api import GuardedStep
from guard.core import schema
from guard.runtime.probes import RouterProbe
from guard.store.reader import read_table


class ThirdPartyMoE(nn.Module):
    """A Mixtral-like sparse block: gate = nn.Linear -> logits; top-2 of 4 experts."""

    def __init__(self, d: int = 16, e: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(d, e, bias=False)
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d)) for _ in range(e)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.gate(x).softmax(-1)
        top_w, top_i = w.topk(2, dim=-1)
        out = torch.zeros_like(x)
        for k in range(2):
            for e, expert in enumerate(self.experts):
                mask = top_i[..., k] == e
                if mask.any():
                    out[mask] += top_w[..., k][mask, None] * expert(x[mask])
        return x + out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ThirdPartyMoE(), ThirdPartyMoE()])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).squeeze(-1)


def test_plain_loop_is_guarded_in_a_few_lines(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    routers = [(i, RouterProbe(layer.gate, n_experts=4, top_k=2)) for i, layer in enumerate(model.layers)]
    guarded = GuardedStep(model, opt, run_dir=tmp_path / "run", routers=routers, max_lr=1e-3)
    fed: list[list[torch.Tensor]] = []  # the gradients each optimizer.step() was given
    opt.register_step_pre_hook(
        lambda o, args, kwargs: fed.append([p.grad.clone() for p in model.parameters()])
    )
    x, y = torch.randn(64, 16), torch.randn(64)
    decisions = []
    for step in range(60):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        if step == 30:  # a NaN in one gradient: skipped whatever the policy
            next(iter(model.parameters())).grad[0].fill_(float("nan"))
            exp_avg = [s["exp_avg"].clone() for s in opt.state.values()]
        if step == 50:  # a finite gradient spike, as a bad batch would cause
            for p in model.parameters():
                p.grad.mul_(1000.0)
            n_fed = len(fed)
        decisions.append(guarded.step(loss, tokens=64))
        if step in (30, 50):  # the skip: no weight and no optimizer state touched, bit for bit
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        if step == 30:
            assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(exp_avg, opt.state.values(), strict=True))
        if step == 50:  # optimizer.step() never ran
            assert len(fed) == n_fed
    guarded.close()
    assert decisions[30].action == schema.ACT_SKIP
    # The default (clip_spikes) leaves a finite grad-norm spike to the run's own grad clip when
    # that clip brings it under the detector's threshold; this loop has none, so the spike would
    # land at the threshold, far above its level: skipped, like the NaN.
    d = decisions[50]
    assert d.action == schema.ACT_SKIP and d.grad_scale == 1.0, [(v.detector, v.value) for v in d.verdicts]
    spikes = [v for v in d.verdicts if v.detector in (schema.DET_GRAD_SPIKE, schema.DET_LAYER_GRAD_SPIKE)]
    assert spikes and len(spikes) == len(d.verdicts) and all(math.isfinite(v.value) for v in spikes)
    assert [(i, dec.action) for i, dec in enumerate(decisions) if dec.action != schema.ACT_APPLY] == [
        (30, schema.ACT_SKIP),
        (50, schema.ACT_SKIP),
    ]
    # the verdicts are recorded with the action taken, and the spike's say why
    ev = read_table(tmp_path / "run", "events").filter(pl.col("kind") == schema.EV_VERDICT)
    at50 = ev.filter(pl.col("step") == 50)
    assert set(at50["action"].to_list()) == {schema.ACT_SKIP}
    assert all(json.loads(x)["beyond_grad_clip"] == 0.0 for x in at50["detail"].to_list())
    assert set(ev.filter(pl.col("step") == 30)["action"].to_list()) == {schema.ACT_SKIP}
    steps = read_table(tmp_path / "run", "steps").sort("step")
    assert steps.height == 60
    assert (steps["action"][30], steps["action"][50]) == (schema.ACT_SKIP, schema.ACT_SKIP)
    experts = read_table(tmp_path / "run", "experts")
    # the probe saw the third-party routing: 64 tokens x top-2 per layer per step
    per = experts.group_by("step", "layer").agg(pl.col("load").sum())
    assert (per["load"] == 128).all()
    layers = read_table(tmp_path / "run", "layers")
    assert layers["router_entropy"].is_finite().all() and (layers["router_entropy"] > 0).all()


def test_router_probe_rejects_a_wrong_expert_count() -> None:
    gate = nn.Linear(8, 6)
    probe = RouterProbe(gate, n_experts=4, top_k=2)
    try:
        gate(torch.randn(3, 8))
    except ValueError as e:
        assert "n_experts = 4" in str(e)
    else:
        raise AssertionError("expected a ValueError")
    probe.remove()


def test_rollback_loses_at_most_one_snapshot_interval_and_the_lr_is_restored_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    lr = 3e-3  # not exactly representable: a divide-back cool-down would drift it
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    routers = [(i, RouterProbe(layer.gate, n_experts=4, top_k=2)) for i, layer in enumerate(model.layers)]
    from guard.core.config import GuardConfig, PolicyConfig

    cfg = GuardConfig(policy=PolicyConfig(rollback_skip_batches=2))
    guarded = GuardedStep(model, opt, run_dir=tmp_path / "run", routers=routers, max_lr=lr, config=cfg)
    x, y = torch.randn(64, 16), torch.randn(64)
    # three finite x1000 spikes in one incident: no grad clip here to bound them, so each is
    # skipped -> a rollback at 62
    spikes = {60, 61, 62}
    decisions = []
    for step in range(70):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if step in spikes:
            for p in model.parameters():
                p.grad.mul_(1000.0)
        decisions.append(guarded.step(loss, tokens=64))
        assert opt.param_groups[0]["lr"] == lr  # bit-exact after every step, cool-down or not
    guarded.close()
    assert [(i, d.action) for i, d in enumerate(decisions) if d.action != schema.ACT_APPLY] == [
        (60, schema.ACT_SKIP),
        (61, schema.ACT_SKIP),
        (62, schema.ACT_ROLLBACK),
        (63, schema.ACT_SKIP),
        (64, schema.ACT_SKIP),
    ]
    ev = read_table(tmp_path / "run", "events")
    restored = [d for d in ev["detail"].to_list() if "restored_step" in d]
    import json

    step = json.loads(restored[0])["restored_step"]
    every = guarded.cfg.policy.snapshot_every
    assert 60 - every <= step < 60  # the newest snapshot before the incident, not a calm one far back
    steps = read_table(tmp_path / "run", "steps").sort("step")
    # the applied (cooled) LR is what the run store shows; a skipped step of the data window applies none
    applied = steps.filter((pl.col("step") > 62) & (pl.col("action") == schema.ACT_APPLY))
    pol = guarded.cfg.policy
    k = applied["step"][0] - 62  # the cool-down ramps from the rollback step back to 1 over cooldown_steps
    assert applied["lr"][0] == pytest.approx(
        lr * (pol.cooldown_factor + (1 - pol.cooldown_factor) * k / pol.cooldown_steps)
    )
    window = steps.filter((pl.col("step") > 62) & (pl.col("action") == schema.ACT_SKIP))
    assert window.height == 2  # the data window, skipped (this loop does not use batches())


def test_operator_commands_from_a_command_file_are_honoured(tmp_path: Path) -> None:
    import json

    from guard.core.config import GuardConfig, PolicyConfig
    from guard.runtime.commands import CommandFile

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cmd_file = tmp_path / "commands.json"
    cfg = GuardConfig(policy=PolicyConfig(snapshot_every=5, rollback_skip_batches=0))
    guarded = GuardedStep(model, opt, run_dir=tmp_path / "run", config=cfg, commands=CommandFile(cmd_file))
    x, y = torch.randn(64, 16), torch.randn(64)
    written = []  # the operator appends to the file, as the collector's commands.json grows
    script = {3: ("skip", "bad shard"), 12: ("rollback", "loss looked off"), 20: ("halt", "done looking")}
    decisions = []
    for step in range(30):
        if step in script:
            action, reason = script[step]
            written.append({"id": len(written) + 1, "action": action, "reason": reason})
            cmd_file.write_text(json.dumps(written))
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if step == 3:
            before = {k: v.clone() for k, v in model.state_dict().items()}
        d = guarded.step(loss, tokens=64)
        decisions.append(d)
        if step == 3:  # a skip commanded by an operator changes no weight either
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        if d.halt:
            break
    guarded.close()
    assert [(i, d.action) for i, d in enumerate(decisions) if d.action != schema.ACT_APPLY] == [
        (3, schema.ACT_SKIP),
        (12, schema.ACT_ROLLBACK),
        (20, schema.ACT_HALT),
    ]
    ev = read_table(tmp_path / "run", "events")
    ops = ev.filter(pl.col("kind") == schema.EV_OPERATOR).sort("step")
    assert ops["step"].to_list() == [3, 12, 20] and ops["action"].to_list() == ["skip", "rollback", "halt"]
    assert [json.loads(d)["reason"] for d in ops["detail"]] == [
        "bad shard",
        "loss looked off",
        "done looking",
    ]
    rb = ev.filter((pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_ROLLBACK))
    assert json.loads(rb["detail"].item())["restored_step"] == 10  # the newest snapshot before step 12
    # each command applies once, also after a resume from the guard's state
    assert guarded.state_dict()["guard"]["commands"]["applied_id"] == 3
