"""The per-series spike rules the detector benches score, each `step(x) -> flagged`, fed one value
per training step: moeguard's (Ours: NonFiniteDetector plus the configured spike rule) and the
published ones as the peers ship them (OLMo-core, Lightning, ZClip, Megatron), in the form the
grid search of detector_heldout.py can run fast.

Writes docs/BENCHMARKS.md: no section of its own; the rules of Detection's detector sections.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from guard.core.config import SpikeConfig
from guard.core.detectors.calibrated import CalibratedSpikeDetector
from guard.core.detectors.spike import SpikeDetector

NAN = float("nan")


class Ours:
    """moeguard: NonFiniteDetector + the spike rule the config asks for: the budget rule
    (CalibratedSpikeDetector) when it sets a false-alarm budget, else the fixed-z SpikeDetector."""

    def __init__(self, cfg: SpikeConfig) -> None:
        self.det = CalibratedSpikeDetector(cfg) if cfg.budget is not None else SpikeDetector(cfg)
        self.rules: list[str | None] = []  # the rule that judged each value (why a fault passed)

    def step(self, x: float) -> bool:
        if not math.isfinite(x):
            self.rules.append("nonfinite")
            return True  # NonFiniteDetector's verdict; the spike window never sees it
        v = self.det.update(x)
        self.rules.append(v.evidence.get("rule"))
        return v.fired


class OlmoCore:
    """OLMo-core SkipStepOptimizer.get_step_factor, one series.

    `nan_safe=False` is allenai/OLMo-core as published; `nan_safe=True` is the variant found in
    the edu-llm/OLMo-core fork, which leaves non-finite values out of the mean and std.
    """

    def __init__(self, window: int = 128, sigma_factor: float = 6.0, nan_safe: bool = False) -> None:
        self.sigma_factor = sigma_factor
        self.nan_safe = nan_safe
        self.min_len = max(2 if nan_safe else 20, window // 2)
        self.hist: deque[float] = deque(maxlen=window + 1)  # the latest value plus `window` before it

    def step(self, x: float) -> bool:
        self.hist.append(x)
        if len(self.hist) < self.min_len:
            return False
        prev = np.fromiter(self.hist, dtype=np.float64, count=len(self.hist))[:-1]
        if self.nan_safe:
            prev = prev[np.isfinite(prev)]
            if prev.size < 2 or not math.isfinite(x):
                return True
        mean, std = prev.mean(), prev.std(ddof=1)
        # NaN anywhere makes the comparison False: the step is skipped
        return not bool((x - mean) <= self.sigma_factor * std)


class Lightning:
    """Lightning Fabric SpikeDetection with its defaults (mode min, window 10, warmup 1, rtol 2)."""

    def __init__(self, window: int = 10, warmup: int = 1, rtol: float = 2.0) -> None:
        self.running: deque[float] = deque(maxlen=window)
        self.warmup = warmup
        self.rtol = rtol
        self.last_val = 0.0
        self.batch_idx = 0

    def step(self, x: float) -> bool:
        idx = self.batch_idx
        self.batch_idx += 1
        spike = idx >= self.warmup and self._is_spike(x)
        if not spike:  # finite_only=True: every unflagged value updates the stats
            self.running.append(x)
            self.last_val = x
        return spike

    def _is_spike(self, x: float) -> bool:
        finite = [v for v in self.running if math.isfinite(v)]  # torchmetrics drops NaN with a warning
        running_val = sum(finite) / len(finite) if finite else NAN
        if not math.isfinite(x):
            return True
        if x - self.last_val <= 0:  # mode "min": an improvement is never a spike
            return False
        return abs(x - running_val) >= abs(self.rtol * running_val)


class ZClip:
    """ZClip (zscore mode, adaptive_scaling): flags the steps it would clip."""

    def __init__(
        self, alpha: float = 0.97, z_thresh: float = 2.5, warmup: int = 25, eps: float = 1e-6
    ) -> None:
        self.alpha, self.z_thresh, self.warmup, self.eps = alpha, z_thresh, warmup, eps
        self.buffer: list[float] = []
        self.mean = NAN
        self.var = NAN
        self.initialized = False

    def step(self, x: float) -> bool:
        if not self.initialized:
            self.buffer.append(x)
            if len(self.buffer) >= self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((v - self.mean) ** 2 for v in self.buffer) / len(self.buffer)
                self.initialized = True
            return False
        std = self.var**0.5
        z = (x - self.mean) / (std + self.eps)
        clipped = z > self.z_thresh
        if clipped:
            eta = z / self.z_thresh
            x = self.mean + self.z_thresh * std / eta
        self.mean = self.alpha * self.mean + (1 - self.alpha) * x
        self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2  # new mean, as upstream
        return bool(clipped)


class Megatron:
    """Megatron-LM RerunStateMachine.is_unexpectedly_large(threshold=10) + its NaN/Inf check."""

    def __init__(self, factor: float = 10.0, num_samples: int = 100) -> None:
        self.factor, self.num_samples = factor, num_samples
        self.count = 0
        self.max_value = 0.0

    def step(self, x: float) -> bool:
        if not math.isfinite(x):
            return True  # check_for_nan_in_loss_and_grad (fatal in Megatron)
        v = abs(x)
        if self.count < self.num_samples:
            self.count += 1
            self.max_value = max(self.max_value, v)
            return False
        return v >= self.max_value * self.factor


def run_detector(det: Ours | OlmoCore | Lightning | ZClip | Megatron, values: np.ndarray) -> np.ndarray:
    return np.fromiter((det.step(float(x)) for x in values), dtype=bool, count=len(values))
