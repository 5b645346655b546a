"""The `Detector` protocol and the registry a DetectorSuite is built from.

Every detector has a native signature that suits its tests (a spike detector takes floats, the
collapse detector a StepReport); the suite sees them all through one protocol, fed the whole
StepReport. Two stages, because of one contract with the policy: a step flagged by any step
detector (schema.STEP_DETECTORS) adds nothing to any spike baseline, so the suite `peek`s every
step detector first and lets them `accept` the step only when none fired. Observers (routing,
timing) describe the step whatever its gradients were and are always updated.

    register("my_detector", STAGE_OBSERVE)(lambda cfg: MyDetector(cfg.my) if cfg.my.enabled else None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.detectors.all_layers import AllLayersSpike
from guard.core.detectors.calibrated import CalibratedSpikeDetector
from guard.core.detectors.collapse import CollapseDetector
from guard.core.detectors.nonfinite import NonFiniteDetector
from guard.core.detectors.robust import is_finite
from guard.core.detectors.spike import LayerSpikeDetector, SpikeDetector
from guard.core.detectors.timing import StallDetector, ThroughputDetector
from guard.core.events import Verdict
from guard.core.report import StepReport

STAGE_STEP, STAGE_OBSERVE = "step", "observe"


class Detector(Protocol):
    """What every detector offers the suite: state that survives a resume."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, d: dict[str, Any]) -> None: ...


class StepDetector(Detector, Protocol):
    """Judges the update itself; its baseline learns only from steps no step detector flagged."""

    def peek(self, report: StepReport) -> list[Verdict]:
        """Fired verdicts for `report`, changing no state."""
        ...

    def accept(self, report: StepReport) -> None:
        """Let the (clean) step join the baseline."""
        ...


class Observer(Detector, Protocol):
    """Sees every step (routing, timing)."""

    def update(self, report: StepReport) -> list[Verdict]:
        """Fired verdicts for `report`; updates the state."""
        ...


@dataclass(frozen=True, slots=True)
class Registered:
    stage: str  # STAGE_STEP | STAGE_OBSERVE
    build: Callable[[GuardConfig], Any]  # the detector the config asks for, or None when it is off


# key (also the detector's state_dict key) -> how to build it; verdicts come out in this order
REGISTRY: dict[str, Registered] = {}


def register(key: str, stage: str) -> Callable[[Callable[[GuardConfig], Any]], Callable[[GuardConfig], Any]]:
    """Add a detector builder under `key`; a key registered twice fails here, not at run time."""
    if stage not in (STAGE_STEP, STAGE_OBSERVE):
        raise ValueError(f"stage = {stage!r}: must be {STAGE_STEP!r} or {STAGE_OBSERVE!r}")

    def add(build: Callable[[GuardConfig], Any]) -> Callable[[GuardConfig], Any]:
        if key in REGISTRY:
            raise ValueError(f"detector {key!r} is already registered")
        REGISTRY[key] = Registered(stage, build)
        return build

    return add


# ---- the built-in detectors, fed from the report's fields --------------------------------
class _Fired:
    """Shared by the adapters: a native detector's state, and its verdict as a list of fired ones."""

    __slots__ = ("det",)

    def __init__(self, det: Any) -> None:
        self.det = det

    def state_dict(self) -> dict[str, Any]:
        return self.det.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.det.load_state_dict(d)


class NonFiniteStep(_Fired):
    def peek(self, report: StepReport) -> list[Verdict]:
        v = self.det.update(report)  # stateless
        return [v] if v.fired else []

    def accept(self, report: StepReport) -> None:
        pass


class SeriesSpike(_Fired):
    """A SpikeDetector on one float field of the report (grad_norm, loss)."""

    __slots__ = ("field",)

    def __init__(self, det: SpikeDetector, field: str) -> None:
        super().__init__(det)
        self.field = field

    def peek(self, report: StepReport) -> list[Verdict]:
        x = getattr(report, self.field)
        if is_finite(x) and not self.det.judge(float(x))[0]:
            return []  # the usual step: no Verdict to build (peek fires only where judge does)
        v = self.det.peek(x)
        return [v] if v.fired else []

    def accept(self, report: StepReport) -> None:
        self.det.accept(getattr(report, self.field))


class CalibratedSeries(SeriesSpike):
    """A CalibratedSpikeDetector (SpikeConfig.budget set) on one float field of the report: it also
    hears how each step ended (its clock, its run of flagged values for the level-shift rule)."""

    def settle(self, report: StepReport, accepted: bool) -> None:
        self.det.settle(getattr(report, self.field), accepted)

    def baselines(self) -> list[CalibratedSpikeDetector]:
        """The budget rules inside, for the suite's batched baseline refresh."""
        return [self.det]


