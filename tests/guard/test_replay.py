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
from tests.helpers_collector import make_report

SPIKE = 150


def recorded_run(run_dir: Path, optim: dict | None = None) -> Path:
    store = RunStore(run_dir, flush_every=25)
    store.write_meta(
        {
            "run_id": run_dir.name,
            "status": "finished",
            "config": {"guard": {}, "optim": optim or {"lr": 1e-3}},
        }
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


def test_a_grad_spike_replays_as_the_run_resolved_it_with_its_recorded_grad_clip(
    tmp_path: Path, capsys
) -> None:
    """The default keeps a finite grad-norm spike the run's own grad clip bounds under the
    detector's threshold, and skips it otherwise; replay reads the grad clip from meta.json and
    says the same as the live run (guard/core/policy.py resolve_clip), `clip` when none is recorded."""
    for name, optim, want in (
        ("bounded", {"lr": 1e-3, "grad_clip": 1.0}, schema.ACT_NONE),  # 1000 -> 1.0, under the line
        ("unclipped", {"lr": 1e-3, "grad_clip": 0.0}, schema.ACT_SKIP),
        ("unrecorded", {"lr": 1e-3}, schema.ACT_CLIP),
    ):
        run = recorded_run(tmp_path / name, optim)
        capsys.readouterr()
        assert cli_main(["replay", str(run), "--json"]) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        spike = [x for x in lines if x["step"] == SPIKE and x["detector"] == schema.DET_GRAD_SPIKE]
        assert spike and spike[0]["would"] == want, (name, spike)


def test_replay_command_prints_json_lines(tmp_path: Path, capsys) -> None:
    run = recorded_run(tmp_path / "r")
    assert cli_main(["replay", str(run), "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert any(x["step"] == SPIKE and x["detector"] == schema.DET_GRAD_SPIKE for x in lines)


def test_replay_guard_file_is_layered_over_the_recorded_settings(tmp_path: Path, capsys) -> None:
    """Issue #31, item 5: a file naming one key changes that key only; the rest stay as recorded
    (before, every other setting fell back to the defaults), and the output says what changed."""
    run = tmp_path / "r"
    store = RunStore(run, flush_every=50)
    recorded = {"grad_spike": {"rel_max": 5.0}, "collapse": {"maxvio": 1.5}, "policy": {"skip_window": 77}}
    store.write_meta(
        {"run_id": "r", "status": "finished", "config": {"guard": recorded, "optim": {"lr": 1e-3}}}
    )
    for s in range(60):
        store.add_step(make_report(s, t=1000.0 + s))
    store.close()
    override = tmp_path / "g.toml"
    override.write_text("[guard.collapse]\nwarmup = 100\n")
    from guard.replay import guard_config_of

    cfg, _ = guard_config_of(run, override)
    assert cfg.collapse.warmup == 100
    assert cfg.collapse.maxvio == 1.5 and cfg.grad_spike.rel_max == 5.0 and cfg.policy.skip_window == 77
    assert cli_main(["replay", str(run), "--guard", str(override)]) == 0
    out = capsys.readouterr().out
    assert "layered over them: guard.collapse.warmup 250 -> 100" in out.splitlines()[0]
    override.write_text("collapse.warmup = 250\n")  # no [guard] table: the whole file is the table
    assert cli_main(["replay", str(run), "--guard", str(override)]) == 0
    assert "it changes nothing" in capsys.readouterr().out
