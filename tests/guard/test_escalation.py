"""The escalation ladder per fault kind (guard/core/policy.py, issue #39): a rollback once for a
transient fault, no second rollback for a fault that recurs (a page instead), a halt only for
what threatens the weights, and a collapse that is corrected, never rolled back or halted."""

from __future__ import annotations

from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.events import Verdict
from guard.core.policy import Policy


def spike(ratio: float = 3.0, detector: str = schema.DET_GRAD_SPIKE) -> Verdict:
    return Verdict(detector=detector, fired=True, value=ratio, threshold=1.5, evidence={"median": 1.0})


def nan() -> Verdict:
    return Verdict(detector=schema.DET_NONFINITE, fired=True, value=float("nan"), severity="critical")


def collapse(layer: int = 1) -> Verdict:
    return Verdict(detector=schema.DET_MAXVIO, fired=True, value=3.0, threshold=2.0, layer=layer)


def drive(policy: Policy, faults: dict[int, list[Verdict]], steps: int, healthy=None) -> dict[int, object]:  # type: ignore[no-untyped-def]
    return {s: policy.decide(s, faults.get(s, []), healthy=healthy) for s in range(steps)}


def kinds(ds: dict, detector: str) -> list[int]:  # type: ignore[type-arg]
    return [
        s for s, d in ds.items() for e in d.events if e.kind == schema.EV_VERDICT and e.detector == detector
    ]


def test_two_unrelated_transients_do_not_add_up_to_a_rollback() -> None:
    # issue #39: a x50 batch at 160 and the grad-norm jump of a routing change at 200, 201 made
    # three skips within 50 steps and a rollback at 201; 40 clean steps apart they are two incidents
    # (the default clips each of them: a clip counts towards a rollback like a skip)
    p = Policy(GuardConfig())
    ds = drive(p, {160: [spike(50)], 200: [spike()], 201: [spike()]}, 260)
    assert [s for s, d in ds.items() if d.action != schema.ACT_APPLY] == [160, 200, 201]
    assert {ds[s].action for s in (160, 200, 201)} == {schema.ACT_CLIP}
    # three in one incident still roll back
    ds = drive(Policy(GuardConfig()), {40: [spike()], 43: [spike()], 46: [spike()]}, 60)
    assert ds[46].action == schema.ACT_ROLLBACK and ds[46].rollback_before == 40


def test_a_spike_that_recurs_after_a_rollback_pages_and_is_not_rolled_back_again() -> None:
    p = Policy(GuardConfig())
    faults = {s: [spike()] for s in (40, 41, 42, 100, 101, 102, 103, 104, 105, 200, 201, 202)}
    ds = drive(p, faults, 300)
    assert ds[42].action == schema.ACT_ROLLBACK
    assert [s for s, d in ds.items() if d.action == schema.ACT_ROLLBACK] == [42]
    assert not any(d.halt for d in ds.values())
    # each recurrence's third clip pages once; every flagged step is still clipped (skipped with
    # clip_spikes off: the same ladder)
    assert kinds(ds, schema.DET_FAULT_RECURRED) == [102, 105, 202]
    assert all(ds[s].action == schema.ACT_CLIP for s in faults if s != 42)
    ev = next(e for e in ds[102].events if e.detector == schema.DET_FAULT_RECURRED)
    assert ev.detail["severity"] == "critical" and ev.detail["rollbacks"] == [42]
    assert ev.action == schema.ACT_CLIP  # what its step did
    # past rollback_window the fault is a new one: a rollback again
    late = drive(Policy(GuardConfig()), {s: [spike()] for s in (40, 41, 42, 600, 601, 602)}, 610)
    assert [s for s, d in late.items() if d.action == schema.ACT_ROLLBACK] == [42, 602]


