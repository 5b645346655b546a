"""How the guard's collapse corrections reach moeguard's own model (a Corrector, as in
guard/integrations/base.py, applied by guard/runtime/apply.py).

bias mode (`model.bias_mode` sign or smebu): every applied step runs each router's own
    balancing update from the step's reduced loads; a collapsing layer's update is boosted
    (rate x boost) and its bias clamped to `policy.bias_max` while the correction is open.
aux mode (`bias_mode = "off"`): a collapsing layer's balancing-loss weight is raised to
    max(aux_loss_coef x boost, 0.01) for the next forward, and put back when the correction ends.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from guard.integrations.base import MODE_AUX, MODE_BIAS


class ModelCorrector:
    def __init__(
        self,
        model: nn.Module,
        routers: list[tuple[int, Any]],
        *,
        bias: bool,
        bias_max: float,
        aux_coef: float,
    ) -> None:
        self.model = model
        self.routers = routers  # (layer id, Router) in loads_ME row order
        self.mode = MODE_BIAS if bias else MODE_AUX
        self.bias_max = bias_max
        self.aux_coef = aux_coef  # the configured weight, restored when a boost ends
        self.aux_boosted: set[int] = set()

    def correct(self, boosts: dict[int, float], loads_ME: torch.Tensor | None, applied: bool) -> None:
        if self.mode == MODE_AUX:
            self._set_aux_boost(boosts)
        if not applied or loads_ME is None:
            return
        bias_boost = boosts if self.mode == MODE_BIAS else {}
        for m, (layer, router) in enumerate(self.routers):
            boost = bias_boost.get(layer)
            router.update_bias(
                loads_ME[m], rate_scale=boost or 1.0, bias_max=self.bias_max if boost else None
            )

    def _set_aux_boost(self, aux_boost: dict[int, float]) -> None:
        for layer in set(aux_boost) | self.aux_boosted:
            coef = max(self.aux_coef * aux_boost[layer], 1e-2) if layer in aux_boost else self.aux_coef
            self.model.set_aux_loss_coef(layer, coef)
        self.aux_boosted = set(aux_boost)
