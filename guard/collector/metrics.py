"""The collector's Prometheus registry: one custom collector rendering every moeguard_* metric.

Why a custom collector instead of Gauge/Counter objects: ingest keeps a reference to each run's
last rank-0 StepReport plus a few counters, O(1) per report; label sets and values are built
at scrape time. That keeps the hot path free of thousands of `.labels(...).set()` calls per
report, and lets heartbeat age be computed at scrape time so it grows while a run is silent.

Names come from guard/core/schema.py (alert rules are written against them); labels:
  run                      on every per-run metric
  layer                    moeguard_layer_* and moeguard_expert_load_share
  rank                     last report time, heartbeat age/timeout/lost, straggler score,
                           progress age/deadline, stuck
  phase                    moeguard_rank_stuck, moeguard_run_stuck_ranks (guard/core/progress.py)
  detector                 verdict counter (counted from verdict events)
  action                   moeguard_guard_actions_total: guard/core/actions.py's definition, the same count
                           as the CLI, meta.json and the app (step decisions from rank 0's reports,
                           corrections from action events); every action starts at 0
  outcome                  moeguard_ingest_batches_total (a rejected batch may name no valid run)
  torch, device, attention, expert_kernel, compile    moeguard_run_info (= 1), from the run's meta

Scrapes never block ingest: `collect()` copies one run at a time under the lock (a few fields
and array copies) and builds its series after letting go, so an ingest waits at most for one
run's copy, never for a whole render. Each run's series are capped at `max_series_per_run`
(guard/core/limits.py): run-level series first, then per-rank, then per-layer; what does not fit is
left out and counted in moeguard_collector_series_dropped{run}.

Evicted runs (guard/core/limits.py, max_hot_runs) keep a compact record here (`compact`): counters,
halt latch, heartbeats, the last step's scalars; the per-layer arrays, expert-share histograms
and per-rank step-time windows go, and come back as the run reports again.

moeguard_expert_load_share{run,layer} is a histogram of per-expert load shares (load_i / sum),
one observation per expert per rank-0 step: bounded cardinality however many experts a layer
has. Bucket bounds are EXPERT_SHARE_BUCKETS; le="0" counts experts that got no token. The bounds
sit at 1/E and 1.5/E for E = 2, 4, ..., 256 (each uniform share 1/E is a bound of its own, and so
are half and double it), so a balanced 8-expert layer reads as one band at 0.125 instead of
vanishing into a 0.1-0.2 bucket that also held shares 60% above the uniform one.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from guard.core import actions as guard_actions
from guard.core import schema
from guard.core.heartbeat import PHASES, HeartbeatConfig, HeartbeatTracker
from guard.core.limits import CollectorLimits
from guard.core.progress import ProgressConfig, ProgressTracker
from guard.core.report import StepReport

# 0, then 1/256 .. 1/2 by powers of two with 1.5/E between them, then 3/4 and 1: the uniform
# share 1/E of E = 2..256 experts is a bound, and so are half and double it.
EXPERT_SHARE_BUCKETS = (0.0, *(m / 2**k for k in range(8, 0, -1) for m in (1.0, 1.5)), 1.0)
_BOUNDS = np.asarray(EXPERT_SHARE_BUCKETS)
_NB = len(EXPERT_SHARE_BUCKETS) + 1  # + the +Inf bucket
STRAGGLER_WINDOW = 50  # per-rank step times kept for the straggler median
RUN_INFO_LABELS = ("torch", "device", "attention", "expert_kernel", "compile")
# meta keys searched (anywhere in the nested meta) for each run_info label, first match wins
_INFO_KEYS: dict[str, tuple[str, ...]] = {
    "torch": ("torch", "torch_version"),
    "device": ("device_name", "device"),
    "attention": ("attention", "attention_backend", "sdpa_backend", "attn_backend"),
    "expert_kernel": ("expert_kernel", "experts_kernel"),  # the kernel, not the expert count
    "compile": ("compile", "torch_compile"),
}


@dataclass(kw_only=True, slots=True)
class BaselineConfig:
    """Steps whose median MFU / tokens-per-second become the run's frozen baseline."""

    start: int = 20
    end: int = 120


