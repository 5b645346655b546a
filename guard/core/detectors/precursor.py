"""Precursor detectors: signals that move BEFORE a loss spike, recorded as warnings.

A precursor verdict does not judge this step's update (the policy records it as an event with
no action, schema.PRECURSOR_DETECTORS; `guard.precursor.act = true` makes it skip like a step
verdict). It runs as an observer, so it never holds back the step detectors' baselines.

    update ratio  ||W_t - W_{t-1}|| / ||W_{t-1}|| per layer (guard/runtime/precursor.py measures
                  it): the relative size of the update that produced this step's weights. Marin saw
                  2x update-norm spikes ahead of their loss and grad-norm spikes; an LR ramp or an
                  optimizer state gone bad shows here one step after the update lands, while the
                  loss may take several more steps to blow up. Log-scale robust spike rule per
                  layer (spike.py), ONE verdict per step naming every layer that fired.
    max logit     the max attention logit per layer, max over heads and causal pairs of q.k *
                  scale (guard/runtime/attention_logits.py; Kimi K2's QK-clip watches it),
                  measured on every k-th step only. The same per-layer rule (a 2x jump over the
                  layer's level at z 6 on the log scale, on logits raised to a floor of 5: the
                  relative swings of a logit near 0 are noise) plus an absolute line: above 100
                  (the tau Kimi K2 clipped at) the softmax is saturated whatever the history. ONE
                  verdict per episode: sampled steps are k apart, so the policy's own
                  one-event-per-open-condition rule would re-open on every sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from guard.core import schema
from guard.core.config import GuardConfig, SpikeConfig
from guard.core.detectors.registry import STAGE_OBSERVE, register
from guard.core.detectors.spike import LayerSpikeDetector
from guard.core.events import Verdict
from guard.core.report import StepReport


class UpdateRatioDetector:
    """Per-layer update-ratio spikes; one warning verdict per step (the layer furthest above its
    threshold, with every fired layer in the evidence), so a spike over several steps opens one
    episode in the policy, whatever the layer count."""

    def __init__(self, cfg: SpikeConfig) -> None:
        self.layers = LayerSpikeDetector(cfg, schema.DET_UPDATE_RATIO)

    def update(self, report: StepReport) -> list[Verdict]:
        ratio_L = report.update_ratio_L
        if not ratio_L.size or ratio_L.size != len(report.layer_ids_L):
            return []  # not measured (no optimizer given to the probe, or precursors off)
        fired = self.layers.update(report.layer_ids_L, ratio_L)  # NaN (no update) is skipped
        if not fired:
            return []
        return [_one_warning(schema.DET_UPDATE_RATIO, fired, update_ratio=report.update_ratio)]

    def state_dict(self) -> dict[str, Any]:
        return self.layers.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.layers.load_state_dict(d)


class MaxLogitDetector:
    """Per-layer max-attention-logit growth on the steps it was sampled; one warning verdict when
    an episode opens (the first sample with a firing layer after a quiet one), none while later
    samples keep firing, so a logit that grew and stays high is one event, not one per sample."""

    def __init__(self, cfg: SpikeConfig, floor: float = 5.0) -> None:
        self.layers = LayerSpikeDetector(cfg, schema.DET_MAX_LOGIT)
        self.floor = floor
        self.open = False  # the last sample had a firing layer

    def update(self, report: StepReport) -> list[Verdict]:
        logit_L = report.max_logit_L
        if logit_L.size != len(report.layer_ids_L) or not np.isfinite(logit_L).any():
            return []  # not sampled this step, or no watched layer
        fired = self.layers.update(report.layer_ids_L, np.maximum(logit_L, self.floor))  # NaN stays NaN
        was_open, self.open = self.open, bool(fired)
        if not fired or was_open:
            return []
        return [_one_warning(schema.DET_MAX_LOGIT, fired, max_logit=report.max_logit)]

    def state_dict(self) -> dict[str, Any]:
        return {**self.layers.state_dict(), "open": self.open}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.layers.load_state_dict(d)
        self.open = bool(d.get("open", False))


def _one_warning(detector: str, fired: list[Verdict], **signal: Any) -> Verdict:
    """The step's one precursor verdict: the layer furthest above its threshold, every fired layer
    in the evidence, and the step's whole-model value of the signal."""
    top = max(fired, key=lambda v: v.value / v.threshold)
    evidence = {**top.evidence, "layer": top.layer, "layers": [v.layer for v in fired], **signal}
    return Verdict(
        detector=detector,
        fired=True,
        value=top.value,
        threshold=top.threshold,
        severity="warning",
        evidence={**evidence, "precursor": True},
    )


@register("update_ratio", STAGE_OBSERVE)
def _update_ratio(cfg: GuardConfig) -> UpdateRatioDetector | None:
    c = cfg.precursor
    return UpdateRatioDetector(c.update_spike) if c.enabled and c.detect and c.update_spike.enabled else None


@register("max_logit", STAGE_OBSERVE)
def _max_logit(cfg: GuardConfig) -> MaxLogitDetector | None:
    c = cfg.precursor
    on = c.enabled and c.detect and c.max_logit_every > 0 and c.max_logit_spike.enabled
    return MaxLogitDetector(c.max_logit_spike, c.max_logit_floor) if on else None
