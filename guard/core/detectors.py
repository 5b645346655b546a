"""Online detectors: small pure classes that turn each step's numbers into Verdicts.

The same code runs in the trainer, in the collector and in `moeguard replay`, so it does no
I/O and imports no torch. Every detector keeps its state in plain fields and round-trips it
through a JSON-able `state_dict()`, so a resumed run keeps its baselines.

Spike rule (grad norm, loss, per-layer grad norm): robust statistics on the log scale.
Training signals are positive and multiplicative (a 3x grad norm is as alarming at 0.3 as at
3.0), so we work with log x; the median and MAD of the log window are insensitive to the
outliers we are looking for, and values we flag never enter the window, so one spike cannot
widen the baseline for the next `window` steps (OLMo-core's weakness), and a NaN is never
averaged in (OLMo-core's and ZClip's).

Window statistics: fixed numpy ring buffers plus `np.partition` (introselect, O(window))
for medians and the MAD. A sorted list kept with `bisect` would make the median O(log n),
but the MAD needs every |x - median| anyway, so an update would still be O(n), and paid in
Python; partition is one C call per statistic (an update costs ~15 us at window 256, see
tests/guard/test_detectors.py::test_spike_update_is_fast). The statistics are cached and
recomputed only when the window changes, so `peek()` followed by `accept()` costs one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from guard.core import schema
from guard.core.config import CollapseConfig, GuardConfig, SpikeConfig, StallConfig, ThroughputConfig
from guard.core.events import Verdict
from guard.core.report import StepReport

# MAD x 1.4826 estimates the standard deviation of a normal distribution.
MAD_TO_SIGMA = 1.4826
# Dead-expert evidence lists at most this many expert ids (a 256-expert layer stays readable).
_MAX_IDS = 32
_NAN = float("nan")
# Data waits a StallDetector collects (after its warm-up) before it judges any.
_STALL_BASELINE = 8


# ---------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------
class RingBuffer:
    """The last `capacity` floats, in one preallocated array (no per-step allocation)."""

    __slots__ = ("_buf", "_head", "_n")

    def __init__(self, capacity: int) -> None:
        self._buf = np.empty(capacity, dtype=np.float64)
        self._head = 0  # next write position
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return self._buf.size

    def push(self, x: float) -> None:
        self._buf[self._head] = x
        self._head = (self._head + 1) % self._buf.size
        self._n = min(self._n + 1, self._buf.size)

    def values(self) -> np.ndarray:
        """The stored values in no particular order (a view; fine for order statistics)."""
        # Until the buffer wraps, writes fill 0..n-1 in order; after that it is all full.
        return self._buf[: self._n]

    def ordered(self) -> list[float]:
        """Oldest first, for state_dict."""
        if self._n < self._buf.size:
            return self._buf[: self._n].tolist()
        return np.concatenate([self._buf[self._head :], self._buf[: self._head]]).tolist()

    def clear(self) -> None:
        self._head = 0
        self._n = 0

    def load(self, values: list[float]) -> None:
        """Replace the contents (oldest first); keeps the newest `capacity` if there are more."""
        self.clear()
        for v in values[-self._buf.size :]:
            self.push(float(v))


def median_of(a: np.ndarray) -> float:
    """Median by introselect: O(n), cheaper than np.median's extra bookkeeping."""
    n = a.size
    if n == 0:
        return _NAN
    k = n // 2
    if n % 2:
        return float(np.partition(a, k)[k])
    p = np.partition(a, (k - 1, k))
    return 0.5 * float(p[k - 1] + p[k])


def _finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except TypeError:
        return False


# ---------------------------------------------------------------------------------------
# Non-finite values
# ---------------------------------------------------------------------------------------
class NonFiniteDetector:
    """NaN/Inf in the loss, the total grad norm or any layer's grad norm: the update must not land."""

    name = schema.DET_NONFINITE

    def update(self, report: StepReport) -> Verdict:
        """Fires (critical) when any of the step's loss/gradient numbers is not finite."""
        signals = [s for s in ("loss", "grad_norm") if not _finite(getattr(report, s))]
        g = np.asarray(report.layer_grad_norm_L, dtype=np.float64)
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


