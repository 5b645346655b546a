"""Straggler scores per rank (nvidia-resiliency-ext style), from per-window step-time summaries.

A pure detector (no torch.distributed, no I/O): the trainer gathers each rank's window summary
(median and best step time over the last `straggler_every` steps) and calls `update` on it.

    relative_R   = fastest rank's median / this rank's median   (1 = the fastest rank)
    individual_R = this rank's best window median so far / its current median  (1 = as fast as ever)

A rank is a straggler while its relative score is below `threshold` (0.75: a third slower than
the fastest). The individual score is evidence only: when every rank slows down together the job
is slower (ThroughputDrop), not one rank. An event is produced when a rank becomes a straggler
and when it recovers, not on every window it stays slow.

What "step time" should mean in synchronous training: every rank leaves the gradient all-reduce
at the same moment, so wall-clock step times are equal on all ranks and say nothing. The
trainer feeds the time each rank spent outside collectives (its own compute plus data wait):
the fast ranks wait for the slow one inside the all-reduce, and that wait is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guard.core import schema
from guard.core.events import Event
from guard.core.tomlconf import check


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    threshold: float = 0.75

    def __post_init__(self) -> None:
        check(0 < self.threshold < 1, "telemetry.straggler_threshold", self.threshold, "must be in (0, 1)")


@dataclass(slots=True)
class StragglerResult:
    relative_R: np.ndarray  # [R] fastest median / rank median
    individual_R: np.ndarray  # [R] rank's best median / rank median
    flagged: list[int] = field(default_factory=list)  # ranks below the threshold now
    events: list[Event] = field(default_factory=list)  # became a straggler / recovered


class StragglerDetector:
    def __init__(self, cfg: StragglerConfig | None = None) -> None:
        self.cfg = cfg or StragglerConfig()
        self.best_R: np.ndarray = np.zeros(0)  # best (lowest) window median seen per rank
        self.flagged: set[int] = set()

    def update(
        self, step: int, median_R: np.ndarray, data_wait_R: np.ndarray | None = None
    ) -> StragglerResult:
        """Scores for one window ending at `step`. `median_R`: each rank's median step time
        (seconds outside collectives); `data_wait_R`: its median data wait (evidence only)."""
        med = np.asarray(median_R, dtype=np.float64)
        n = med.size
        if self.best_R.size != n:  # first window, or a resume on another world size
            self.best_R = np.full(n, np.inf)
            self.flagged = {r for r in self.flagged if r < n}
        ok = np.isfinite(med) & (med > 0)
        fastest = med[ok].min() if ok.any() else math.nan
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.where(ok, fastest / med, np.nan)
            self.best_R = np.where(ok, np.minimum(self.best_R, med), self.best_R)
            ind = np.where(ok, self.best_R / med, np.nan)
        thr = self.cfg.threshold
        now = {int(r) for r in np.flatnonzero(ok & (rel < thr))}
        events: list[Event] = []
        for r in sorted(now - self.flagged):
            detail: dict[str, Any] = {
                "rank": r,
                "relative": float(rel[r]),
                "individual": float(ind[r]),
                "median_step_s": float(med[r]),
                "fastest_median_step_s": float(fastest),
                "fastest_rank": int(np.nanargmin(np.where(ok, med, np.nan))),
            }
            if data_wait_R is not None:
                detail["median_data_wait_s"] = float(data_wait_R[r])
            events.append(
                Event(
                    step=step,
                    kind=schema.EV_STRAGGLER,
                    value=float(rel[r]),
                    threshold=thr,
                    action=schema.ACT_NONE,
                    detail=detail,
                )
            )
        for r in sorted(self.flagged - now):
            events.append(
                Event(
                    step=step,
                    kind=schema.EV_STRAGGLER,
                    value=float(rel[r]) if r < n else math.nan,
                    threshold=thr,
                    action=schema.ACT_NONE,
                    detail={"rank": r, "recovered": True},
                )
            )
        self.flagged = now
        return StragglerResult(relative_R=rel, individual_R=ind, flagged=sorted(now), events=events)

    def state_dict(self) -> dict[str, Any]:
        return {"best_R": self.best_R.tolist(), "flagged": sorted(self.flagged)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.best_R = np.asarray(d.get("best_R", []), dtype=np.float64)
        self.flagged = {int(r) for r in d.get("flagged", [])}
