"""The suite the engine runs: every detector the guard config enables, built from the registry."""

from __future__ import annotations

from typing import Any

from guard.core.config import GuardConfig
from guard.core.detectors.calibrated import refresh_baselines
from guard.core.detectors.registry import REGISTRY, STAGE_STEP, Registered
from guard.core.events import Verdict
from guard.core.report import StepReport


class DetectorSuite:
    """Every enabled detector, fed one StepReport per step.

    Contract with the policy: a step flagged by any step detector (schema.STEP_DETECTORS)
    adds nothing to any spike baseline: a bad batch that raises both loss and grad norm must
    not teach either window, even when only one of them fired. So step verdicts are computed
    with `peek` first and the values are accepted only when none fired.
    """

    def __init__(self, cfg: GuardConfig, registry: dict[str, Registered] | None = None) -> None:
        self.cfg = cfg
        built = {key: (r.stage, r.build(cfg)) for key, r in (registry or REGISTRY).items()}
        self.detectors: dict[str, Any] = {key: det for key, (_, det) in built.items() if det is not None}
        self._step = [det for _, (stage, det) in built.items() if det is not None and stage == STAGE_STEP]
        self._settling = [det for det in self._step if hasattr(det, "settle")]
        self._budgeted = [det for det in self._step if hasattr(det, "baselines")]
        self._observers = [
            det for _, (stage, det) in built.items() if det is not None and stage != STAGE_STEP
        ]

    def peek_step(self, report: StepReport) -> list[Verdict]:
        """Fired step verdicts (non-finite, spikes) for `report`, changing no baseline."""
        # Every budget rule's stale baseline (loss, total, all-layers, each layer: residual windows
        # of one length once warm) in one stacked median/MAD instead of two partitions a rule;
        # the same numbers each rule would compute itself (refresh_baselines).
        if self._budgeted:
            refresh_baselines([b for det in self._budgeted for b in det.baselines()])
        return [v for det in self._step for v in det.peek(report)]

    def update(self, report: StepReport) -> list[Verdict]:
        """All fired verdicts for this step; only a clean step feeds the spike baselines."""
        out = self.peek_step(report)
        accepted = not out and report.finite
        if accepted:
            for det in self._step:
                det.accept(report)
        for det in self._settling:  # detectors that hear how every step ended
            det.settle(report, accepted)
        # Routing and timing describe the step whatever its gradients were: always observed.
        for det in self._observers:
            out.extend(det.update(report))
        return out

    def healthy(self, layer: int) -> bool:
        """For the policy: is `layer`'s routing fine now (True when no detector watches routing)."""
        return all(det.healthy(layer) for det in self.detectors.values() if hasattr(det, "healthy"))

    def reset_layer(self, layer: int) -> None:
        for det in self.detectors.values():
            if hasattr(det, "reset_layer"):
                det.reset_layer(layer)

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, **{k: det.state_dict() for k, det in self.detectors.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what was saved; a detector missing from `d` (newly enabled) starts fresh."""
        for k, det in self.detectors.items():
            if k in d:
                det.load_state_dict(d[k])