# ---------------------------------------------------------------------------------------
# Spikes
# ---------------------------------------------------------------------------------------
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
        return math.exp(self._baseline()[0]) if len(self._recent) else _NAN

    @property
    def mad(self) -> float:
        """Scaled MAD of the log residuals (a robust sigma), before the floor."""
        return self._baseline()[2] if len(self._recent) else _NAN

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
        if not _finite(x):
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
            threshold=_NAN if threshold is None else threshold,
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
        if not (_finite(x) and x > 0):
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
    """One SpikeDetector per layer id (per-layer grad norms), created on first sight."""

    def __init__(self, cfg: SpikeConfig, name: str = schema.DET_LAYER_GRAD_SPIKE) -> None:
        self.cfg = cfg
        self.name = name
        self.layers: dict[int, SpikeDetector] = {}
        self._empty = SpikeDetector(cfg, name)  # judges unseen layers without creating state

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
        return out

    def _fired(self, det: SpikeDetector, lid: int, x: float) -> Verdict | None:
        """The verdict of one layer if it fired, else None (no Verdict built for a quiet layer)."""
        if not _finite(x) or not det.judge(x)[0]:
            return None
        v = det.peek(x)
        v.layer = lid
        return v

    def _pairs(self, layer_ids: Any, values: Any) -> list[tuple[int, float]]:
        ids = [int(i) for i in np.asarray(layer_ids).reshape(-1)]
        vals = [float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1)]
        if len(ids) != len(vals):
            raise ValueError(f"{len(ids)} layer ids but {len(vals)} values")
        self._refresh([self.layers[i] for i in ids if i in self.layers])
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
            level = np.median(np.stack([d._recent.values() for d in ds]), axis=1)
            if n_resid:
                r = np.stack([d._resid.values() for d in ds])
                med_r = np.median(r, axis=1)
                mad = np.median(np.abs(r - med_r[:, None]), axis=1) * MAD_TO_SIGMA
                top = r.max(axis=1) - med_r
            else:
                med_r = mad = top = np.zeros(len(ds))
            for d, stats in zip(
                ds, zip(level.tolist(), med_r.tolist(), mad.tolist(), top.tolist(), strict=True), strict=True
            ):
                d._stats = stats

    def _det(self, lid: int) -> SpikeDetector:
        det = self.layers.get(lid)
        if det is None:
            det = self.layers[lid] = SpikeDetector(self.cfg, self.name)
        return det

    def state_dict(self) -> dict[str, Any]:
        return {"layers": {str(k): d.state_dict() for k, d in sorted(self.layers.items())}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.layers = {}
        for k, sd in d.get("layers", {}).items():
            self._det(int(k)).load_state_dict(sd)


# ---------------------------------------------------------------------------------------
# MoE routing collapse
# ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class _LayerRouting:
    """Per-MoE-layer counters: how long each condition has held."""

    since_token_E: np.ndarray  # steps since each expert last got a token
    maxvio_for: int = 0
    load_entropy_for: int = 0
    router_entropy_for: int = 0

    def dead(self, window: int) -> np.ndarray:
        return np.flatnonzero(self.since_token_E >= window)


class CollapseDetector:
    """Routing health per MoE layer: dead experts, sustained MaxVio, low load/router entropy.

    Verdicts are level-triggered: while a condition holds, every update returns its verdict,
    so the policy sees an uncorrected collapse every step and `healthy()` agrees with them.
    """

    def __init__(self, cfg: CollapseConfig) -> None:
        self.cfg = cfg
        self.n_updates = 0
        self.layers: dict[int, _LayerRouting] = {}

    def update(self, report: StepReport) -> list[Verdict]:
        """Fired verdicts for this step (layer set); none before `warmup` updates."""
        cfg = self.cfg
        self.n_updates += 1
        ids = [int(i) for i in report.moe_layer_ids_M]
        loads = report.load_ME
        have_loads = loads.ndim == 2 and loads.shape[0] == len(ids) and loads.shape[1] > 0
        out: list[Verdict] = []
        for i, lid in enumerate(ids):
            st = self.layers.get(lid)
            if st is None:
                n_exp = loads.shape[1] if have_loads else 0
                st = self.layers[lid] = _LayerRouting(np.zeros(n_exp, dtype=np.int64))
            if have_loads:
                row = loads[i]
                if st.since_token_E.shape != row.shape:  # expert count changed: start over
                    st.since_token_E = np.zeros(row.shape, dtype=np.int64)
                st.since_token_E = np.where(row > 0, 0, st.since_token_E + 1)
            maxvio = float(report.maxvio_M[i])
            load_h = float(report.load_entropy_M[i])
            router_h = float(report.router_entropy_M[i])
            # NaN compares False: an unknown value ends a run rather than extending it.
            st.maxvio_for = st.maxvio_for + 1 if maxvio > cfg.maxvio else 0
            st.load_entropy_for = st.load_entropy_for + 1 if load_h < cfg.load_entropy_floor else 0
            low_router = cfg.router_entropy_floor > 0 and router_h < cfg.router_entropy_floor
            st.router_entropy_for = st.router_entropy_for + 1 if low_router else 0
            if self.n_updates <= cfg.warmup:
                continue  # routing is chaotic at init; counters run, verdicts wait
            fallback_dead = None if have_loads else int(report.dead_experts_M[i])
            out.extend(self._verdicts(lid, st, maxvio, load_h, router_h, fallback_dead))
        return out

    def _verdicts(
        self,
        lid: int,
        st: _LayerRouting,
        maxvio: float,
        load_h: float,
        router_h: float,
        fallback_dead: int | None,
    ) -> list[Verdict]:
        cfg = self.cfg
        out = []
        n_exp = st.since_token_E.size
        if n_exp:
            # Without per-expert loads this step, trust the reporter's own dead count.
            dead_ids = st.dead(cfg.dead_window)
            n_dead = len(dead_ids) if fallback_dead is None else fallback_dead
            if n_dead / n_exp > cfg.max_dead_frac:
                out.append(
                    Verdict(
                        detector=schema.DET_DEAD_EXPERTS,
                        fired=True,
                        value=n_dead / n_exp,
                        threshold=cfg.max_dead_frac,
                        layer=lid,
                        evidence={
                            "dead": n_dead,
                            "experts": n_exp,
                            "window": cfg.dead_window,
                            "dead_ids": dead_ids[:_MAX_IDS].tolist(),
                        },
                    )
                )
        if st.maxvio_for >= cfg.maxvio_for:
            out.append(
                Verdict(
                    detector=schema.DET_MAXVIO,
                    fired=True,
                    value=maxvio,
                    threshold=cfg.maxvio,
                    layer=lid,
                    evidence={"for": st.maxvio_for},
                )
            )
        if st.load_entropy_for >= cfg.entropy_for:
            out.append(
                Verdict(
                    detector=schema.DET_LOAD_ENTROPY,
                    fired=True,
                    value=load_h,
                    threshold=cfg.load_entropy_floor,
                    layer=lid,
                    evidence={"for": st.load_entropy_for},
                )
            )
        if st.router_entropy_for >= cfg.entropy_for:
            out.append(
                Verdict(
                    detector=schema.DET_ROUTER_ENTROPY,
                    fired=True,
                    value=router_h,
                    threshold=cfg.router_entropy_floor,
                    layer=lid,
                    evidence={"for": st.router_entropy_for},
                )
            )
        return out

    def reset_layer(self, layer: int) -> None:
        """Restart every window of `layer` (after a correction, so old evidence does not re-fire)."""
        st = self.layers.get(int(layer))
        if st is not None:
            st.since_token_E = np.zeros_like(st.since_token_E)
            st.maxvio_for = st.load_entropy_for = st.router_entropy_for = 0

    def healthy(self, layer: int) -> bool:
        """No condition holds now on `layer`: few enough dead experts, last MaxVio and entropies in bounds.

        A layer never seen is healthy (nothing is known against it).
        """
        st = self.layers.get(int(layer))
        if st is None:
            return True
        n_exp = st.since_token_E.size
        dead_ok = n_exp == 0 or len(st.dead(self.cfg.dead_window)) / n_exp <= self.cfg.max_dead_frac
        return dead_ok and st.maxvio_for == 0 and st.load_entropy_for == 0 and st.router_entropy_for == 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_updates": self.n_updates,
            "layers": {
                str(k): {
                    "since_token_E": st.since_token_E.tolist(),
                    "maxvio_for": st.maxvio_for,
                    "load_entropy_for": st.load_entropy_for,
                    "router_entropy_for": st.router_entropy_for,
                }
                for k, st in sorted(self.layers.items())
            },
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.n_updates = int(d.get("n_updates", 0))
        self.layers = {
            int(k): _LayerRouting(
                np.asarray(s["since_token_E"], dtype=np.int64),
                int(s["maxvio_for"]),
                int(s["load_entropy_for"]),
                int(s["router_entropy_for"]),
            )
            for k, s in d.get("layers", {}).items()
        }


# ---------------------------------------------------------------------------------------
# Input pipeline and throughput
# ---------------------------------------------------------------------------------------
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
        if not _finite(data_wait_s) or data_wait_s < 0:
            return Verdict.ok(self.name)
        x = float(data_wait_s)
        self.n_seen += 1
        if self.n_seen <= cfg.warmup:
            return Verdict.ok(self.name)  # worker start-up; also kept out of the baseline
        if len(self._win) < min(_STALL_BASELINE, self._win.capacity):
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
        if not _finite(tokens_per_s) or tokens_per_s <= 0:
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


# ---------------------------------------------------------------------------------------
# The suite the trainer, the collector and replay run
# ---------------------------------------------------------------------------------------
class DetectorSuite:
    """Every detector the guard config enables, fed one StepReport per step.

    Contract with the policy: a step flagged by any step detector (schema.STEP_DETECTORS)
    adds nothing to any spike baseline: a bad batch that raises both loss and grad norm must
    not teach either window, even when only one of them fired. So step verdicts are computed
    with `peek` first and the values are accepted only when none fired.
    """

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.nonfinite = NonFiniteDetector() if cfg.nonfinite else None
        self.grad_spike = (
            SpikeDetector(cfg.grad_spike, schema.DET_GRAD_SPIKE) if cfg.grad_spike.enabled else None
        )
        self.loss_spike = (
            SpikeDetector(cfg.loss_spike, schema.DET_LOSS_SPIKE) if cfg.loss_spike.enabled else None
        )
        self.layer_grad_spike = (
            LayerSpikeDetector(cfg.layer_grad_spike, schema.DET_LAYER_GRAD_SPIKE)
            if cfg.layer_grad_spike.enabled
            else None
        )
        self.collapse = CollapseDetector(cfg.collapse) if cfg.collapse.enabled else None
        self.stall = StallDetector(cfg.stall) if cfg.stall.enabled else None
        self.throughput = ThroughputDetector(cfg.throughput) if cfg.throughput.enabled else None

    def peek_step(self, report: StepReport) -> list[Verdict]:
        """Fired step verdicts (non-finite, spikes) for `report`, changing no baseline."""
        out: list[Verdict] = []
        if self.nonfinite is not None:
            v = self.nonfinite.update(report)
            if v.fired:
                out.append(v)
        for det, x in ((self.grad_spike, report.grad_norm), (self.loss_spike, report.loss)):
            if det is not None:
                v = det.peek(x)
                if v.fired:
                    out.append(v)
        if self.layer_grad_spike is not None and len(report.layer_grad_norm_L):
            out.extend(self.layer_grad_spike.peek(report.layer_ids_L, report.layer_grad_norm_L))
        return out

    def update(self, report: StepReport) -> list[Verdict]:
        """All fired verdicts for this step; only a clean step feeds the spike baselines."""
        out = self.peek_step(report)
        if not out and report.finite:
            if self.grad_spike is not None:
                self.grad_spike.accept(report.grad_norm)
            if self.loss_spike is not None:
                self.loss_spike.accept(report.loss)
            if self.layer_grad_spike is not None and len(report.layer_grad_norm_L):
                self.layer_grad_spike.accept(report.layer_ids_L, report.layer_grad_norm_L)
        # Routing and timing describe the step whatever its gradients were: always observed.
        if self.collapse is not None:
            out.extend(self.collapse.update(report))
        for det, x in ((self.stall, report.data_wait_s), (self.throughput, report.tokens_per_s)):
            if det is not None:
                v = det.update(x)
                if v.fired:
                    out.append(v)
        return out

    def healthy(self, layer: int) -> bool:
        """For the policy: is `layer`'s routing fine now (True when collapse detection is off)."""
        return self.collapse is None or self.collapse.healthy(layer)

    def reset_layer(self, layer: int) -> None:
        if self.collapse is not None:
            self.collapse.reset_layer(layer)

    def _parts(self) -> dict[str, Any]:
        return {
            "nonfinite": self.nonfinite,
            "grad_spike": self.grad_spike,
            "loss_spike": self.loss_spike,
            "layer_grad_spike": self.layer_grad_spike,
            "collapse": self.collapse,
            "stall": self.stall,
            "throughput": self.throughput,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, **{k: det.state_dict() for k, det in self._parts().items() if det is not None}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what was saved; a detector missing from `d` (newly enabled) starts fresh."""
        for k, det in self._parts().items():
            if det is not None and k in d:
                det.load_state_dict(d[k])
