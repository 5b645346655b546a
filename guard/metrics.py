"""The collector's Prometheus registry: one custom collector rendering every moeguard_* metric.

Why a custom collector instead of Gauge/Counter objects: ingest keeps a reference to each run's
last rank-0 StepReport plus a few counters, O(1) per report; label sets and values are built
at scrape time. That keeps the hot path free of thousands of `.labels(...).set()` calls per
report, and lets heartbeat age be computed at scrape time so it grows while a run is silent.

Names come from guard/schema.py (alert rules are written against them); labels:
  run                      on every per-run metric
  layer                    moeguard_layer_* and moeguard_expert_load_share
  rank                     last report time, heartbeat age/timeout/lost, straggler score
  detector                 verdict counter (counted from verdict events)
  action                   moeguard_guard_actions_total: guard/actions.py's definition, the same count
                           as the CLI, meta.json and the app (step decisions from rank 0's reports,
                           corrections from action events); every action starts at 0
  outcome                  moeguard_ingest_batches_total (a rejected batch may name no valid run)
  torch, device, attention, expert_kernel, compile    moeguard_run_info (= 1), from the run's meta

moeguard_expert_load_share{run,layer} is a histogram of per-expert load shares (load_i / sum),
one observation per expert per rank-0 step: bounded cardinality however many experts a layer
has. Bucket bounds are EXPERT_SHARE_BUCKETS; le="0" counts experts that got no token. The bounds
sit at 1/E and 1.5/E for E = 2, 4, ..., 256 (each uniform share 1/E is a bound of its own, and so
are half and double it), so a balanced 8-expert layer reads as one band at 0.125 instead of
vanishing into a 0.1-0.2 bucket that also held shares 60% above the uniform one.
"""

from __future__ import annotations

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

from guard import actions as guard_actions
from guard import schema
from guard.heartbeat import HeartbeatConfig, HeartbeatTracker
from guard.report import StepReport

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


