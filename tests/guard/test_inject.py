"""Drills in any loop: the one spec parser (guard/core/inject.py) and GuardedStep's injector
(guard/runtime/inject.py), on a real plain PyTorch loop; the torchtitan and transformers
entry points are tests/integration/test_framework_drills.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from guard.api import GuardedStep
from guard.core import schema
from guard.core.inject import ENV_INJECT, Injection, from_env, parse_injection, parse_injections
from guard.core.tomlconf import ConfigError
from guard.store.reader import read_table

REPO = Path(__file__).resolve().parents[2]


def test_a_spec_echoes_as_given_and_parses_as_before() -> None:
    assert str(parse_injection("nan@999")) == "nan@999"
    assert str(parse_injection("gradspike@45:50@rank1")) == "gradspike@45:50@rank1"
    assert parse_injection("nan@45/r1") == Injection("nan", 45, 0.0, 1)
    assert parse_injection("stall@3").arg == 6.0  # the kind's default ARG
    assert parse_injections("nan@3, gradspike@4:10,") == [
        Injection("nan", 3, 0.0),
        Injection("gradspike", 4, 10.0),
    ]
    assert from_env({ENV_INJECT: "crash@7/r0"}) == [Injection("crash", 7, 0.0, 0)]
    assert from_env({}) == []
    with pytest.raises(ConfigError, match=r"\$MOEGUARD_INJECT 'boom@3': unknown kind 'boom'"):
        from_env({ENV_INJECT: "boom@3"})


def test_moeguard_train_echoes_a_late_drill_as_given(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "guard", "train", "--steps", "3", "--inject", "nan@999", "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    [line] = p.stderr.strip().splitlines()
    assert "--inject nan@999: past the run's last step" in line and "nan@999:0" not in line


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def test_every_in_loop_drill_fires_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$MOEGUARD_INJECT reaches a GuardedStep that was given no inject=: each fault does what its
    kind says, at its step, and is an `inject` event of that step."""
    monkeypatch.setenv(
        ENV_INJECT, "nan@5,lrspike@15:100,badbatch@20,stall@25:0.3,gradspike@30:1000,slowrank@35:1.0"
    )
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guarded = GuardedStep(model, opt, run_dir=tmp_path / "run", max_lr=1e-3)
    seen: dict[int, torch.Tensor] = {}  # what the model's forward was given (after the drill's hook)
    model.register_forward_pre_hook(lambda m, a: seen.__setitem__(guarded.step_idx, a[0].clone()))
    ids = torch.randint(0, 64, (8, 16))
    decisions = []
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(ids).reshape(-1, 64), ids.roll(1, 1).reshape(-1))
        loss.backward()
        decisions.append(guarded.step(loss, tokens=ids.numel()))
    guarded.close()
    steps = read_table(tmp_path / "run", "steps").sort("step")
    events = read_table(tmp_path / "run", "events")
    injected = events.filter(events["kind"] == schema.EV_INJECT)
    assert injected["step"].to_list() == [5, 15, 20, 25, 30, 35]
    assert '"nan@5"' in injected["detail"][0]
    # nan: a non-finite gradient, the update skipped
    assert decisions[5].action == schema.ACT_SKIP and steps["grad_norm"].is_nan()[5]
    # lrspike: the LR of step 15 is 100x (the LR bound skips it), the schedule's LR put back after
    assert steps["lr"][15] == pytest.approx(0.1) and decisions[15].action == schema.ACT_SKIP
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    # badbatch: step 20's forward got other token ids, the steps around it the real ones
    assert not torch.equal(seen[20], ids) and torch.equal(seen[19], ids) and torch.equal(seen[21], ids)
    # stall: step 25 waited 0.3 s for data
    assert steps["data_wait_s"][25] >= 0.3 and steps["data_wait_s"][24] < 0.1
    # gradspike: step 30's gradients x1000
    assert steps["grad_norm"][30] > 300 * steps["grad_norm"][29]
    # slowrank: from step 35 on every step takes 1 s longer (the fastest step before it did not,
    # whatever the load on the host)
    assert steps["step_time_s"][35:].min() >= 1.0 and steps["step_time_s"][26:35].min() < 1.0


def test_a_drill_the_model_cannot_take_is_refused_at_construction(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="collapse"):
        GuardedStep(model, opt, run_dir=tmp_path / "a", inject=["collapse@3:0"])
    with pytest.raises(ConfigError, match="no nn.Embedding"):
        GuardedStep(model, opt, run_dir=tmp_path / "b", inject="badbatch@3")
    with pytest.raises(ConfigError, match=r"inject= 'nan@x': STEP 'x' is not an integer"):
        GuardedStep(model, opt, run_dir=tmp_path / "c", inject="nan@x")


@pytest.mark.parametrize("restart", ["0", "1"])
def test_crash_kills_the_process_at_its_step_in_the_first_attempt_only(tmp_path: Path, restart: str) -> None:
    loop = textwrap.dedent(
        """
        import sys, torch
        from guard.api import GuardedStep
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        guarded = GuardedStep(model, opt, inject="crash@3")
        x = torch.randn(8, 4)
        for step in range(6):
            loss = model(x).pow(2).mean()
            loss.backward()
            guarded.step(loss, tokens=8)
            print("stepped", step, flush=True)
        guarded.close()
        """
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "TORCHELASTIC_RESTART_COUNT": restart}
    p = subprocess.run([sys.executable, "-c", loop], cwd=tmp_path, env=env, capture_output=True, text=True)
    stepped = [ln for ln in p.stdout.splitlines() if ln.startswith("stepped")]
    if restart == "0":  # SIGKILL at step 3's forward: steps 0-2 done, nothing after
        assert p.returncode == -9 and len(stepped) == 3, (p.returncode, p.stdout, p.stderr[-2000:])
    else:  # a torchrun restart does not replay the node loss
        assert p.returncode == 0 and len(stepped) == 6, p.stderr[-2000:]
