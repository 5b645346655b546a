"""Policy: turn fired verdicts into one Decision per step, with an escalation that fits the fault.

Pure logic (no torch, no I/O), so the trainer, the library Guard and `moeguard replay` share it.
A rollback is for what a bad batch or a transient fault caused: it restores weights from before
the fault and skips the data window. It cannot remove a cause that stays (a router that prefers
one expert, a learning rate too high for the model), so the guard rolls back once per
`rollback_window` and then lets a person decide; it halts only for what threatens the weights.

Escalation ladder, per fault kind (docs/escalation.md has the why and the figures):

  non-finite loss/gradient (nonfinite)
    1. skip the update (weights and optimizer state untouched)
    2. rollback_after_skips skips in one incident -> roll back to the last snapshot before it,
       skip rollback_skip_batches batches, cool the LR
    3. it recurs (the same escalation again within rollback_window, after
       halt_after_rollbacks rollbacks) -> halt: checkpoint, critical event, RunHalted page
  spike (grad norm total / per layer / all layers, loss, LR bound)
    1. a step whose only verdicts are finite grad-norm spikes is a clip (clip_spikes, on by
       default): where the run's own grad clip brings it under the tightest threshold, the step is
       the unguarded one and the batch is kept (no guard action); where it does not (no grad clip,
       or a looser one), skipped (guard/runtime/apply.py decides, knowing the grad clip). Any
       other spike (loss, LR bound, or every spike with clip_spikes off) is skipped;
    2. roll back as above (clips count like skips)
    3. it recurs after a rollback -> no second rollback: keep clipping or skipping each flagged
       step as in 1, record a `fault_recurred` verdict (critical: the FaultRecurred page) and let
       a person decide;
       halt only if the incident diverges: a loss or total grad-norm spike at least
       diverge_ratio x its level (Megatron's spiky-loss line is 10x), which threatens the weights
  routing collapse (dead experts, MaxVio, load or router entropy of one layer)
    1. correct the layer (selection-bias push; on a model without one, a bias on that router's
       logits and a per-layer balancing gradient: guard/integrations/base.py) for
       bias_boost_steps, then check it recovered
    2. not recovered -> keep correcting (the one action that can help; the push stays bounded and
       acts on that layer only), record a `collapse_not_recovered` verdict once per episode
       (critical: the CollapseNotRecovered page)
    never a rollback (a restored snapshot cannot remove a cause that is not in the data) and
    never a halt: an imbalance costs capacity, not the weights.

An incident is a run of step verdicts with fewer than incident_gap clean steps between them: two
unrelated transients (a x50 batch at 160, a routing change at 200) are two incidents, and their
skips never add up to a rollback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.events import Event, Verdict

CORRECT_BIAS, CORRECT_AUX, CORRECT_NONE = "bias", "aux_loss", "none"
CORRECTIONS = (CORRECT_BIAS, CORRECT_AUX, CORRECT_NONE)


def ladder(cfg: GuardConfig) -> list[tuple[str, list[str]]]:
    """The escalation ladder per fault kind with `cfg`'s numbers (what `moeguard replay --ladder`
    prints): the module docstring's ladder, as this configuration runs it."""
    p = cfg.policy
    if not cfg.acting:
        return [("every fault", ["observe only: verdicts are recorded, nothing is acted on"])]
    skip = "skip the update (weights and optimizer state untouched)" if p.skip else "apply (skip off)"
    rb = (
        f"{p.rollback_after_skips} skips in one incident (gaps under {p.incident_gap} steps, within "
        f"{p.skip_window}) -> roll back to the snapshot before it, skip {p.rollback_skip_batches} "
        f"batches" + (f", LR x{p.cooldown_factor} for {p.cooldown_steps} steps" if p.lr_cooldown else "")
        if p.rollback
        else "no rollback (rollback off)"
    )
    halt = (
        f"after {p.halt_after_rollbacks} rollback(s) within {p.rollback_window} steps -> halt and page (RunHalted)"
        if p.halt
        else "halt off: recorded as fault_recurred (FaultRecurred)"
    )
    again = (
        f"escalates again within {p.rollback_window} steps of a rollback -> no second rollback: "
        "keep skipping, fault_recurred (FaultRecurred page)"
    )
    correct = (
        f"correct the layer ({'bias push or balancing gradient' if p.bias_correct else 'off'}) for "
        f"{p.bias_boost_steps} steps, then check"
    )
    return [
        ("non-finite", [skip, rb, f"recurs: {halt}"]),
        (
            "spike",
            [
                (
                    "a grad-norm spike alone: kept when the run's grad_clip bounds it under the "
                    "detector's threshold (the unguarded step, no guard action), else skipped; "
                    "other spikes: " + skip
                )
                if p.clip_spikes
                else skip,
                rb,
                again,
                f"diverging (loss or grad norm >= {p.diverge_ratio}x its level): {halt}",
            ],
        ),
        (
            "collapse",
            [
                correct,
                "not recovered -> keep correcting, collapse_not_recovered once (CollapseNotRecovered page)",
                "never a rollback, never a halt",
            ],
        ),
    ]


