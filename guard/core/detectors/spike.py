"""Spike detectors: upward spikes of grad norm, loss and per-layer grad norm.

Spike rule: robust statistics on the log scale. Training signals are positive and
multiplicative (a 3x grad norm is as alarming at 0.3 as at 3.0), so we work with log x; the
median and MAD of the log window are insensitive to the outliers we are looking for, and values
we flag never enter the window, so one spike cannot widen the baseline for the next `window`
steps (OLMo-core's weakness), and a NaN is never averaged in (OLMo-core's and ZClip's). The
statistics are cached and recomputed only when the window changes, so `peek()` followed by
`accept()` costs one pass.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from guard.core import schema
from guard.core.config import SpikeConfig
from guard.core.detectors.calibrated import CalibratedSpikeDetector, refresh_baselines
from guard.core.detectors.robust import MAD_TO_SIGMA, NAN, RingBuffer, is_finite, median_of, median_rows
from guard.core.events import Verdict


class SpikeDetector:
    """Upward spikes of one positive series against its own accepted past, on the log scale.

    The baseline uses ACCEPTED values only (flagged, non-finite and non-positive values never
    enter it):
      level   median of the last `level_window` accepted log values: where the series is now;
      spread  median and MAD (x 1.4826) of the residuals log x_i - level_before_i over the
              last `window` accepted values: how far a value usually lands from the level.
    Residuals rather than raw values because early in training loss and grad norm trend fast
    and the MAD of a raw 256-step window then mostly measures the trend (in the benchmark a
    2x loss spike hid inside it). A residual is the very statistic computed for the new value,
    so the z-score stays calibrated whatever the trend or the step-to-step correlation.

    Fires when x > abs_max (even during warm-up), or, once `warmup` values were accepted,
    when x > level * rel_min AND z = (log x - level - median_resid) / max(MAD, mad_floor) > z.
    """

    def __init__(self, cfg: SpikeConfig, name: str = schema.DET_GRAD_SPIKE) -> None:
        self.cfg = cfg
        self.name = name
        self.n_accepted = 0
        self._recent = RingBuffer(cfg.level_window)  # log of the latest accepted values
        self._resid = RingBuffer(cfg.window)  # their residuals against the level before them
        self._stats: tuple[float, float, float, float] | None = (
            None  # (level, resid median, MAD, max excursion)
        )

    # ---- baseline ------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Values accepted so far."""
        return self.n_accepted

    @property
    def median(self) -> float:
        """The level (median of recent accepted values) in the series' units; NaN before any."""
        return math.exp(self._baseline()[0]) if len(self._recent) else NAN

    @property
    def mad(self) -> float:
        """Scaled MAD of the log residuals (a robust sigma), before the floor."""
        return self._baseline()[2] if len(self._recent) else NAN

    def _baseline(self) -> tuple[float, float, float, float]:
        if self._stats is None:
            level = median_of(self._recent.values())
            r = self._resid.values()
            med_r = median_of(r) if r.size else 0.0
            mad = median_of(np.abs(r - med_r)) * MAD_TO_SIGMA if r.size else 0.0
            top = float(r.max() - med_r) if r.size else 0.0
            self._stats = (level, med_r, mad, top)
        return self._stats

    # ---- judging -------------------------------------------------------------------
    def peek(self, x: float) -> Verdict:
        """The verdict for x against the current baseline; changes no state (for replay and the suite)."""
        if not is_finite(x):
            return Verdict(detector=self.name, fired=False, value=float(x), evidence={"skipped": "nonfinite"})
        x = float(x)
        fired, rule, threshold, z = self.judge(x)
        evidence: dict[str, Any] = {"n": self.n_accepted}
        if len(self._recent):
            level, _, mad, top = self._baseline()
            evidence.update(median=math.exp(level), mad=mad)
            if rule == "robust_z" and self.cfg.tail_margin is not None:
                evidence["tail"] = math.exp(top)
        if z is not None:
            evidence["z"] = z
        if rule is not None:
            evidence["rule"] = rule
        return Verdict(
            detector=self.name,
            fired=fired,
            value=x,
            threshold=NAN if threshold is None else threshold,
            evidence=evidence,
        )

    def judge(self, x: float) -> tuple[bool, str | None, float | None, float | None]:
        """(fired, rule, threshold, z) for a finite x: the decision alone, without building a
        Verdict (the per-layer detector asks every layer every step and keeps only the fired)."""
        cfg = self.cfg
        if cfg.abs_max is not None and x > cfg.abs_max:
            return True, "abs_max", cfg.abs_max, None
        if x <= 0 or self.n_accepted < cfg.warmup or not len(self._recent):
            return False, None, None, None
        level, med_r, mad, top = self._baseline()
        scale = max(mad, cfg.mad_floor)
        centre = level + med_r  # the level corrected by its usual lag behind a trend
        d = math.log(x) - centre
        z = d / scale if scale > 0 else (math.inf if d > 0 else 0.0)
        median = math.exp(level)
        # A value far above the median is a spike however noisy the series: on heavy-tailed grad
        # norms (small batches) the MAD is large, and a 60x spike can sit at z ~14, level with noise.
        early = self.n_accepted < cfg.tail_warmup
        cap = cfg.rel_max
        if early and cfg.early_rel_max is not None:
            # Before the tail rule may act, the cap follows the run's own early swings: the
            # tail_margin power of the largest clean excursion so far, between the floor (a
            # steady series keeps it) and early_rel_max (a wild start cannot disarm it).
            cap = cfg.early_rel_max
            floor = cfg.early_rel_floor if cfg.early_rel_floor is not None else cfg.rel_max
            if floor is not None and cfg.tail_margin is not None:
                cap = min(cap, max(floor, math.exp(cfg.tail_margin * top)))
        if cap is not None and x > median * cap:
            return True, "rel_max", median * cap, z
        if early:
            return False, "tail_warmup", None, z
        # The one number x had to exceed, in the series' units (every condition at once).
        log_thr = max(math.log(median * cfg.rel_min), centre + cfg.z * scale)
        if cfg.tail_margin is not None:
            log_thr = max(log_thr, centre + cfg.tail_margin * top)
        threshold = math.exp(log_thr)
        return x > threshold, "robust_z", threshold, z

    def accept(self, x: float) -> None:
        """Add x to the baseline (ignored when not finite or <= 0)."""
        if not (is_finite(x) and x > 0):
            return
        lx = math.log(x)
        if len(self._recent):
            self._resid.push(lx - self._baseline()[0])
        self._recent.push(lx)
        self.n_accepted += 1
        self._stats = None

    def update(self, x: float) -> Verdict:
        """Judge x; an unflagged value joins the baseline."""
        v = self.peek(x)
        if not v.fired:
            self.accept(x)
        return v

    # ---- state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "n_accepted": self.n_accepted,
            "recent_log": self._recent.ordered(),
            "resid_log": self._resid.ordered(),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.n_accepted = int(d.get("n_accepted", 0))
        self._recent.load(list(d.get("recent_log", [])))
        self._resid.load(list(d.get("resid_log", [])))
        self._stats = None