def test_only_what_threatens_the_weights_halts() -> None:
    # a non-finite fault that recurs after the rollback halts
    ds = drive(Policy(GuardConfig()), {s: [nan()] for s in (40, 41, 42, 80, 81, 82)}, 100)
    assert ds[42].action == schema.ACT_ROLLBACK and ds[82].halt
    assert [e.kind for e in ds[82].events if e.kind == schema.EV_HALT] == [schema.EV_HALT]
    # so does divergence: a loss 10x its level, back after a rollback
    big = [spike(12.0, schema.DET_LOSS_SPIKE)]
    ds = drive(Policy(GuardConfig()), dict.fromkeys((40, 41, 42, 80, 81, 82), big), 100)
    assert ds[82].halt
    # halt_after_rollbacks = 2: one more rollback first
    cfg = GuardConfig()
    cfg.policy.halt_after_rollbacks = 2
    ds = drive(Policy(cfg), {s: [nan()] for s in (40, 41, 42, 80, 81, 82, 120, 121, 122)}, 130)
    assert [s for s, d in ds.items() if d.action == schema.ACT_ROLLBACK] == [42, 82] and ds[122].halt


def test_a_collapse_that_does_not_recover_is_corrected_on_and_paged_never_rolled_back() -> None:
    cfg = GuardConfig()
    p = Policy(cfg, correction="aux_loss")
    n = 400
    ds = drive(p, {s: [collapse()] for s in range(250, n)}, n, healthy=lambda layer: False)
    assert ds[250].action == schema.ACT_BIAS_CORRECT and ds[250].aux_boost == {1: cfg.policy.aux_boost}
    assert not any(d.halt or d.action == schema.ACT_ROLLBACK for d in ds.values())
    # the correction stays on every step; one page at the first failed check
    assert all(ds[s].aux_boost == {1: cfg.policy.aux_boost} for s in range(250, n))
    assert kinds(ds, schema.DET_COLLAPSE_NOT_RECOVERED) == [250 + cfg.policy.bias_boost_steps]
    # it recovers later: the correction ends at the next check and a new collapse starts afresh
    p = Policy(cfg, correction="aux_loss")
    ends = {}
    for s in range(250, 500):
        d = p.decide(s, [collapse()] if s < 330 or s >= 450 else [], healthy=lambda layer, s=s: s >= 330)
        ends[s] = d
    assert [s for s, d in ends.items() if any(e.kind == schema.EV_RECOVERED for e in d.events)] == [350]
    assert ends[450].action == schema.ACT_BIAS_CORRECT and not ends[400].aux_boost


def test_an_open_correction_holds_no_snapshot_back_and_survives_a_resume() -> None:
    p = Policy(GuardConfig(), correction="aux_loss")
    drive(p, {s: [collapse()] for s in range(250, 320)}, 320, healthy=lambda layer: False)
    assert p.corrections and p.incident_anchor() is None  # a correction holds no snapshot back
    state = p.state_dict()
    q = Policy(GuardConfig(), correction="aux_loss")
    q.load_state_dict(state)
    assert q.corrections[1].paged and q.state_dict() == state


def test_replay_prints_the_ladder_at_the_runs_settings(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from guard.cli import main as cli_main
    from tests.guard.test_replay import recorded_run

    run = recorded_run(tmp_path / "r")
    override = tmp_path / "g.toml"
    override.write_text("[guard.policy]\nhalt_after_rollbacks = 2\ndiverge_ratio = 20.0\n")
    assert cli_main(["replay", str(run), "--ladder", "--guard", str(override)]) == 0
    out = capsys.readouterr().out
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if ln.startswith("  ") and ":" in ln}
    assert set(lines) == {"non-finite", "spike", "collapse"}
    assert "after 2 rollback(s) within 500 steps -> halt" in lines["non-finite"]
    assert "no second rollback" in lines["spike"] and ">= 20.0x its level" in lines["spike"]
    assert "never a rollback, never a halt" in lines["collapse"]
    assert "grad_norm_spike" in out  # the replay itself still follows


