"""The rerun check (trainer/rerun.py, `[guard.rerun]`): a flagged step is recomputed once from the
same state; a clean recompute is a suspected hardware fault (applied from the recompute), a
reproduced one is the data's or the optimisation's (the guard's decision stands)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch

from guard.core import schema
from guard.core.config import RerunConfig
from guard.core.tomlconf import ConfigError
from guard.store.reader import read_table
from tests.conftest import MICRO
from trainer.inject import parse_injection
from trainer.rerun import Pass, classify, rel_diff

FAULT_STEP = 45  # after the spike detectors' warm-up (32 accepted values)


def _trainer(tmp_path: Path, injections: list[str], *, rerun: bool = True) -> Any:
    from trainer.config import load_config
    from trainer.loop import Trainer

    cfg = load_config(MICRO, {"train.steps": 200, "train.checkpoint_every": 0, "guard.rerun.enabled": rerun})
    return Trainer(cfg, tmp_path, injections=[parse_injection(s) for s in injections], progress=False)


def _run_to(t: Any, step: int) -> None:
    """Train up to (not including) `step`, as Trainer.run does between steps."""
    while t.step < step:
        t.train_step()
        t.step += 1
        t.guard.after_step(t.step, {"opt_step": t.opt_step})


def _count_forward_passes(t: Any) -> list[int]:
    calls: list[int] = []
    inner = t.module.forward_backward

    def counted(batches: list[torch.Tensor]) -> torch.Tensor:
        calls.append(t.step)
        return inner(batches)

    t.module.forward_backward = counted
    return calls


def _weights(t: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def _adam(t: Any) -> list[torch.Tensor]:
    return [v.clone() for st in t.opt.state.values() for v in st.values() if torch.is_tensor(v)]


def _rerun_events(t: Any) -> list[Any]:
    return [e for e in t.last_decision.events if e.kind == schema.EV_RERUN] if t.last_decision else []


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_one_off_corruption_is_a_suspected_hardware_fault_and_the_clean_recompute_is_applied(
    tmp_path: Path,
) -> None:
    clean = _trainer(tmp_path / "clean", [])
    _run_to(clean, FAULT_STEP + 1)
    t = _trainer(tmp_path / "flip", [f"flip@{FAULT_STEP}"])
    _run_to(t, FAULT_STEP)
    passes = _count_forward_passes(t)
    rep = t.train_step()

    assert passes == [FAULT_STEP, FAULT_STEP]  # the flagged step ran twice
    assert rep.action == schema.ACT_APPLY and math.isfinite(rep.grad_norm)
    (ev,) = _rerun_events(t)
    assert ev.detector == schema.RERUN_TRANSIENT and ev.action == schema.ACT_APPLY
    assert ev.detail["rank"] == 0 and ev.detail["ranks"] == [0]
    assert schema.DET_NONFINITE in ev.detail["flagged_by"]
    assert math.isnan(ev.detail["first"]["grad_norm"]) and math.isfinite(ev.detail["recompute"]["grad_norm"])
    assert "clean recompute" in ev.detail["applied"]
    # the update applied is the clean run's, bit for bit (CPU, deterministic), and so is the guard
    assert _same(_weights(t), _weights(clean))
    assert all(torch.equal(x, y) for x, y in zip(_adam(t), _adam(clean), strict=True))
    assert t.opt_step == clean.opt_step
    assert t.guard.policy.skips == [] and t.guard.policy.incident_start is None
    t.step += 1
    t.guard.after_step(t.step, {"opt_step": t.opt_step})
    _run_to(t, FAULT_STEP + 2)  # a flip happens once: the next step runs once
    assert passes == [FAULT_STEP, FAULT_STEP, FAULT_STEP + 1] and t.last_decision.action == schema.ACT_APPLY
    for x in (t, clean):
        x.store.close()


@pytest.mark.parametrize("fault", ["badbatch", "nan"])
def test_a_deterministic_fault_reproduces_and_the_step_is_skipped(tmp_path: Path, fault: str) -> None:
    t = _trainer(tmp_path, [f"{fault}@{FAULT_STEP}"])
    _run_to(t, FAULT_STEP)
    before, adam = _weights(t), _adam(t)
    passes = _count_forward_passes(t)
    rep = t.train_step()

    assert passes == [FAULT_STEP, FAULT_STEP]
    assert rep.action == schema.ACT_SKIP
    (ev,) = _rerun_events(t)
    assert ev.detector == schema.RERUN_REPRODUCIBLE and ev.action == schema.ACT_SKIP
    assert ev.detail["classification"] == schema.RERUN_REPRODUCIBLE
    assert "stands" in ev.detail["applied"] and ev.value <= ev.threshold
    assert _same(before, _weights(t))  # nothing applied, NaN included
    assert all(torch.equal(x, y) for x, y in zip(adam, _adam(t), strict=True))
    t.store.close()


def test_rerun_off_recomputes_nothing(tmp_path: Path) -> None:
    t = _trainer(tmp_path, [f"flip@{FAULT_STEP}"], rerun=False)
    passes = _count_forward_passes(t)
    _run_to(t, FAULT_STEP + 1)
    assert passes == list(range(FAULT_STEP + 1))  # one forward/backward per step
    assert t.last_decision.action == schema.ACT_SKIP  # the guard alone: the flip is skipped
    assert not _rerun_events(t)
    t.store.close()


def test_the_event_reaches_the_run_store_with_its_rank(tmp_path: Path) -> None:
    from tests.conftest import train_micro

    train_micro(
        tmp_path / "r",
        overrides={"train.steps": FAULT_STEP + 2, "guard.rerun.enabled": True},
        injections=[f"flip@{FAULT_STEP}:1000"],
    )
    ev = read_table(tmp_path / "r", "events").filter(pl.col("kind") == schema.EV_RERUN)
    assert ev["step"].to_list() == [FAULT_STEP]
    assert ev["detector"].to_list() == [schema.RERUN_TRANSIENT]
    detail = json.loads(ev["detail"][0])
    assert detail["rank"] == 0 and detail["first"]["grad_norm"] > 100 * detail["recompute"]["grad_norm"]
    steps = read_table(tmp_path / "r", "steps").filter(pl.col("step") == FAULT_STEP)
    assert steps["action"].to_list() == [schema.ACT_APPLY]


def test_classification() -> None:
    assert rel_diff(float("nan"), 1.0) == math.inf and rel_diff(1.0, float("inf")) == math.inf
    assert rel_diff(float("nan"), float("nan")) == 0.0 and rel_diff(2.0, 2.0) == 0.0
    assert rel_diff(1.0, 1.1) == pytest.approx(0.1 / 1.1)
    same, diff = classify(Pass(3.0, float("nan")), Pass(3.0, float("nan")), 1e-2)
    assert same == schema.RERUN_REPRODUCIBLE and diff == 0.0
    assert classify(Pass(3.0, 1000.0), Pass(3.0, 1.0), 1e-2)[0] == schema.RERUN_TRANSIENT
    assert classify(Pass(3.0, 1.0), Pass(3.0001, 1.0), 1e-2)[0] == schema.RERUN_REPRODUCIBLE


def test_config_and_injection_spec() -> None:
    assert not RerunConfig().enabled  # off by default
    with pytest.raises(ConfigError, match="on"):
        RerunConfig(on=("maxvio",))
    with pytest.raises(ConfigError, match="rel_tol"):
        RerunConfig(rel_tol=-1)
    assert math.isnan(parse_injection("flip@5").arg)
    assert parse_injection("flip@5:1000/r1").arg == 1000 and parse_injection("flip@5/r1").rank == 1


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize(("parallel", "rank"), [("ddp", 1), ("fsdp", -1)])
def test_two_ranks_rerun_together_and_name_the_rank(tmp_path: Path, parallel: str, rank: int) -> None:
    """A flip on rank 1 only: both ranks recompute (or the collectives would hang), the event names
    rank 1 under ddp (its own gradient norm moved) and -1 under fsdp (gradients are reduced inside
    backward); a bad batch on every rank reproduces."""
    from tests.trainer.test_distributed import run, torchrun_cmd

    args = ["--set", "guard.rerun.enabled=true", "--set", f"train.parallel={parallel}", "--steps", "48"]
    injections = ["--inject", f"flip@{FAULT_STEP}:1000/r1", "--inject", f"badbatch@{FAULT_STEP + 1}"]
    p = run(torchrun_cmd(tmp_path, *args, *injections))
    assert p.returncode == 0, p.stderr[-3000:]
    ev = read_table(tmp_path, "events").filter(pl.col("kind") == schema.EV_RERUN).sort("step")
    assert ev["detector"].to_list() == [schema.RERUN_TRANSIENT, schema.RERUN_REPRODUCIBLE]
    assert ev["action"].to_list() == [schema.ACT_APPLY, schema.ACT_SKIP]
    assert json.loads(ev["detail"][0])["rank"] == rank