class CollectorMetrics(Collector):
    """State behind /metrics. Thread-safe: ingest threads write, the scrape thread reads."""

    def __init__(self, *, registry: CollectorRegistry | None = None, heartbeat: HeartbeatConfig | None = None,
                 baseline: BaselineConfig | None = None, clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.heartbeat_cfg = heartbeat or HeartbeatConfig()
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
            r = self._runs[run] = _Run(heartbeats=HeartbeatTracker(self.heartbeat_cfg))
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
        action (step decisions are counted from reports: guard/actions.py); a halt sets halted,
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
            if isinstance(g, Mapping) and isinstance(g.get("goodput"), int | float) and math.isfinite(g["goodput"]):
                self._runs[run].goodput = float(g["goodput"])  # the trainer's: counts startup and restarts
            if meta.get("status") == schema.STATUS_HALTED:
                self._runs[run].halted = True

    def beat(self, run: str, rank: int, now: float, step: int, phase: str, sent: float | None = None) -> None:
        with self._lock:
            self._run(run).heartbeats.beat(rank, now, step, phase, sent)

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

    def rank_status(self, run: str, now: float | None = None) -> dict[int, dict[str, Any]]:
        """rank -> last report time, step, phase, age, timeout, lost (for GET /v1/runs)."""
        now = self.clock() if now is None else now
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return {}
            hb = r.heartbeats
            return {
                rank: {"last_report_time": rb.last_seen, "last_step": rb.step, "phase": rb.phase,
                       "age_s": hb.age(rank, now), "timeout_s": hb.timeout(rank),
                       "lost": hb.age(rank, now) > hb.timeout(rank)}
                for rank, rb in sorted(hb.ranks.items())
            }  # fmt: skip

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
            return None if r is None or r.last is None else r.last.step

    def is_halted(self, run: str) -> bool:
        with self._lock:
            r = self._runs.get(run)
            return bool(r and r.halted)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- prometheus_client Collector protocol ------------------------------------------
    def describe(self) -> Iterable[Metric]:
        return list(self._families().values())

    def collect(self) -> Iterable[Metric]:
        now = self.clock()
        fam = self._families()
        with self._lock:
            for b_outcome, n in sorted(self._batches.items()):
                fam[schema.M_INGEST_BATCHES].add_metric([b_outcome], n)
            for run, r in sorted(self._runs.items()):
                self._collect_run(fam, run, r, now)
        return list(fam.values())

    def _collect_run(self, fam: dict[str, Metric], run: str, r: _Run, now: float) -> None:
        fam[schema.M_INGEST_VALUES].add_metric([run], r.values_total)
        fam[schema.M_HALTED].add_metric([run], 1.0 if r.halted else 0.0)
        fam[schema.M_TOKENS].add_metric([run], r.tokens_total)
        fam[schema.M_NONFINITE].add_metric([run], r.nonfinite_total)
        for det, n in sorted(r.verdicts.items()):
            fam[schema.M_VERDICTS].add_metric([run, det], n)
        for act, n in sorted(r.actions.items()):
            fam[schema.M_ACTIONS].add_metric([run, act], n)
        if r.info is not None:
            fam[schema.M_RUN_INFO].add_metric([run, *(r.info[k] for k in RUN_INFO_LABELS)], 1.0)
        if r.mfu_baseline is not None:
            fam[schema.M_MFU_BASELINE].add_metric([run], r.mfu_baseline)
        if r.tps_baseline is not None:
            fam[schema.M_TPS_BASELINE].add_metric([run], r.tps_baseline)
        if r.goodput is not None:
            fam[schema.M_GOODPUT].add_metric([run], r.goodput)
        elif r.first_time is not None and r.last_time is not None and r.last_time > r.first_time:
            fam[schema.M_GOODPUT].add_metric([run], min(1.0, r.productive_s / (r.last_time - r.first_time)))
        rep = r.last
        if rep is not None:
            for name, v in ((schema.M_STEP, rep.step), (schema.M_LOSS, rep.loss), (schema.M_GRAD_NORM, rep.grad_norm),
                            (schema.M_LR, rep.lr), (schema.M_TOKENS_PER_S, rep.tokens_per_s), (schema.M_MFU, rep.mfu),
                            (schema.M_STEP_TIME, rep.step_time_s), (schema.M_DATA_WAIT, rep.data_wait_s),
                            (schema.M_MEM_PEAK, rep.mem_peak_bytes)):  # fmt: skip
                fam[name].add_metric([run], float(v))
            for lid, v in zip(rep.layer_ids_L.tolist(), rep.layer_grad_norm_L.tolist(), strict=True):
                fam[schema.M_LAYER_GRAD_NORM].add_metric([run, str(lid)], v)
            moe = rep.moe_layer_ids_M.tolist()
            for name, arr in ((schema.M_LAYER_MAXVIO, rep.maxvio_M), (schema.M_LAYER_DEAD, rep.dead_experts_M),
                              (schema.M_LAYER_LOAD_ENTROPY, rep.load_entropy_M),
                              (schema.M_LAYER_ROUTER_ENTROPY, rep.router_entropy_M),
                              (schema.M_LAYER_BIAS_NORM, rep.bias_norm_M)):  # fmt: skip
                for lid, v in zip(moe, arr.tolist(), strict=True):
                    fam[name].add_metric([run, str(lid)], float(v))
        for lid, row in sorted(r.hist_rows.items()):
            cum = np.cumsum(r.hist_counts[row]).tolist()
            buckets = [(_le(b), c) for b, c in zip(EXPERT_SHARE_BUCKETS, cum, strict=False)] + [
                ("+Inf", cum[-1])
            ]
            fam[schema.M_EXPERT_LOAD_SHARE].add_metric([run, str(lid)], buckets, float(r.hist_sum[row]))
        hb = r.heartbeats
        medians = {rank: float(np.median(dq)) for rank, dq in r.rank_step_times.items() if dq}
        fastest = min(medians.values(), default=math.nan)
        for rank, rb in sorted(hb.ranks.items()):
            labels = [run, str(rank)]
            age, timeout = hb.age(rank, now), hb.timeout(rank)
            fam[schema.M_LAST_SEEN].add_metric(labels, rb.last_seen)
            fam[schema.M_HEARTBEAT_AGE].add_metric(labels, age)
            fam[schema.M_HEARTBEAT_TIMEOUT].add_metric(labels, timeout)
            fam[schema.M_HEARTBEAT_LOST].add_metric(labels, 1.0 if age > timeout else 0.0)
        for rank in sorted(set(medians) | set(r.rank_scores)):
            # nvidia-resiliency-ext's relative score: fastest rank's median / this rank's (1 = fastest).
            # A trainer that reports scores measured them on time outside collectives (in synchronous
            # training every rank's wall step time is the same); otherwise: from reported step times.
            med = medians.get(rank, math.nan)
            score = r.rank_scores.get(rank, fastest / med if med > 0 else math.nan)
            fam[schema.M_STRAGGLER].add_metric([run, str(rank)], score)

    @staticmethod
    def _families() -> dict[str, Metric]:
        g, c = GaugeMetricFamily, CounterMetricFamily
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
            (schema.M_ACTIONS, c, ["run", "action"], "guard actions (guard/actions.py): skipped, "
             "rolled-back and halted steps, bias corrections and LR cool-downs started"),  # fmt: skip
            (schema.M_NONFINITE, c, R, "rank-0 steps with a non-finite loss or gradient norm"),
            (schema.M_HALTED, g, R, "1 when the run halted itself (a halt event arrived), until it resumes"),
            (schema.M_LAST_SEEN, g, RK, "unix time the collector last heard from this rank"),
            (schema.M_HEARTBEAT_AGE, g, RK, "seconds since the collector last heard from this rank"),
            (schema.M_HEARTBEAT_TIMEOUT, g, RK, "learned heartbeat timeout (5 x max interval, floored)"),
            (schema.M_HEARTBEAT_LOST, g, RK, "1 when heartbeat age exceeds the timeout"),
            (schema.M_STRAGGLER, g, RK, "fastest rank's median step time / this rank's (1 = fastest)"),
            (schema.M_GOODPUT, g, R, "productive (applied) step time / wall time since the first step"),
            (schema.M_MFU_BASELINE, g, R, "median MFU over the run's baseline window (frozen)"),
            (schema.M_TPS_BASELINE, g, R, "median tokens/s over the run's baseline window (frozen)"),
            (schema.M_INGEST_BATCHES, c, ["outcome"], "ingest batches by outcome"),
            (schema.M_INGEST_VALUES, c, R, "numeric values ingested (StepReport.n_values)"),
            (schema.M_RUN_INFO, g, ["run", *RUN_INFO_LABELS], "1, labelled with the run's environment"),
        ]
        fams: dict[str, Metric] = {name: cls(name, doc, labels=labels) for name, cls, labels, doc in specs}
        fams[schema.M_EXPERT_LOAD_SHARE] = HistogramMetricFamily(
            schema.M_EXPERT_LOAD_SHARE, "per-expert share of a layer's routed tokens, one observation per expert per step",
            labels=RL)  # fmt: skip
        return fams


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