def test_clip_spikes_applies_a_finite_grad_norm_spike_scaled_to_its_threshold() -> None:
    """PolicyConfig.clip_spikes (on by default): the policy marks a step whose only verdicts are
    finite grad-norm spikes a clip to the tightest threshold (the applier then leaves it to the
    run's own grad clip when that clip bounds it, or skips it: the next test); a non-finite value or a
    loss spike is still skipped; clips count towards a rollback like skips; clip_spikes=False
    skips them (the same ladder)."""
    from guard.core.config import PolicyConfig

    cfg = GuardConfig()
    layer = Verdict(detector=schema.DET_LAYER_GRAD_SPIKE, fired=True, value=20.0, threshold=4.0, layer=2)
    ds = drive(
        Policy(cfg),
        {
            10: [spike(50)],
            30: [spike(6), layer],
            50: [nan()],
            70: [spike(50), spike(3, schema.DET_LOSS_SPIKE)],
        },
        90,
    )
    assert ds[10].action == schema.ACT_CLIP and ds[10].grad_scale == 1.5 / 50 and ds[10].applies_update
    assert ds[30].action == schema.ACT_CLIP and ds[30].grad_scale == 4.0 / 20
    assert [e.action for e in ds[10].events if e.kind == schema.EV_VERDICT] == [schema.ACT_CLIP]
    assert ds[50].action == ds[70].action == schema.ACT_SKIP and ds[50].grad_scale == 1.0
    ds = drive(Policy(cfg), {40: [spike()], 43: [spike()], 46: [spike()]}, 60)
    assert [ds[s].action for s in (40, 43, 46)] == [schema.ACT_CLIP, schema.ACT_CLIP, schema.ACT_ROLLBACK]
    skipping = GuardConfig(policy=PolicyConfig(clip_spikes=False))
    assert Policy(skipping).decide(10, [spike(50)]).action == schema.ACT_SKIP
    ds = drive(Policy(skipping), {40: [spike()], 43: [spike()], 46: [spike()]}, 60)
    assert [ds[s].action for s in (40, 43, 46)] == [schema.ACT_SKIP, schema.ACT_SKIP, schema.ACT_ROLLBACK]


def test_a_spike_is_left_to_the_runs_own_clip_only_when_that_clip_bounds_it() -> None:
    import torch

    from guard.core.events import Event
    from guard.core.policy import Decision
    from guard.runtime.apply import DecisionApplier
    from guard.runtime.guard import Guard

    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=1.0)
    applier = DecisionApplier(opt, Guard(GuardConfig(), torch.nn.Linear(1, 1), opt), grad_clip=5.0)
    verdict = spike(20.0)
    for scale, moved, action, said in (
        (0.1, 0.0, schema.ACT_SKIP, schema.ACT_SKIP),
        (0.5, 5.0, schema.ACT_APPLY, schema.ACT_NONE),
    ):
        # threshold 20 x 0.1 = 2 < grad_clip 5: the run's clip would leave the step at 5, over the
        # detector's line: skipped, nothing moves. Threshold 20 x 0.5 = 10 >= 5: the run's own clip
        # bounds it, so the step is the unguarded one (moved by 5), an apply, its verdict action none
        w.grad = torch.full((4,), 10.0)  # norm 20
        before = w.detach().clone()
        d = Decision(step=0, action=schema.ACT_CLIP, grad_scale=scale)
        d.events.append(Event.from_verdict(0, verdict, schema.ACT_CLIP))
        out = applier.apply(d, grad_norm=20.0)
        assert abs(float((before - w.detach()).norm()) - moved) < 1e-4
        assert d.action == action and out.updated == (action == schema.ACT_APPLY) and d.grad_scale == 1.0
        assert d.events[0].action == said
        assert (
            d.events[0].detail["beyond_grad_clip" if action == schema.ACT_SKIP else "within_grad_clip"] == 5.0
        )