@dataclass(kw_only=True, slots=True)
class Decision:
    step: int
    action: str = (
        schema.ACT_APPLY
    )  # apply | bias_correct (applied, a correction started) | skip | rollback | halt
    lr_scale: float = 1.0  # multiply this step's LR (cool-down after a rollback)
    # clip: the tightest threshold / value of the step's grad-norm spikes (the applier compares
    # the norm x this with the run's grad clip: bounded there -> apply, else skip); 1 otherwise
    grad_scale: float = 1.0
    bias_boost: dict[int, float] = field(default_factory=dict)  # layer -> bias-rate multiplier
    aux_boost: dict[int, float] = field(default_factory=dict)  # layer -> aux-coef multiplier
    rollback_before: int | None = None  # roll back to the newest snapshot taken before this step
    skip_batches: int = 0  # data batches to skip after a rollback
    events: list[Event] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def applies_update(self) -> bool:
        return self.action in schema.APPLYING_ACTIONS

    @property
    def halt(self) -> bool:
        return self.action == schema.ACT_HALT


@dataclass(slots=True)
class _Correction:
    layer: int
    started: int
    until: int  # the next recovery check
    detector: str
    paged: bool = False  # collapse_not_recovered recorded for this episode


# Verdicts of a step fault that threaten the weights when the fault recurs after a rollback.
_DIVERGING = (schema.DET_LOSS_SPIKE, schema.DET_GRAD_SPIKE)
# Verdicts on the gradient's size alone: a clip can bring it back under the threshold
_CLIPPABLE = (schema.DET_GRAD_SPIKE, schema.DET_LAYER_GRAD_SPIKE)


def resolve_clip(d: Decision, grad_norm: float, grad_clip: float) -> None:
    """Turn a clip decision (a step whose only verdicts are finite grad-norm spikes) into what the
    step does, knowing the run's own grad clip (0: none): where that clip brings the norm under the
    detector's threshold (`grad_scale` x the norm), the unguarded update (apply, its verdicts action
    none); where it does not, a skip. The applier calls it before the update and `moeguard replay`
    on the recorded norm, so both say the same. Anything but a clip is left as it is."""
    if d.action != schema.ACT_CLIP:
        return
    if math.isfinite(grad_norm) and grad_clip > 0 and grad_norm * d.grad_scale >= grad_clip:
        started = any(e.kind == schema.EV_ACTION and e.action == schema.ACT_BIAS_CORRECT for e in d.events)
        d.action = schema.ACT_BIAS_CORRECT if started else schema.ACT_APPLY
        said, key = schema.ACT_NONE, "within_grad_clip"
    else:
        d.action = said = schema.ACT_SKIP
        key = "beyond_grad_clip"
    d.grad_scale = 1.0
    for e in d.events:
        if e.action == schema.ACT_CLIP:
            e.action = said
            e.detail = {**(e.detail or {}), key: grad_clip}


def _clip_scale(step_v: list[Verdict]) -> float | None:
    """The factor that brings every fired grad-norm verdict of the step down to its threshold
    (the smallest threshold / value), or None when the step cannot be clipped: a verdict on
    something else (non-finite, loss, LR bound, an operator's skip) or without a finite
    threshold. A verdict's value scales with the gradient: the total or a layer's norm, or the
    all-layers rise (every layer's norm over its level, the loss discount a constant)."""
    scale = 1.0
    for v in step_v:
        if v.detector not in _CLIPPABLE:
            return None
        x, thr = v.value, v.threshold
        if not (isinstance(x, int | float) and isinstance(thr, int | float)):
            return None
        if not (math.isfinite(x) and math.isfinite(thr) and x > 0 and thr > 0):
            return None
        scale = min(scale, thr / x)
    return scale if step_v else None