class GradSpikes(CalibratedSeries):
    """The total grad norm's budget rule plus the all-layers rule (guard/core/detectors/all_layers.py):
    a step is a grad-norm spike when either fires (the total's verdict first, one verdict a step)."""

    __slots__ = ("all_layers",)

    def __init__(self, det: CalibratedSpikeDetector, all_layers: AllLayersSpike) -> None:
        super().__init__(det, "grad_norm")
        self.all_layers = all_layers

    def peek(self, report: StepReport) -> list[Verdict]:
        total = super().peek(report)
        if total or len(report.layer_grad_norm_L) < 2:
            return total
        v = self.all_layers.peek(report.step, report.layer_ids_L, report.layer_grad_norm_L, report.loss)
        return [v] if v is not None else []

    def accept(self, report: StepReport) -> None:
        super().accept(report)
        if len(report.layer_grad_norm_L) >= 2:
            self.all_layers.accept(report.step, report.layer_ids_L, report.layer_grad_norm_L, report.loss)

    def settle(self, report: StepReport, accepted: bool) -> None:
        super().settle(report, accepted)
        if len(report.layer_grad_norm_L) >= 2:
            self.all_layers.settle(
                report.step, report.layer_ids_L, report.layer_grad_norm_L, accepted, report.loss
            )

    def baselines(self) -> list[CalibratedSpikeDetector]:
        return [self.det, self.all_layers.det]

    def state_dict(self) -> dict[str, Any]:
        return {**self.det.state_dict(), "all_layers": self.all_layers.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.det.load_state_dict(d)  # a state saved before the all-layers rule: it starts fresh
        self.all_layers.load_state_dict(d.get("all_layers", {}))


def _series(c: Any, name: str, field: str) -> SeriesSpike:
    if c.budget is not None:
        return CalibratedSeries(CalibratedSpikeDetector(c, name), field)
    return SeriesSpike(SpikeDetector(c, name), field)


class LayerSpikes(_Fired):
    """A LayerSpikeDetector on the per-layer grad norms (nothing to judge when none are reported)."""

    def peek(self, report: StepReport) -> list[Verdict]:
        if not len(report.layer_grad_norm_L):
            return []
        return self.det.peek(report.layer_ids_L, report.layer_grad_norm_L)

    def accept(self, report: StepReport) -> None:
        if len(report.layer_grad_norm_L):
            self.det.accept(report.layer_ids_L, report.layer_grad_norm_L)

    def settle(self, report: StepReport, accepted: bool) -> None:
        if len(report.layer_grad_norm_L):
            self.det.settle(report.layer_ids_L, report.layer_grad_norm_L, accepted)

    def baselines(self) -> list[CalibratedSpikeDetector]:
        return list(self.det.layers.values()) if self.det.cfg.budget is not None else []


class SeriesObserver(_Fired):
    """A stall or throughput detector on one float field of the report."""

    __slots__ = ("field",)

    def __init__(self, det: Any, field: str) -> None:
        super().__init__(det)
        self.field = field

    def update(self, report: StepReport) -> list[Verdict]:
        v = self.det.update(getattr(report, self.field))
        return [v] if v.fired else []


@register("nonfinite", STAGE_STEP)
def _nonfinite(cfg: GuardConfig) -> NonFiniteStep | None:
    return NonFiniteStep(NonFiniteDetector()) if cfg.nonfinite else None


@register("grad_spike", STAGE_STEP)
def _grad_spike(cfg: GuardConfig) -> SeriesSpike | None:
    c = cfg.grad_spike
    if not c.enabled:
        return None
    if c.budget is not None and c.all_layers:
        half = dataclasses.replace(c, budget=c.budget / 2)  # two rules, one budget per step
        return GradSpikes(CalibratedSpikeDetector(half, schema.DET_GRAD_SPIKE), AllLayersSpike(half))
    return _series(c, schema.DET_GRAD_SPIKE, "grad_norm")


@register("loss_spike", STAGE_STEP)
def _loss_spike(cfg: GuardConfig) -> SeriesSpike | None:
    c = cfg.loss_spike
    return _series(c, schema.DET_LOSS_SPIKE, "loss") if c.enabled else None


@register("layer_grad_spike", STAGE_STEP)
def _layer_grad_spike(cfg: GuardConfig) -> LayerSpikes | None:
    c = cfg.layer_grad_spike
    return LayerSpikes(LayerSpikeDetector(c, schema.DET_LAYER_GRAD_SPIKE)) if c.enabled else None


@register("collapse", STAGE_OBSERVE)
def _collapse(cfg: GuardConfig) -> CollapseDetector | None:
    return CollapseDetector(cfg.collapse) if cfg.collapse.enabled else None


@register("stall", STAGE_OBSERVE)
def _stall(cfg: GuardConfig) -> SeriesObserver | None:
    return SeriesObserver(StallDetector(cfg.stall), "data_wait_s") if cfg.stall.enabled else None


@register("throughput", STAGE_OBSERVE)
def _throughput(cfg: GuardConfig) -> SeriesObserver | None:
    c = cfg.throughput
    return SeriesObserver(ThroughputDetector(c), "tokens_per_s") if c.enabled else None