@dataclass(slots=True)
class _Run:
    heartbeats: HeartbeatTracker
    last: StepReport | None = None
    tokens_total: int = 0
    nonfinite_total: int = 0
    values_total: int = 0
    verdicts: Counter = field(default_factory=Counter)
    actions: Counter = field(default_factory=lambda: Counter(guard_actions.zero()))
    halted: bool = False
    info: dict[str, str] | None = None
    mfu_vals: list[float] = field(default_factory=list)
    tps_vals: list[float] = field(default_factory=list)
    mfu_baseline: float | None = None
    tps_baseline: float | None = None
    baseline_frozen: bool = False
    first_time: float | None = None  # start of the first step seen (report time - step time)
    last_time: float | None = None
    productive_s: float = 0.0
    hist_rows: dict[int, int] = field(default_factory=dict)  # layer -> row of hist_counts
    hist_counts: np.ndarray = field(default_factory=lambda: np.zeros((0, _NB), np.int64))
    hist_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    row_cache: dict[bytes, np.ndarray] = field(default_factory=dict)
    rank_step_times: dict[int, deque] = field(default_factory=dict)
    rank_scores: dict[int, float] = field(default_factory=dict)  # straggler scores the trainer reported
    goodput: float | None = None  # the trainer's own figure (meta["goodput"]), when it sent one
    stored_step: int | None = None  # last stored step, for a run whose last report is not in memory
    complete: bool = False  # restored from the run store (or seen from its start) by this process
    series_dropped: int = 0  # series left out of the last render (max_series_per_run)
    progress: ProgressTracker = field(default_factory=ProgressTracker)  # progress deadlines (RunStuck)


_EMPTY_ARRAYS = {
    "layer_ids_L": np.zeros(0, np.int32),
    "layer_grad_norm_L": np.zeros(0),
    "moe_layer_ids_M": np.zeros(0, np.int32),
    "router_entropy_M": np.zeros(0),
    "load_entropy_M": np.zeros(0),
    "maxvio_M": np.zeros(0),
    "dead_experts_M": np.zeros(0, np.int32),
    "bias_norm_M": np.zeros(0),
    "load_ME": np.zeros((0, 0), np.int64),
    "bias_ME": np.zeros((0, 0)),
}


@dataclass(slots=True)
class _RunView:
    """What one run's series are built from, copied under the lock (see `collect`)."""

    run: str
    r: _Run  # only its immutable-after-write fields are read outside the lock
    verdicts: dict[str, int]
    actions: dict[str, int]
    hist_rows: dict[int, int]
    hist_counts: np.ndarray
    hist_sum: np.ndarray
    beats: list[tuple[int, float, float, float]]  # rank, last_seen, age, timeout
    progress: list[tuple[int, str, float, float, bool]]  # rank, phase, progress age, deadline, stuck
    step_times: dict[int, list[float]]
    rank_scores: dict[int, float]