class Policy:
    def __init__(self, cfg: GuardConfig, *, has_bias: bool = True, correction: str | None = None) -> None:
        """`correction`: how this model's collapses can be corrected: "bias" (a selection bias is
        pushed), "aux_loss" (a per-layer balancing loss is boosted) or "none" (nothing can be
        applied: collapse verdicts are recorded and paged, never claimed as corrected). Default
        from `has_bias`, for moeguard's own model."""
        self.cfg = cfg
        self.p = cfg.policy
        self.correction = correction or (CORRECT_BIAS if has_bias else CORRECT_AUX)
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction = {self.correction!r}: must be one of {CORRECTIONS}")
        self.has_bias = self.correction == CORRECT_BIAS
        self.skips: list[int] = []
        self.rollbacks: list[int] = []
        self.corrections: dict[int, _Correction] = {}
        self.incident_start: int | None = None  # first step verdict of the current incident
        self.last_fault_step = -(10**9)  # the latest step verdict (closes incidents after a gap)
        self.threat = False  # the open incident has a verdict that threatens the weights
        self.cooldown_from: int | None = None
        self.last_verdict_step = -(10**9)
        # Collapse verdicts are level-triggered (every step while the condition holds); record an
        # event only when a (layer, detector) condition opens, not on every step it persists.
        self.open_conditions: set[tuple[int, str]] = set()
        self.halted_at: int | None = None  # the step this policy halted the run at, if it did

    # ---- the decision --------------------------------------------------------------
    def decide(
        self, step: int, verdicts: list[Verdict], healthy: Callable[[int], bool] | None = None
    ) -> Decision:
        """One Decision for this step. `healthy(layer)` says whether a layer's routing is fine now."""
        d = Decision(step=step, verdicts=list(verdicts))
        acting = self.cfg.acting
        step_v = [
            v
            for v in verdicts
            if v.detector in schema.STEP_DETECTORS
            or (self.cfg.precursor.act and v.detector in schema.PRECURSOR_DETECTORS)
        ]
        collapse_v = [v for v in verdicts if v.detector in schema.COLLAPSE_DETECTORS]
        other_v = [v for v in verdicts if v not in step_v and v not in collapse_v]
        if step_v or collapse_v:  # informational verdicts (stalls, throughput) never change state
            self.last_verdict_step = step
        if (
            not step_v
            and self.incident_start is not None
            and step - self.last_fault_step > self.p.incident_gap
        ):
            self._close_incident()  # a clean gap: the next fault is a new incident

        if step_v and acting:
            if self.incident_start is not None and step - self.last_fault_step > self.p.incident_gap:
                self._close_incident()
            self.last_fault_step = step
            self.threat = self.threat or any(self._threatens(v) for v in step_v)
            d.action = self._on_step_verdict(step, d, step_v)
        if acting:
            self._on_collapse(step, collapse_v, d, healthy)
        d.lr_scale = self._lr_scale(step) if acting else 1.0

        observed = schema.ACT_NONE if not acting else None
        for v in step_v:
            d.events.insert(0, Event.from_verdict(step, v, observed or d.action))
        # Level-triggered conditions (collapse per layer, stalls, throughput) are recorded when they
        # open, not on every step they persist: one event per episode.
        now_open = {(-1 if v.layer is None else v.layer, v.detector) for v in collapse_v + other_v}
        new_collapse = [v for v in collapse_v if (v.layer, v.detector) not in self.open_conditions]
        other_v = [v for v in other_v if (-1, v.detector) not in self.open_conditions]
        self.open_conditions = now_open
        for v in new_collapse:
            act = observed or (
                schema.ACT_BIAS_CORRECT
                if v.layer in d.bias_boost or v.layer in d.aux_boost
                else schema.ACT_NONE
            )
            d.events.append(Event.from_verdict(step, v, act))
        for v in other_v:
            d.events.append(Event.from_verdict(step, v, schema.ACT_NONE))
        return d

    def _threatens(self, v: Verdict) -> bool:
        """A non-finite value, or a loss / total grad-norm spike of diverge_ratio x its level."""
        if v.detector == schema.DET_NONFINITE:
            return True
        level = v.evidence.get("median")
        return (
            v.detector in _DIVERGING
            and isinstance(level, int | float)
            and level > 0
            and v.value >= self.p.diverge_ratio * level
        )

    def _close_incident(self) -> None:
        self.incident_start = None
        self.skips.clear()
        self.threat = False

    def _on_step_verdict(self, step: int, d: Decision, step_v: list[Verdict]) -> str:
        p = self.p
        if self.incident_start is None:
            self.incident_start = step
        self.skips = [s for s in self.skips if s > step - p.skip_window]
        action = schema.ACT_SKIP if p.skip else schema.ACT_APPLY
        scale = _clip_scale(step_v) if p.clip_spikes else None
        if scale is not None:
            action, d.grad_scale = schema.ACT_CLIP, scale
        if p.skip or scale is not None:
            self.skips.append(step)  # a clipped spike counts towards a rollback like a skip
        if p.rollback and len(self.skips) >= p.rollback_after_skips:
            flagged = "skips or clips" if p.clip_spikes else "skips"
            reason = f"{len(self.skips)} {flagged} in one incident within {p.skip_window} steps"
            self.rollbacks = [s for s in self.rollbacks if s > step - p.rollback_window]
            if not self.rollbacks:
                return self._rollback(step, d, reason=reason)
            # The fault came back after a rollback: a second rollback would drop another data
            # window and cool the LR again without removing a cause that stays.
            if self.threat and len(self.rollbacks) < p.halt_after_rollbacks:
                return self._rollback(step, d, reason=reason)
            if self.threat and p.halt:
                return self._halt(step, d, reason=f"{reason}, after rollback(s) at {self.rollbacks}")
            self._recurred(step, d, reason, action)
        return action

    def _recurred(self, step: int, d: Decision, reason: str, action: str) -> None:
        """Record that a fault recurred after a rollback (paged: FaultRecurred); the incident's
        count starts again, so it pages again only if the fault keeps coming."""
        d.events.append(
            Event(
                step=step,
                kind=schema.EV_VERDICT,
                detector=schema.DET_FAULT_RECURRED,
                value=len(self.skips),
                threshold=self.p.rollback_after_skips,
                action=schema.ACT_NONE if action == schema.ACT_APPLY else action,  # the step's skip or clip
                detail={
                    "severity": "critical",
                    "reason": f"{reason} after rollback(s) at {self.rollbacks}: not rolled back again",
                    "rollbacks": self.rollbacks[:],
                    "incident_start": self.incident_start,
                },
            )
        )
        self.skips.clear()

    def _halt(self, step: int, d: Decision, reason: str) -> str:
        d.events.append(
            Event(
                step=step,
                kind=schema.EV_HALT,
                action=schema.ACT_HALT,
                value=len(self.rollbacks) + 1,
                threshold=self.p.halt_after_rollbacks,
                detail={"severity": "critical", "reason": reason, "rollbacks": self.rollbacks[:]},
            )
        )
        self.halted_at = step
        return schema.ACT_HALT

    def _rollback(self, step: int, d: Decision, reason: str) -> str:
        p = self.p
        self.rollbacks = [s for s in self.rollbacks if s > step - p.rollback_window]
        self.rollbacks.append(step)
        before = self.incident_start if self.incident_start is not None else step
        d.rollback_before = before
        d.skip_batches = p.rollback_skip_batches
        d.events.append(
            Event(
                step=step,
                kind=schema.EV_ACTION,
                action=schema.ACT_ROLLBACK,
                value=len(self.rollbacks),
                threshold=p.halt_after_rollbacks,
                detail={"reason": reason, "snapshot_before": before, "skip_batches": p.rollback_skip_batches},
            )
        )
        if p.lr_cooldown:
            self.cooldown_from = step
            d.events.append(
                Event(
                    step=step,
                    kind=schema.EV_ACTION,
                    action=schema.ACT_LR_COOLDOWN,
                    value=p.cooldown_factor,
                    detail={"steps": p.cooldown_steps},
                )
            )
        self._close_incident()
        return schema.ACT_ROLLBACK

    def _on_collapse(
        self, step: int, verdicts: list[Verdict], d: Decision, healthy: Callable[[int], bool] | None
    ) -> None:
        p = self.p
        # 1) corrections due a check: recovered (the correction ends), or not: the correction goes
        # on (it is the one action that can help; a rollback cannot remove a cause that stays in
        # the model) and the first failed check pages (collapse_not_recovered)
        for layer, c in list(self.corrections.items()):
            if step < c.until:
                continue
            if healthy is None or healthy(layer):
                del self.corrections[layer]
                d.events.append(
                    Event(
                        step=step,
                        kind=schema.EV_RECOVERED,
                        detector=c.detector,
                        action=schema.ACT_BIAS_CORRECT,
                        detail={"layer": layer, "corrected_for": step - c.started},
                    )
                )
                continue
            c.until = step + p.bias_boost_steps
            if not c.paged:
                c.paged = True
                d.events.append(
                    Event(
                        step=step,
                        kind=schema.EV_VERDICT,
                        detector=schema.DET_COLLAPSE_NOT_RECOVERED,
                        value=step - c.started,
                        threshold=p.bias_boost_steps,
                        action=schema.ACT_NONE,
                        detail={
                            "severity": "critical",
                            "layer": layer,
                            "collapse": c.detector,
                            "corrected_since": c.started,
                            "mode": self.correction,
                            "reason": f"layer {layer} still collapsed ({c.detector}) after "
                            f"{step - c.started} steps of correction: correcting on, not rolled back",
                        },
                    )
                )
        # 2) new collapse verdicts start a bounded correction on that layer (only where the model
        # offers a way to apply one: a claimed correction that changes nothing is worse than none)
        if not p.bias_correct or self.correction == CORRECT_NONE:
            return
        for v in verdicts:
            if v.layer is None or v.layer in self.corrections:
                if v.layer in self.corrections:
                    self._boost(d, v.layer)
                continue
            if d.action not in schema.APPLYING_ACTIONS:
                # a step whose update is not applied starts no correction: the collapse verdict
                # repeats while it lasts, and the next applied step starts it, its row saying
                # bias_correct (one action a step: guard/core/actions.py)
                continue
            self.corrections[v.layer] = _Correction(v.layer, step, step + p.bias_boost_steps, v.detector)
            self._boost(d, v.layer)
            if d.action == schema.ACT_APPLY:  # the step's row records the correction (actions.py)
                d.action = schema.ACT_BIAS_CORRECT
            d.events.append(
                Event(
                    step=step,
                    kind=schema.EV_ACTION,
                    action=schema.ACT_BIAS_CORRECT,
                    detector=v.detector,
                    value=v.value,
                    threshold=v.threshold,
                    detail={
                        "layer": v.layer,
                        "until": step + p.bias_boost_steps,
                        "mode": self.correction,
                        "boost": p.bias_boost if self.has_bias else p.aux_boost,
                    },
                )
            )
        for layer in self.corrections:
            self._boost(d, layer)

    def _boost(self, d: Decision, layer: int) -> None:
        if self.has_bias:
            d.bias_boost[layer] = self.p.bias_boost
        else:
            d.aux_boost[layer] = self.p.aux_boost

    def _lr_scale(self, step: int) -> float:
        if self.cooldown_from is None:
            return 1.0
        k = step - self.cooldown_from
        if k >= self.p.cooldown_steps:
            self.cooldown_from = None
            return 1.0
        f = self.p.cooldown_factor
        return f + (1.0 - f) * k / self.p.cooldown_steps

    def incident_anchor(self) -> int | None:
        """The earliest step a pending rollback would have to restore to before (the open
        incident's first flagged step), or None. A collapse correction never rolls back, so it
        holds no snapshot: a long one would otherwise stop the ring from taking new ones."""
        return self.incident_start

    def calm(self, step: int) -> bool:
        """No incident under way: a good moment for a snapshot."""
        return self.incident_start is None and step - self.last_fault_step > 2

    def _operator_resumed(self) -> None:
        """A human resumed a halted run: they have looked at it, so the escalation ladder starts
        again from skip. Kept: open collapse corrections and the detectors' windows. Without this
        the first marginal verdict after the resume would halt the run again at once. Decided
        from the policy's own saved state, so every rank of a multi-rank run does the same."""
        self.skips, self.rollbacks, self.threat = [], [], False
        self.incident_start, self.cooldown_from, self.halted_at = None, None, None

    # ---- state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "skips": self.skips[:],
            "rollbacks": self.rollbacks[:],
            "corrections": {
                str(k): [c.layer, c.started, c.until, c.detector, c.paged]
                for k, c in self.corrections.items()
            },
            "incident_start": self.incident_start,
            "last_fault_step": self.last_fault_step,
            "threat": self.threat,
            "cooldown_from": self.cooldown_from,
            "last_verdict_step": self.last_verdict_step,
            "open_conditions": sorted([list(c) for c in self.open_conditions]),
            "halted_at": self.halted_at,
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.skips = list(s["skips"])
        self.rollbacks = list(s["rollbacks"])
        self.corrections = {int(k): _Correction(*v) for k, v in s["corrections"].items()}
        self.incident_start = s["incident_start"]
        self.last_fault_step = s.get("last_fault_step", s["last_verdict_step"])
        self.threat = bool(s.get("threat", False))
        self.cooldown_from = s["cooldown_from"]
        self.last_verdict_step = s["last_verdict_step"]
        self.open_conditions = {(int(a), str(b)) for a, b in s.get("open_conditions", [])}
        self.halted_at = s.get("halted_at")
        if self.halted_at is not None:  # loading the state a halt left behind = resuming it
            self._operator_resumed()
