"""Input pipeline and throughput: data-loader stalls and sustained tokens/s drops."""

from __future__ import annotations

from typing import Any

from guard.core import schema
from guard.core.config import StallConfig, ThroughputConfig
from guard.core.detectors.robust import RingBuffer, is_finite, median_of
from guard.core.events import Verdict

# Data waits a StallDetector collects (after its warm-up) before it judges any.
STALL_BASELINE = 8


class StallDetector:
    """A data wait far above the usual one: > max(min_seconds, factor x running median)."""

    name = schema.DET_STALL

    def __init__(self, cfg: StallConfig) -> None:
        self.cfg = cfg
        self.n_seen = 0
        self._win = RingBuffer(cfg.window)
        self._median: float | None = None

    def update(self, data_wait_s: float) -> Verdict:
        cfg = self.cfg
        if not is_finite(data_wait_s) or data_wait_s < 0:
            return Verdict.ok(self.name)
        x = float(data_wait_s)
        self.n_seen += 1
        if self.n_seen <= cfg.warmup:
            return Verdict.ok(self.name)  # worker start-up; also kept out of the baseline
        if len(self._win) < min(STALL_BASELINE, self._win.capacity):
            # No baseline yet: judging against min_seconds alone would flag a steadily slow
            # loader forever, since flagged waits never join the baseline.
            self._win.push(x)
            self._median = None
            return Verdict.ok(self.name)
        if self._median is None:
            self._median = median_of(self._win.values())
        median = self._median
        threshold = max(cfg.min_seconds, cfg.factor * median)
        fired = x > threshold
        if not fired:  # a stall must not teach the baseline that stalls are normal
            self._win.push(x)
            self._median = None
        return Verdict(
            detector=self.name,
            fired=fired,
            value=x,
            threshold=threshold,
            evidence={"median": median, "n": len(self._win)},
        )

    def state_dict(self) -> dict[str, Any]:
        return {"n_seen": self.n_seen, "window": self._win.ordered()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.n_seen = int(d.get("n_seen", 0))
        self._win.load(list(d.get("window", [])))
        self._median = None


class ThroughputDetector:
    """Tokens/s below drop x the recent median for `sustain` consecutive steps."""

    name = schema.DET_THROUGHPUT

    def __init__(self, cfg: ThroughputConfig) -> None:
        self.cfg = cfg
        self.low_for = 0
        self._win = RingBuffer(cfg.window)
        self._median: float | None = None

    def update(self, tokens_per_s: float) -> Verdict:
        cfg = self.cfg
        if not is_finite(tokens_per_s) or tokens_per_s <= 0:
            return Verdict.ok(self.name)  # unknown throughput neither extends nor ends a run
        x = float(tokens_per_s)
        if len(self._win) < cfg.warmup:
            self._push(x)
            return Verdict.ok(self.name)
        if self._median is None:
            self._median = median_of(self._win.values())
        threshold = cfg.drop * self._median
        median = self._median
        if x < threshold:
            self.low_for += 1  # dropped values stay out of the baseline, so it does not sink
        else:
            self.low_for = 0
            self._push(x)
        return Verdict(
            detector=self.name,
            fired=self.low_for >= cfg.sustain,
            value=x,
            threshold=threshold,
            evidence={"median": median, "for": self.low_for, "n": len(self._win)},
        )

    def _push(self, x: float) -> None:
        self._win.push(x)
        self._median = None

    def state_dict(self) -> dict[str, Any]:
        return {"low_for": self.low_for, "window": self._win.ordered()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.low_for = int(d.get("low_for", 0))
        self._win.load(list(d.get("window", [])))
        self._median = None
