"""Non-finite values: a NaN or Inf in the loss or a gradient norm means the update must not land."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from guard.core import schema
from guard.core.detectors.robust import is_finite
from guard.core.events import Verdict
from guard.core.report import StepReport


class NonFiniteDetector:
    """NaN/Inf in the loss, the total grad norm or any layer's grad norm: the update must not land."""

    name = schema.DET_NONFINITE

    def update(self, report: StepReport) -> Verdict:
        """Fires (critical) when any of the step's loss/gradient numbers is not finite."""
        g = np.asarray(report.layer_grad_norm_L, dtype=np.float64)
        # The usual case in one test: a sum of finite numbers is finite (or overflows, and the
        # full check below then finds nothing), a NaN or Inf anywhere makes it non-finite.
        if is_finite(report.loss) and is_finite(report.grad_norm) and math.isfinite(float(g.sum())):
            return Verdict.ok(self.name)
        signals = [s for s in ("loss", "grad_norm") if not is_finite(getattr(report, s))]
        bad = ~np.isfinite(g)
        ids = report.layer_ids_L if len(report.layer_ids_L) == g.size else np.arange(g.size)
        layers = [int(i) for i in np.asarray(ids)[bad]]
        if not signals and not layers:
            return Verdict.ok(self.name)
        if signals:
            value = float(getattr(report, signals[0]))
        else:
            value = float(g[bad][0])
        return Verdict(
            detector=self.name,
            fired=True,
            value=value,
            layer=layers[0] if len(layers) == 1 and not signals else None,
            severity="critical",
            evidence={"signals": signals, "layers": layers},
        )

    def state_dict(self) -> dict[str, Any]:
        return {}  # stateless: a NaN is a NaN whatever came before

    def load_state_dict(self, d: dict[str, Any]) -> None:
        pass