class LayerSpikeDetector:
    """One spike detector per layer id (per-layer grad norms), created on first sight: a
    SpikeDetector, or a CalibratedSpikeDetector when the config sets a false-alarm budget."""

    def __init__(self, cfg: SpikeConfig, name: str = schema.DET_LAYER_GRAD_SPIKE) -> None:
        self.cfg = cfg
        self.name = name
        self._make: Any = CalibratedSpikeDetector if cfg.budget is not None else SpikeDetector
        self.layers: dict[int, Any] = {}
        self._layer_cfg = cfg  # budget mode: each layer's share of the budget, set on first sight
        self._empty = self._make(cfg, name)  # judges unseen layers without creating state

    def peek(self, layer_ids: Any, values: Any) -> list[Verdict]:
        """Fired verdicts (layer set) without changing any window."""
        pairs = self._pairs(layer_ids, values)
        dets = [self.layers.get(lid, self._empty) for lid, _ in pairs]
        return [
            v
            for (lid, x), det in zip(pairs, dets, strict=True)
            if (v := self._fired(det, lid, x)) is not None
        ]

    def accept(self, layer_ids: Any, values: Any) -> None:
        for lid, x in self._pairs(layer_ids, values):
            self._det(lid).accept(x)

    def update(self, layer_ids: Any, values: Any) -> list[Verdict]:
        """Judge every layer; each layer's unflagged value joins that layer's baseline."""
        pairs = self._pairs(layer_ids, values)
        dets = [self._det(lid) for lid, _ in pairs]
        out = []
        for (lid, x), det in zip(pairs, dets, strict=True):
            v = self._fired(det, lid, x)
            if v is None:
                det.accept(x)
            else:
                out.append(v)
            if self.cfg.budget is not None:
                det.settle(x, accepted=v is None)
        return out

    def settle(self, layer_ids: Any, values: Any, accepted: bool) -> None:
        """End of the step for budget-mode layers (their clock and level-shift runs); else nothing."""
        if self.cfg.budget is None:
            return
        # No refresh: an accepted step's baselines are stale and settle does not judge it; a
        # flagged step's are still the ones peek computed.
        for lid, x in self._pairs(layer_ids, values, refresh=False):
            self._det(lid).settle(x, accepted)

    def _fired(self, det: SpikeDetector, lid: int, x: float) -> Verdict | None:
        """The verdict of one layer if it fired, else None (no Verdict built for a quiet layer)."""
        if not is_finite(x) or not det.judge(x)[0]:
            return None
        v = det.peek(x)
        v.layer = lid
        return v

    def _pairs(self, layer_ids: Any, values: Any, *, refresh: bool = True) -> list[tuple[int, float]]:
        """(layer id, value) pairs; with `refresh`, the layers' stale baselines computed together."""
        ids = [int(i) for i in np.asarray(layer_ids).reshape(-1)]
        vals = [float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1)]
        if len(ids) != len(vals):
            raise ValueError(f"{len(ids)} layer ids but {len(vals)} values")
        if not self.layers:
            self._share_budget(len(ids))
        if refresh:
            seen = [self.layers[i] for i in ids if i in self.layers]
            if self.cfg.budget is None:
                self._refresh(seen)
            else:
                refresh_baselines(seen)
        return list(zip(ids, vals, strict=True))

    @staticmethod
    def _refresh(dets: list[SpikeDetector]) -> None:
        """Recompute the stale baselines of many layers at once: layers accept together, so their
        windows have equal lengths and their medians are one np.median over a stacked array
        instead of three partitions per layer."""
        groups: dict[tuple[int, int], list[SpikeDetector]] = {}
        for d in dets:
            if d._stats is None and len(d._recent):
                groups.setdefault((len(d._recent), len(d._resid)), []).append(d)
        for (_, n_resid), ds in groups.items():
            if len(ds) < 2:
                continue  # the scalar path is as cheap
            level = median_rows(np.stack([d._recent.values() for d in ds]))
            if n_resid:
                r = np.stack([d._resid.values() for d in ds])
                med_r = median_rows(r)
                mad = median_rows(np.abs(r - med_r[:, None])) * MAD_TO_SIGMA
                top = r.max(axis=1) - med_r
            else:
                med_r = mad = top = np.zeros(len(ds))
            for d, stats in zip(
                ds, zip(level.tolist(), med_r.tolist(), mad.tolist(), top.tolist(), strict=True), strict=True
            ):
                d._stats = stats

    def _share_budget(self, n_layers: int) -> None:
        """The budget is the detector's false-alarm rate per step, and a step has `n_layers` chances:
        each layer gets budget / n_layers (Bonferroni). Fixed when the first layers are seen."""
        if self.cfg.budget is not None and n_layers > 1:
            self._layer_cfg = dataclasses.replace(self.cfg, budget=self.cfg.budget / n_layers)

    def _det(self, lid: int) -> SpikeDetector:
        det = self.layers.get(lid)
        if det is None:
            det = self.layers[lid] = self._make(self._layer_cfg, self.name)
        return det

    def state_dict(self) -> dict[str, Any]:
        return {"layers": {str(k): d.state_dict() for k, d in sorted(self.layers.items())}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.layers = {}
        self._layer_cfg = self.cfg
        self._share_budget(len(d.get("layers", {})))
        for k, sd in d.get("layers", {}).items():
            self._det(int(k)).load_state_dict(sd)
