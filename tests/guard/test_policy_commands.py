"""The engine's pure side: operator commands merged into a step's Decision, the rollback
fallback without a snapshot, and the detector registry (plain reports, no torch)."""

from __future__ import annotations

import math

import pytest

from guard.core import schema
from guard.core.commands import CommandInbox, OperatorCommand, merge_command
from guard.core.config import GuardConfig
from guard.core.detectors.registry import REGISTRY, STAGE_OBSERVE, register
from guard.core.engine import Engine
from guard.core.policy import Decision
from guard.core.report import StepReport


def report(step: int, grad: float = 1.0) -> StepReport:
    return StepReport(step=step, time=float(step), loss=3.0, grad_norm=grad, lr=1e-3, tokens=100)


def test_the_stronger_action_wins_and_every_command_is_an_operator_event() -> None:
    d = Decision(step=7)
    merge_command(d, OperatorCommand(1, schema.ACT_SKIP, "look"), can_roll_back=True, skip_batches=4)
    assert d.action == schema.ACT_SKIP
    assert [(e.kind, e.action, e.detail["reason"]) for e in d.events] == [
        (schema.EV_OPERATOR, "skip", "look")
    ]
    d = Decision(step=7, action=schema.ACT_HALT)  # the guard's own halt beats an operator skip
    merge_command(d, OperatorCommand(2, schema.ACT_SKIP), can_roll_back=True, skip_batches=4)
    assert d.action == schema.ACT_HALT and d.events[-1].detail["guard_action"] == schema.ACT_HALT


def test_an_operator_rollback_needs_a_snapshot() -> None:
    d = Decision(step=9)
    merge_command(d, OperatorCommand(1, schema.ACT_ROLLBACK), can_roll_back=True, skip_batches=4)
    assert (d.action, d.rollback_before, d.skip_batches) == (schema.ACT_ROLLBACK, 9, 4)
    assert [e.kind for e in d.events] == [schema.EV_ACTION, schema.EV_OPERATOR]
    d = Decision(step=9)
    merge_command(d, OperatorCommand(1, schema.ACT_ROLLBACK), can_roll_back=False, skip_batches=4)
    assert d.action == schema.ACT_SKIP and "fallback" in d.events[-1].detail


def test_the_inbox_hands_out_each_command_once_one_per_step() -> None:
    inbox = CommandInbox()
    inbox.offer([{"id": 1, "action": "skip"}, {"id": 2, "action": "halt", "reason": "r"}])
    assert inbox.next() == OperatorCommand(1, "skip") and inbox.next() == OperatorCommand(2, "halt", "r")
    assert inbox.next() is None
    inbox.applied_id = 2
    inbox.offer([{"id": 2, "action": "skip"}, {"id": 3, "action": "skip"}])  # 2 was applied already
    assert inbox.next() == OperatorCommand(3, "skip")
    assert CommandInbox().state_dict() == {"applied_id": 0}


def test_engine_merges_commands_and_remembers_the_last_one_applied() -> None:
    engine = Engine(GuardConfig())
    d = engine.decide(
        report(0), command=OperatorCommand(5, schema.ACT_ROLLBACK), snapshot_before=lambda s: None
    )
    assert d.action == schema.ACT_SKIP  # nothing to roll back to
    assert engine.state_dict()["commands"] == {"applied_id": 5}
    d = engine.decide(report(1), command=OperatorCommand(6, schema.ACT_ROLLBACK), snapshot_before=lambda s: 0)
    assert d.action == schema.ACT_ROLLBACK and d.rollback_before == 1
    fresh = Engine(GuardConfig())
    fresh.load_state_dict(engine.state_dict())
    assert fresh.commands.applied_id == 6


def test_engine_falls_back_to_skip_when_no_snapshot_precedes_the_incident() -> None:
    from guard.core.config import PolicyConfig

    cfg = GuardConfig(policy=PolicyConfig(rollback_after_skips=1))
    spike = math.inf  # non-finite: a step verdict from the first step

    engine = Engine(cfg)
    d = engine.decide(report(3, grad=spike), snapshot_before=lambda s: None)
    assert d.action == schema.ACT_SKIP
    assert any("fallback" in e.detail for e in d.events if e.action == schema.ACT_ROLLBACK)
    replayed = Engine(cfg)  # replay: no snapshot lookup, the policy's own answer
    assert replayed.decide(report(3, grad=spike)).action == schema.ACT_ROLLBACK


def test_engine_verdicts_include_the_lr_bound() -> None:
    engine = Engine(GuardConfig(), max_lr=1e-3)
    assert engine.verdicts(report(0), lr=1e-3) == []
    assert [v.detector for v in engine.verdicts(report(1), lr=5e-3)] == [schema.DET_LR]


def test_a_detector_key_registered_twice_fails_at_registration() -> None:
    assert list(REGISTRY)[:4] == ["nonfinite", "grad_spike", "loss_spike", "layer_grad_spike"]
    with pytest.raises(ValueError, match="already registered"):
        register("collapse", STAGE_OBSERVE)(lambda cfg: None)
    with pytest.raises(ValueError, match="stage"):
        register("new", "sometimes")