class CollectorMetrics(Collector):
    """State behind /metrics. Thread-safe: ingest threads write, the scrape thread reads."""

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        heartbeat: HeartbeatConfig | None = None,
        baseline: BaselineConfig | None = None,
        clock: Callable[[], float] = time.time,
        limits: CollectorLimits | None = None,
        progress: ProgressConfig | None = None,
    ) -> None:
        self.heartbeat_cfg = heartbeat or HeartbeatConfig()
        self.progress_cfg = progress or ProgressConfig()
        self.limits = limits or CollectorLimits()
        self._refusals: Counter = Counter()  # limit name -> batches refused
        self._evictions = 0
        self.hot_runs: Callable[[], int] = lambda: 0  # set by the collector
        self.pending_load: Callable[[], int] = lambda: 0
        self.baseline = baseline or BaselineConfig()
        self.clock = clock
        self._lock = threading.RLock()
        self._runs: dict[str, _Run] = {}
        self._batches: Counter = Counter()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)  # a name collision fails here, not at scrape time

    # ---- writers (called by the collector) ------------------------------------------
    def _run(self, run: str) -> _Run:
        r = self._runs.get(run)
        if r is None:
            r = self._runs[run] = _Run(
                heartbeats=HeartbeatTracker(self.heartbeat_cfg), progress=ProgressTracker(self.progress_cfg)
            )
        return r

    def ensure_run(self, run: str) -> None:
        with self._lock:
            self._run(run)

    def runs(self) -> list[str]:
        with self._lock:
            return list(self._runs)

    def batch(self, outcome: str) -> None:
        """Count one ingest batch: ok | duplicate | unauthorized | too_large | bad_request."""
        with self._lock:
            self._batches[outcome] += 1

    def refused(self, limit: str) -> None:
        """Count a batch refused by a limit (guard/core/limits.py)."""
        with self._lock:
            self._refusals[limit] += 1
            self._batches["over_limit"] += 1

    def detectors(self, run: str) -> list[str]:
        """Detector names this run's verdict counters hold."""
        with self._lock:
            r = self._runs.get(run)
            return [] if r is None else list(r.verdicts)

    def compact(self, run: str, stored_step: int | None) -> None:
        """The run was evicted from memory: keep what alerts and /v1/runs need (counters, halt
        latch, heartbeats, baselines, the last step's scalars), drop the per-layer and per-rank
        arrays. They come back as the run reports again."""
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return
            self._evictions += 1
            if r.last is not None:
                r.last = dataclasses.replace(r.last, **_EMPTY_ARRAYS)
            r.stored_step = stored_step
            r.hist_rows, r.row_cache, r.rank_step_times, r.rank_scores = {}, {}, {}, {}
            r.hist_counts, r.hist_sum = np.zeros((0, _NB), np.int64), np.zeros(0)

    def cold_load(
        self,
        run: str,
        *,
        meta: Mapping[str, Any] | None,
        beats: Mapping[int, list[Any]],
        stored_step: int | None,
        liveness: Mapping[str, Any] | None = None,
    ) -> bool:
        """A run read at start-up from its meta.json and state.json only (no Parquet scan): the
        halt latch from meta's status, heartbeats as last committed. False if the run already has
        a record (it was loaded in full first). The full restore happens on its first request."""
        with self._lock:
            if run in self._runs:
                return False
            r = self._run(run)
            r.stored_step = stored_step
            if meta:
                self.set_meta(run, meta)
            for rank, (seen, sent, step, phase) in beats.items():
                r.heartbeats.beat(rank, seen, step, phase, sent)
                r.progress.beat(rank, seen, step, phase, sent)
            if liveness:
                try:
                    self.load_liveness_state(run, dict(liveness))
                except (KeyError, TypeError, ValueError, AttributeError):
                    pass  # learned again from the next beats (the full load logs it)
            return True

    def is_complete(self, run: str) -> bool:
        with self._lock:
            r = self._runs.get(run)
            return bool(r and r.complete)

    def mark_complete(self, run: str) -> None:
        with self._lock:
            self._run(run).complete = True

    def observe_report(self, run: str, rep: StepReport) -> None:
        """Any rank's report: values ingested and per-rank step time; rank 0 also run health."""
        with self._lock:
            r = self._run(run)
            r.values_total += rep.n_values()
            if math.isfinite(rep.straggler_score):
                r.rank_scores[rep.rank] = rep.straggler_score
            if math.isfinite(rep.step_time_s):
                dq = r.rank_step_times.get(rep.rank)
                if dq is None:
                    dq = r.rank_step_times[rep.rank] = deque(maxlen=STRAGGLER_WINDOW)
                dq.append(rep.step_time_s)
            if rep.rank != 0:
                return
            r.last = rep
            guard_actions.tally(r.actions, rep.action)  # the step's decision: skip, rollback, halt
            r.tokens_total += max(0, rep.tokens)
            if not rep.finite:
                r.nonfinite_total += 1
            self._goodput(r, rep)
            self._baseline(r, rep)
            if rep.load_ME.size:
                self._observe_shares(r, rep)

    def _goodput(self, r: _Run, rep: StepReport) -> None:
        st = rep.step_time_s if math.isfinite(rep.step_time_s) else 0.0
        start = rep.time - st
        r.first_time = start if r.first_time is None else min(r.first_time, start)
        r.last_time = rep.time if r.last_time is None else max(r.last_time, rep.time)
        if rep.action == schema.ACT_APPLY:
            r.productive_s += st

    def _baseline(self, r: _Run, rep: StepReport) -> None:
        if r.baseline_frozen:
            return
        b = self.baseline
        if b.start <= rep.step <= b.end:
            if math.isfinite(rep.mfu):
                r.mfu_vals.append(rep.mfu)
            if math.isfinite(rep.tokens_per_s):
                r.tps_vals.append(rep.tokens_per_s)
        elif rep.step > b.end and (r.mfu_vals or r.tps_vals):
            r.mfu_baseline = float(np.median(r.mfu_vals)) if r.mfu_vals else None
            r.tps_baseline = float(np.median(r.tps_vals)) if r.tps_vals else None
            r.baseline_frozen = True
            r.mfu_vals, r.tps_vals = [], []

    def set_baselines(self, run: str, mfu: float | None, tps: float | None) -> None:
        """Restore frozen baselines (computed from the run store after a collector restart)."""
        with self._lock:
            r = self._run(run)
            r.mfu_baseline, r.tps_baseline, r.baseline_frozen = mfu, tps, True
            r.mfu_vals, r.tps_vals = [], []

    def _observe_shares(self, r: _Run, rep: StepReport) -> None:
        load = rep.load_ME.astype(np.float64)
        tot = load.sum(axis=1, keepdims=True)
        ok = tot[:, 0] > 0
        if not ok.any():
            return
        shares = load[ok] / tot[ok]  # (M', E)
        ids = rep.moe_layer_ids_M[ok]
        key = ids.tobytes()
        rows = r.row_cache.get(key)
        if rows is None:
            for lid in ids.tolist():
                if lid not in r.hist_rows:
                    r.hist_rows[lid] = len(r.hist_rows)
            n = len(r.hist_rows)
            if r.hist_counts.shape[0] < n:
                r.hist_counts = np.vstack(
                    [r.hist_counts, np.zeros((n - r.hist_counts.shape[0], _NB), np.int64)]
                )
                r.hist_sum = np.concatenate([r.hist_sum, np.zeros(n - r.hist_sum.shape[0])])
            rows = r.row_cache[key] = np.asarray([r.hist_rows[lid] for lid in ids.tolist()], np.int64)
        # bucket i holds shares in (bound[i-1], bound[i]]; the last one is (1.0, +Inf)
        b = np.searchsorted(_BOUNDS, shares, side="left")
        flat = (rows[:, None] * _NB + b).reshape(-1)
        n = r.hist_counts.shape[0]
        r.hist_counts += np.bincount(flat, minlength=n * _NB).reshape(n, _NB)
        np.add.at(r.hist_sum, rows, shares.sum(axis=1))

    def observe_events(self, run: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Verdict events count by detector, correction events (bias_correct, lr_cooldown) by
        action (step decisions are counted from reports: guard/core/actions.py); a halt sets halted,
        a resume clears it (in event order, so a batch may resume and halt again)."""
        with self._lock:
            r = self._run(run)
            for ev in rows:
                kind = ev.get("kind")
                if kind == schema.EV_VERDICT:
                    r.verdicts[str(ev.get("detector") or "unknown")] += 1
                guard_actions.tally(r.actions, None, [ev])
                if kind == schema.EV_HALT or (
                    kind == schema.EV_ACTION and ev.get("action") == schema.ACT_HALT
                ):
                    r.halted = True
                elif kind == schema.EV_RESUME:
                    r.halted = False

    def set_halted(self, run: str, halted: bool = True) -> None:
        with self._lock:
            self._run(run).halted = halted

    def set_meta(self, run: str, meta: Mapping[str, Any]) -> None:
        with self._lock:
            self._run(run).info = {k: _find_key(meta, keys) for k, keys in _INFO_KEYS.items()}
            g = meta.get("goodput")
            if (
                isinstance(g, Mapping)
                and isinstance(g.get("goodput"), int | float)
                and math.isfinite(g["goodput"])
            ):
                self._runs[run].goodput = float(g["goodput"])  # the trainer's: counts startup and restarts
            if meta.get("status") == schema.STATUS_HALTED:
                self._runs[run].halted = True

    def beat(
        self,
        run: str,
        rank: int,
        now: float,
        step: int,
        phase: str,
        sent: float | None = None,
        generation: int | None = None,
    ) -> None:
        with self._lock:
            r = self._run(run)
            r.heartbeats.beat(rank, now, step, phase, sent)
            r.progress.beat(rank, now, step, phase, sent, generation)

    def end_heartbeats(self, run: str, rank: int | None = None) -> None:
        """Stop watching `rank` (every rank if None): it stopped on purpose, so its heartbeat
        series go away instead of turning into HeartbeatLost. A later beat watches it again."""
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return
            if rank is None:
                r.heartbeats.ranks.clear()
            else:
                r.heartbeats.ranks.pop(rank, None)
            r.progress.end(rank)

    def liveness_state(self, run: str) -> dict[str, Any]:
        """What heartbeats learned beyond `beats()`: progress deadlines and quiet-phase intervals."""
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return {}
            return {"progress": r.progress.state_dict(), "quiet_max": dict(r.heartbeats.quiet_max)}

    def load_liveness_state(self, run: str, st: dict[str, Any]) -> None:
        """Restore `liveness_state()` (after the ranks' beats); ValueError/TypeError/KeyError if damaged."""
        with self._lock:
            r = self._run(run)
            r.progress.load_state_dict(st.get("progress", {}))
            r.heartbeats.quiet_max = {
                PHASES[PHASES.index(k)]: float(v) for k, v in st.get("quiet_max", {}).items()
            }

    @staticmethod
    def _stuck(r: _Run, rank: int, now: float) -> bool:
        """No progress within the deadline while the heartbeat is alive (silence is HeartbeatLost)."""
        hb = r.heartbeats
        alive = rank in hb.ranks and not hb.age(rank, now) > hb.timeout(rank)
        return alive and rank in r.progress.ranks and r.progress.stalled(rank, now)

    def rank_status(self, run: str, now: float | None = None) -> dict[int, dict[str, Any]]:
        """rank -> last report time, step, phase, age, timeout, lost (for GET /v1/runs)."""
        now = self.clock() if now is None else now
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return {}
            hb, pr = r.heartbeats, r.progress
            return {
                rank: {
                    "last_report_time": rb.last_seen,
                    "last_step": rb.step,
                    "phase": rb.phase,
                    "age_s": hb.age(rank, now),
                    "timeout_s": hb.timeout(rank),
                    "lost": hb.age(rank, now) > hb.timeout(rank),
                    "progress_age_s": pr.age(rank, now),
                    "progress_deadline_s": pr.deadline(rank),
                    "stuck": self._stuck(r, rank, now),
                }
                for rank, rb in sorted(hb.ranks.items())
            }

    def beats(self, run: str) -> dict[int, list[Any]]:
        """rank -> [last_seen, last_sent, step, phase], to persist and restore heartbeats."""
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return {}
            return {
                k: [rb.last_seen, rb.last_sent, rb.step, rb.phase] for k, rb in r.heartbeats.ranks.items()
            }

    def last_step(self, run: str) -> int | None:
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return None
            return r.stored_step if r.last is None else r.last.step

    def is_halted(self, run: str) -> bool:
        with self._lock:
            r = self._runs.get(run)
            return bool(r and r.halted)

    def render(self) -> bytes:
        """The registry in Prometheus text format. This collector's series are written straight
        to text (`_TextFamily`, 2-3x faster than building Metric objects and formatting them);
        other collectors in the registry go through
        prometheus_client as usual. Same bytes as generate_latest(registry)."""
        fam = self._families(text=True)
        self._fill(fam)
        own = "".join(f.text() for f in fam.values())  # type: ignore[attr-defined]
        _RENDERING.active = True  # collect() answers nothing: our series are in `own`
        try:
            others = generate_latest(self.registry)
        finally:
            _RENDERING.active = False
        return own.encode() + others

    # ---- prometheus_client Collector protocol ------------------------------------------
    def describe(self) -> Iterable[Metric]:
        return list(self._families().values())

    def collect(self) -> Iterable[Metric]:
        if getattr(_RENDERING, "active", False):
            return []
        fam = self._families()
        self._fill(fam)
        return list(fam.values())

    def _fill(self, fam: dict[str, Any]) -> None:
        now = self.clock()
        with self._lock:
            for b_outcome, n in sorted(self._batches.items()):
                fam[schema.M_INGEST_BATCHES].add_metric([b_outcome], n)
            for limit, n in sorted(self._refusals.items()):
                fam[schema.M_COLLECTOR_LIMIT_REFUSALS].add_metric([limit], n)
            fam[schema.M_COLLECTOR_EVICTIONS].add_metric([], self._evictions)
            fam[schema.M_COLLECTOR_KNOWN_RUNS].add_metric([], len(self._runs))
            names = sorted(self._runs)
        fam[schema.M_COLLECTOR_HOT_RUNS].add_metric([], self.hot_runs())
        fam[schema.M_COLLECTOR_PENDING_LOAD].add_metric([], self.pending_load())
        for run in names:
            with self._lock:  # one run at a time: an ingest waits for one copy, never the render
                r = self._runs.get(run)
                view = None if r is None else self._view(run, r, now)
            if view is not None:
                dropped = self._collect_run(fam, view)
                r.series_dropped = dropped  # type: ignore[union-attr]
                if dropped:
                    fam[schema.M_COLLECTOR_SERIES_DROPPED].add_metric([run], dropped)

    @staticmethod
    def _view(run: str, r: _Run, now: float) -> _RunView:
        hb = r.heartbeats
        return _RunView(
            run=run,
            r=r,
            verdicts=dict(r.verdicts),
            actions=dict(r.actions),
            hist_rows=dict(r.hist_rows),
            hist_counts=r.hist_counts.copy(),
            hist_sum=r.hist_sum.copy(),
            beats=[
                (rank, rb.last_seen, hb.age(rank, now), hb.timeout(rank))
                for rank, rb in sorted(hb.ranks.items())
            ],
            progress=[
                (
                    rank,
                    rp.phase,
                    r.progress.age(rank, now),
                    r.progress.deadline(rank),
                    CollectorMetrics._stuck(r, rank, now),
                )
                for rank, rp in sorted(r.progress.ranks.items())
                if rank in hb.ranks
            ],
            step_times={rank: list(dq) for rank, dq in r.rank_step_times.items() if dq},
            rank_scores=dict(r.rank_scores),
        )

    def _collect_run(self, fam: dict[str, Metric], v: _RunView) -> int:
        """Add one run's series, at most max_series_per_run of them; returns how many were left
        out. Order of priority: run-level (alerts and the runs table), ranks, layers."""
        run, r = v.run, v.r
        left = self.limits.max_series_per_run
        dropped = 0

        def fits(n: int) -> bool:
            nonlocal left, dropped
            if n <= left:
                left -= n
                return True
            dropped += n
            return False

        rep = r.last
        scalars: list[tuple[str, float]] = [
            (schema.M_INGEST_VALUES, r.values_total),
            (schema.M_HALTED, 1.0 if r.halted else 0.0),
            (schema.M_TOKENS, r.tokens_total),
            (schema.M_NONFINITE, r.nonfinite_total),
        ]
        if r.mfu_baseline is not None:
            scalars.append((schema.M_MFU_BASELINE, r.mfu_baseline))
        if r.tps_baseline is not None:
            scalars.append((schema.M_TPS_BASELINE, r.tps_baseline))
        if r.goodput is not None:
            scalars.append((schema.M_GOODPUT, r.goodput))
        elif r.first_time is not None and r.last_time is not None and r.last_time > r.first_time:
            scalars.append((schema.M_GOODPUT, min(1.0, r.productive_s / (r.last_time - r.first_time))))
        if rep is not None:
            scalars += [
                (schema.M_STEP, rep.step),
                (schema.M_LOSS, rep.loss),
                (schema.M_GRAD_NORM, rep.grad_norm),
                (schema.M_LR, rep.lr),
                (schema.M_TOKENS_PER_S, rep.tokens_per_s),
                (schema.M_MFU, rep.mfu),
                (schema.M_STEP_TIME, rep.step_time_s),
                (schema.M_DATA_WAIT, rep.data_wait_s),
                (schema.M_MEM_PEAK, rep.mem_peak_bytes),
            ]
        for name, val in scalars:
            if fits(1):
                fam[name].add_metric([run], float(val))
        info = r.info
        if info is not None and fits(1):
            fam[schema.M_RUN_INFO].add_metric([run, *(info[k] for k in RUN_INFO_LABELS)], 1.0)
        for det, n in sorted(v.verdicts.items()):
            if fits(1):
                fam[schema.M_VERDICTS].add_metric([run, det], n)
        for act, n in sorted(v.actions.items()):
            if fits(1):
                fam[schema.M_ACTIONS].add_metric([run, act], n)
        if v.beats and fits(len(PHASES)):  # RunStuck's count, per phase (0 when none is stuck)
            stuck_ranks = dict.fromkeys(PHASES, 0)
            for _, phase, _, _, stuck in v.progress:
                stuck_ranks[phase] += stuck
            for phase, n in stuck_ranks.items():
                fam[schema.M_RUN_STUCK_RANKS].add_metric([run, phase], n)
        for rank, phase, age, deadline, stuck in v.progress:
            if fits(3):
                labels = [run, str(rank)]
                fam[schema.M_PROGRESS_AGE].add_metric(labels, age)
                fam[schema.M_PROGRESS_DEADLINE].add_metric(labels, deadline)
                fam[schema.M_RANK_STUCK].add_metric([*labels, phase], 1.0 if stuck else 0.0)
        for rank, seen, age, timeout in v.beats:
            if fits(4):
                labels = [run, str(rank)]
                fam[schema.M_LAST_SEEN].add_metric(labels, seen)
                fam[schema.M_HEARTBEAT_AGE].add_metric(labels, age)
                fam[schema.M_HEARTBEAT_TIMEOUT].add_metric(labels, timeout)
                fam[schema.M_HEARTBEAT_LOST].add_metric(labels, 1.0 if age > timeout else 0.0)
        if rep is not None:
            for lid, val in zip(rep.layer_ids_L.tolist(), rep.layer_grad_norm_L.tolist(), strict=True):
                if fits(1):
                    fam[schema.M_LAYER_GRAD_NORM].add_metric([run, str(lid)], val)
            moe = rep.moe_layer_ids_M.tolist()
            for name, arr in (
                (schema.M_LAYER_MAXVIO, rep.maxvio_M),
                (schema.M_LAYER_DEAD, rep.dead_experts_M),
                (schema.M_LAYER_LOAD_ENTROPY, rep.load_entropy_M),
                (schema.M_LAYER_ROUTER_ENTROPY, rep.router_entropy_M),
                (schema.M_LAYER_BIAS_NORM, rep.bias_norm_M),
            ):
                for lid, val in zip(moe, arr.tolist(), strict=True):
                    if fits(1):
                        fam[name].add_metric([run, str(lid)], float(val))
        for lid, row in sorted(v.hist_rows.items()):
            if not fits(_NB + 2):  # buckets (+Inf included), _sum, _count
                continue
            cum = np.cumsum(v.hist_counts[row]).tolist()
            buckets = [(_le(b), c) for b, c in zip(EXPERT_SHARE_BUCKETS, cum, strict=False)] + [
                ("+Inf", cum[-1])
            ]
            fam[schema.M_EXPERT_LOAD_SHARE].add_metric([run, str(lid)], buckets, float(v.hist_sum[row]))
        medians = {rank: float(np.median(ts)) for rank, ts in v.step_times.items()}
        fastest = min(medians.values(), default=math.nan)
        for rank in sorted(set(medians) | set(v.rank_scores)):
            # nvidia-resiliency-ext's relative score: fastest rank's median / this rank's (1 = fastest).
            # A trainer that reports scores measured them on time outside collectives (in synchronous
            # training every rank's wall step time is the same); otherwise: from reported step times.
            med = medians.get(rank, math.nan)
            score = v.rank_scores.get(rank, fastest / med if med > 0 else math.nan)
            if fits(1):
                fam[schema.M_STRAGGLER].add_metric([run, str(rank)], score)
        return dropped

    @staticmethod
    def _families(text: bool = False) -> dict[str, Any]:
        """name -> a Metric family (for collect()), or a _TextFamily of the same shape (render)."""
        g, c = ("gauge", "counter") if text else (GaugeMetricFamily, CounterMetricFamily)
        R, RL, RK = ["run"], ["run", "layer"], ["run", "rank"]
        specs: list[tuple[str, type, list[str], str]] = [
            (schema.M_STEP, g, R, "last step reported by rank 0"),
            (schema.M_LOSS, g, R, "training loss of the last step"),
            (schema.M_GRAD_NORM, g, R, "total gradient L2 norm before clipping, last step"),
            (schema.M_LR, g, R, "learning rate of the last step"),
            (schema.M_TOKENS, c, R, "tokens consumed (all ranks), as reported by rank 0"),
            (schema.M_TOKENS_PER_S, g, R, "tokens per second, last step"),
            (schema.M_MFU, g, R, "model FLOPs utilisation (0..1), last step; NaN when the peak is unknown"),
            (schema.M_STEP_TIME, g, R, "wall time of the last step"),
            (schema.M_DATA_WAIT, g, R, "time the last step waited for data"),
            (schema.M_MEM_PEAK, g, R, "peak accelerator memory of the last step"),
            (schema.M_LAYER_GRAD_NORM, g, RL, "per-layer gradient L2 norm, last step"),
            (schema.M_LAYER_MAXVIO, g, RL, "MaxVio = (max load - mean load) / mean load, last step"),
            (schema.M_LAYER_DEAD, g, RL, "experts with no token over the dead-expert window"),
            (schema.M_LAYER_LOAD_ENTROPY, g, RL, "entropy of the expert load histogram / log(E)"),
            (schema.M_LAYER_ROUTER_ENTROPY, g, RL, "mean per-token router entropy"),
            (schema.M_LAYER_BIAS_NORM, g, RL, "L2 norm of the expert-selection bias"),
            (
                schema.M_VERDICTS,
                c,
                ["run", "detector"],
                "detector verdicts (trainer events and collector-side)",
            ),
            (
                schema.M_ACTIONS,
                c,
                ["run", "action"],
                "guard actions (guard/core/actions.py): skipped, "
                "rolled-back and halted steps, bias corrections and LR cool-downs started",
            ),
            (schema.M_NONFINITE, c, R, "rank-0 steps with a non-finite loss or gradient norm"),
            (schema.M_HALTED, g, R, "1 when the run halted itself (a halt event arrived), until it resumes"),
            (schema.M_LAST_SEEN, g, RK, "unix time the collector last heard from this rank"),
            (schema.M_HEARTBEAT_AGE, g, RK, "seconds since the collector last heard from this rank"),
            (schema.M_HEARTBEAT_TIMEOUT, g, RK, "learned heartbeat timeout (5 x max interval, floored)"),
            (schema.M_HEARTBEAT_LOST, g, RK, "1 when heartbeat age exceeds the timeout"),
            (schema.M_STRAGGLER, g, RK, "fastest rank's median step time / this rank's (1 = fastest)"),
            (schema.M_PROGRESS_AGE, g, RK, "seconds since this rank last advanced (a new step or phase)"),
            (
                schema.M_PROGRESS_DEADLINE,
                g,
                RK,
                "learned deadline of the rank's phase (guard/core/progress.py)",
            ),
            (
                schema.M_RANK_STUCK,
                g,
                ["run", "rank", "phase"],
                "1 when the rank has not advanced within its phase's deadline while its heartbeat goes on",
            ),
            (
                schema.M_RUN_STUCK_RANKS,
                g,
                ["run", "phase"],
                "ranks of the run stuck in each phase (RunStuck)",
            ),
            (schema.M_GOODPUT, g, R, "productive (applied) step time / wall time since the first step"),
            (schema.M_MFU_BASELINE, g, R, "median MFU over the run's baseline window (frozen)"),
            (schema.M_TPS_BASELINE, g, R, "median tokens/s over the run's baseline window (frozen)"),
            (schema.M_INGEST_BATCHES, c, ["outcome"], "ingest batches by outcome"),
            (schema.M_INGEST_VALUES, c, R, "numeric values ingested (StepReport.n_values)"),
            (schema.M_RUN_INFO, g, ["run", *RUN_INFO_LABELS], "1, labelled with the run's environment"),
            (schema.M_COLLECTOR_HOT_RUNS, g, [], "runs with full state in memory (at most --max-hot-runs)"),
            (schema.M_COLLECTOR_KNOWN_RUNS, g, [], "runs with a record in memory, hot or evicted (compact)"),
            (schema.M_COLLECTOR_PENDING_LOAD, g, [], "run folders the start-up scan has not read yet"),
            (
                schema.M_COLLECTOR_EVICTIONS,
                c,
                [],
                "idle runs evicted from memory (least recently used first)",
            ),
            (schema.M_COLLECTOR_LIMIT_REFUSALS, c, ["limit"], "batches refused (400) for going over a limit"),
            (
                schema.M_COLLECTOR_SERIES_DROPPED,
                g,
                R,
                "series of the run left out of the last render (--max-series-per-run)",
            ),
        ]
        hist_doc = "per-expert share of a layer's routed tokens, one observation per expert per step"
        if text:
            fams: dict[str, Any] = {
                name: _TextFamily(name, kind, labels, doc) for name, kind, labels, doc in specs
            }
            fams[schema.M_EXPERT_LOAD_SHARE] = _TextFamily(
                schema.M_EXPERT_LOAD_SHARE, "histogram", RL, hist_doc
            )
            return fams
        fams = {name: cls(name, doc, labels=labels) for name, cls, labels, doc in specs}
        fams[schema.M_EXPERT_LOAD_SHARE] = HistogramMetricFamily(
            schema.M_EXPERT_LOAD_SHARE, hist_doc, labels=RL
        )
        return fams


_RENDERING = threading.local()


def _esc(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return v


class _TextFamily:
    """A metric family written straight to Prometheus text, with the `add_metric` of
    GaugeMetricFamily / CounterMetricFamily / HistogramMetricFamily and generate_latest's
    exact output (label pairs sorted by name, values through floatToGoString)."""

    def __init__(self, name: str, kind: str, labels: list[str], doc: str) -> None:
        self.kind = kind
        if kind == "counter":
            name = name if name.endswith("_total") else name + "_total"
        self.name = name
        doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        self.head = f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"
        self.lines: list[str] = []
        self.fmt = self._fmt(list(labels))  # "{{layer=\"{1}\",run=\"{0}\"}}": label values by position
        self.bucket_fmt = self._fmt([*labels, "le"])

    @staticmethod
    def _fmt(keys: list[str]) -> str:
        if not keys:
            return ""
        order = sorted(range(len(keys)), key=lambda i: keys[i])
        return "{{" + ",".join(f'{keys[i]}="{{{i}}}"' for i in order) + "}}"

    def add_metric(self, labels: list[str], value: Any, sum_value: float | None = None) -> None:
        lab = self.fmt.format(*map(_esc, labels))
        if self.kind != "histogram":
            self.lines.append(f"{self.name}{lab} {floatToGoString(value)}\n")
            return
        esc = [_esc(v) for v in labels]
        name, fmt = self.name, self.bucket_fmt
        self.lines.extend(
            f"{name}_bucket{fmt.format(*esc, le)} {floatToGoString(count)}\n" for le, count in value
        )
        self.lines.append(f"{name}_count{lab} {floatToGoString(value[-1][1])}\n")
        self.lines.append(f"{name}_sum{lab} {floatToGoString(sum_value)}\n")

    def text(self) -> str:
        return self.head + "".join(self.lines)


def _le(b: float) -> str:
    return repr(float(b))


def _find_key(meta: Any, keys: tuple[str, ...]) -> str:
    """First value under any of `keys` anywhere in nested dicts (breadth-first), as a string."""
    frontier = [meta]
    while frontier:
        nxt = []
        for d in frontier:
            if not isinstance(d, Mapping):
                continue
            for k in keys:
                if k in d and not isinstance(d[k], Mapping | list):
                    v = d[k]
                    return str(v).lower() if isinstance(v, bool) else str(v)
            nxt.extend(v for v in d.values() if isinstance(v, Mapping))
        frontier = nxt
    return ""
