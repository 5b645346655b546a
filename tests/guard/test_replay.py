"""`moeguard replay`: the recorded run read back through the store's reader, the detectors run
over it, and what they would have done printed next to what the run did."""

from __future__ import annotations

import json
from pathlib import Path

from guard.cli import main as cli_main
from guard.core import schema
from guard.core.config import GuardConfig
from guard.replay import replay
from guard.store.runstore import RunStore
from tests.guard.test_collector import make_report

SPIKE = 150


def recorded_run(run_dir: Path) -> Path:
    store = RunStore(run_dir, flush_every=25)
    store.write_meta(
        {"run_id": run_dir.name, "status": "finished", "config": {"guard": {}, "optim": {"lr": 1e-3}}}
    )
    for s in range(200):
        rep = make_report(s, t=1000.0 + s)
        if s == SPIKE:
            rep.grad_norm = 1000.0
        store.add_step(rep)
    store.close()
    return run_dir


def test_replay_finds_the_spike_the_run_applied(tmp_path: Path) -> None:
    run = recorded_run(tmp_path / "r")
    rows = replay(run, GuardConfig(mode="act"), max_lr=1e-3)
    spike = [r for r in rows if r.step == SPIKE]
    assert spike and spike[0].detector == schema.DET_GRAD_SPIKE and spike[0].did == schema.ACT_APPLY
    assert spike[0].would != schema.ACT_APPLY


def test_replay_command_prints_json_lines(tmp_path: Path, capsys) -> None:
    run = recorded_run(tmp_path / "r")
    assert cli_main(["replay", str(run), "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert any(x["step"] == SPIKE and x["detector"] == schema.DET_GRAD_SPIKE for x in lines)
