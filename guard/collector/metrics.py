"""The collector's Prometheus exposition: one custom collector rendering every moeguard_* metric.
Exposition only: the state it renders is the application's (guard/collector/health.py's
HealthBook), read through `HealthBook.views()` and `counts()` at scrape time.

Names come from guard/core/schema.py (alert rules are written against them); labels:
  run                      on every per-run metric
  layer                    moeguard_layer_* and moeguard_expert_load_share
  rank                     last report time, heartbeat age/timeout/lost, straggler score,
                           progress age/deadline, stuck: every rank of a job of at most
                           PER_RANK_ALL_UP_TO (64) ranks; past that only ranks out of line (lost,
                           late, stuck, straggling), with moeguard_run_ranks{state} and
                           moeguard_straggler_score_min for the rest (a 16,384-rank job adds a
                           handful of series, not 16,384 x 9)
  state                    moeguard_run_ranks: watched | lost | stuck | waiting
  phase                    moeguard_rank_stuck, moeguard_run_stuck_ranks (guard/core/progress.py)
  detector                 verdict counter (counted from verdict events)
  rank (hardware faults)   moeguard_suspected_hardware_faults_total, from transient `rerun` events
                           (rank -1: the trainer could not tell which)
  action                   moeguard_guard_actions_total: guard/core/actions.py's definition, the same count
                           as the CLI, meta.json and the app (step decisions from rank 0's reports,
                           corrections from action events); every action starts at 0
  outcome                  moeguard_ingest_batches_total (a rejected batch may name no valid run)
  torch, device, attention, expert_kernel, compile    moeguard_run_info (= 1), from the run's meta

Scrapes never block ingest: the book copies one run at a time under its lock and the series are
built after letting go. Each run's series are capped at `max_series_per_run`
(guard/core/limits.py): run-level series first, then per-rank, then per-layer; what does not fit
is left out and counted in moeguard_collector_series_dropped{run}.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from guard.collector.book import HealthBook
from guard.collector.health import (
    EXPERT_SHARE_BUCKETS,
    N_BUCKETS,
    PER_RANK_ALL_UP_TO,
    RUN_INFO_LABELS,
    RunView,
)
from guard.core import schema
from guard.core.heartbeat import PHASES
from guard.core.limits import CollectorLimits
from guard.core.straggler import StragglerConfig


class CollectorMetrics(Collector):
    """/metrics over a HealthBook (and the service's gauges, as callables). Holds no run state."""

    def __init__(
        self,
        book: HealthBook,
        *,
        registry: CollectorRegistry | None = None,
        limits: CollectorLimits | None = None,
        hot_runs: Callable[[], int] = lambda: 0,
        pending_load: Callable[[], int] = lambda: 0,
        quarantined: Callable[[], int] = lambda: 0,
    ) -> None:
        self.book = book
        self.limits = limits or CollectorLimits()
        self.hot_runs, self.pending_load, self.quarantined = hot_runs, pending_load, quarantined
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)  # a name collision fails here, not at scrape time

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
        c = self.book.counts()
        for b_outcome, n in sorted(c.batches.items()):
            fam[schema.M_INGEST_BATCHES].add_metric([b_outcome], n)
        for limit, n in sorted(c.refusals.items()):
            fam[schema.M_COLLECTOR_LIMIT_REFUSALS].add_metric([limit], n)
        fam[schema.M_COLLECTOR_EVICTIONS].add_metric([], c.evictions)
        fam[schema.M_COLLECTOR_KNOWN_RUNS].add_metric([], c.known_runs)
        fam[schema.M_COLLECTOR_HOT_RUNS].add_metric([], self.hot_runs())
        fam[schema.M_COLLECTOR_PENDING_LOAD].add_metric([], self.pending_load())
        fam[schema.M_QUARANTINED_RUNS].add_metric([], self.quarantined())
        for view in self.book.views():
            dropped = self._collect_run(fam, view)
            if dropped:
                fam[schema.M_COLLECTOR_SERIES_DROPPED].add_metric([view.run], dropped)

    def _collect_run(self, fam: dict[str, Metric], v: RunView) -> int:
        """Add one run's series, at most max_series_per_run of them; returns how many were left
        out. Order of priority: run-level (alerts and the runs table), ranks, layers."""
        budget = _Budget(self.limits.max_series_per_run)
        _run_series(fam, v, budget)
        _rank_series(fam, v, budget)
        _layer_series(fam, v, budget)
        _straggler_series(fam, v, budget)
        return budget.dropped

    @staticmethod
    def _families(text: bool = False) -> dict[str, Any]:
        """name -> a Metric family (for collect()), or a _TextFamily of the same shape (render)."""
        if text:
            fams: dict[str, Any] = {
                name: _TextFamily(name, kind, labels, doc) for name, kind, labels, doc in _SPECS
            }
            fams[schema.M_EXPERT_LOAD_SHARE] = _TextFamily(
                schema.M_EXPERT_LOAD_SHARE, "histogram", _RL, _HIST_DOC
            )
            return fams
        fams = {name: _FAMILY_CLASS[kind](name, doc, labels=labels) for name, kind, labels, doc in _SPECS}
        fams[schema.M_EXPERT_LOAD_SHARE] = HistogramMetricFamily(
            schema.M_EXPERT_LOAD_SHARE, _HIST_DOC, labels=_RL
        )
        return fams


class _Budget:
    """The series one run may still add (max_series_per_run); what does not fit is counted."""

    __slots__ = ("dropped", "left")

    def __init__(self, left: int) -> None:
        self.left, self.dropped = left, 0

    def fits(self, n: int) -> bool:
        if n <= self.left:
            self.left -= n
            return True
        self.dropped += n
        return False


def _run_series(fam: dict[str, Metric], v: RunView, budget: _Budget) -> None:
    """The last step's scalars, the run's info, its verdict and action counts, stuck ranks."""
    run, rep, fits = v.run, v.last, budget.fits
    scalars = list(v.scalars.items())
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
    if v.halt is not None and fits(1):
        fam[schema.M_HALT_INFO].add_metric([run, *(v.halt[k] for k in schema.HALT_INFO_LABELS)], 1.0)
    info = v.info
    if info is not None and fits(1):
        fam[schema.M_RUN_INFO].add_metric([run, *(info[k] for k in RUN_INFO_LABELS)], 1.0)
    for det, n in sorted(v.verdicts.items()):
        if fits(1):
            fam[schema.M_VERDICTS].add_metric([run, det], n)
    for act, n in sorted(v.actions.items()):
        if fits(1):
            fam[schema.M_ACTIONS].add_metric([run, act], n)
    for rank, n in sorted(v.hw_faults.items()):
        if fits(1):
            fam[schema.M_HW_FAULTS].add_metric([run, rank], n)
    if v.rank_counts and fits(len(v.rank_counts)):  # how many ranks, and how many out of line
        for state, n in v.rank_counts.items():
            fam[schema.M_RUN_RANKS].add_metric([run, state], n)
    if (v.beats or v.rank_counts.get("watched")) and fits(len(PHASES)):  # RunStuck's count, per phase
        stuck_ranks = dict.fromkeys(PHASES, 0)
        for _, phase, _, _, stuck in v.progress:
            stuck_ranks[phase] += stuck
        for phase, n in stuck_ranks.items():
            fam[schema.M_RUN_STUCK_RANKS].add_metric([run, phase], n)


def _rank_series(fam: dict[str, Metric], v: RunView, budget: _Budget) -> None:
    """Each rank's progress (age, deadline, stuck) and heartbeat (seen, age, timeout, lost)."""
    run, fits = v.run, budget.fits
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


def _layer_series(fam: dict[str, Metric], v: RunView, budget: _Budget) -> None:
    """The last step's per-layer values, then each layer's expert-share histogram."""
    run, rep, fits = v.run, v.last, budget.fits
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
        if not fits(N_BUCKETS + 2):  # buckets (+Inf included), _sum, _count
            continue
        cum = np.cumsum(v.hist_counts[row]).tolist()
        buckets = [(_le(b), c) for b, c in zip(EXPERT_SHARE_BUCKETS, cum, strict=False)] + [("+Inf", cum[-1])]
        fam[schema.M_EXPERT_LOAD_SHARE].add_metric([run, str(lid)], buckets, float(v.hist_sum[row]))


def _straggler_series(fam: dict[str, Metric], v: RunView, budget: _Budget) -> None:
    """Each rank's straggler score; past PER_RANK_ALL_UP_TO ranks only those under the
    straggler line, plus the run's slowest score (a healthy 16,384-rank job adds one series)."""
    medians = {rank: float(np.median(ts)) for rank, ts in v.step_times.items()}
    fastest = min(medians.values(), default=math.nan)
    ranks = set(medians) | set(v.rank_scores)
    every = len(ranks) <= PER_RANK_ALL_UP_TO
    slowest = math.inf
    for rank in sorted(ranks):
        # nvidia-resiliency-ext's relative score: fastest rank's median / this rank's (1 = fastest).
        # A trainer that reports scores measured them on time outside collectives (in synchronous
        # training every rank's wall step time is the same); otherwise: from reported step times.
        med = medians.get(rank, math.nan)
        score = v.rank_scores.get(rank, fastest / med if med > 0 else math.nan)
        if score < slowest:
            slowest = score
        if (every or score < STRAGGLER_LINE) and budget.fits(1):
            fam[schema.M_STRAGGLER].add_metric([v.run, str(rank)], score)
    if ranks and math.isfinite(slowest) and budget.fits(1):
        fam[schema.M_STRAGGLER_MIN].add_metric([v.run], slowest)


_R, _RL, _RK = ["run"], ["run", "layer"], ["run", "rank"]
# a rank scoring under this is exported however large the job (guard/core/straggler.py's default)
STRAGGLER_LINE = StragglerConfig().threshold
_FAMILY_CLASS = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
_HIST_DOC = "per-expert share of a layer's routed tokens, one observation per expert per step"
# name, kind, labels, help: every family but the expert-share histogram
_SPECS: list[tuple[str, str, list[str], str]] = [
    (schema.M_STEP, "gauge", _R, "last step reported by rank 0"),
    (schema.M_LOSS, "gauge", _R, "training loss of the last step"),
    (schema.M_GRAD_NORM, "gauge", _R, "total gradient L2 norm before clipping, last step"),
    (schema.M_LR, "gauge", _R, "learning rate of the last step"),
    (schema.M_TOKENS, "counter", _R, "tokens consumed (all ranks), as reported by rank 0"),
    (schema.M_TOKENS_PER_S, "gauge", _R, "tokens per second, last step"),
    (schema.M_MFU, "gauge", _R, "model FLOPs utilisation (0..1), last step; NaN when the peak is unknown"),
    (schema.M_STEP_TIME, "gauge", _R, "wall time of the last step"),
    (schema.M_DATA_WAIT, "gauge", _R, "time the last step waited for data"),
    (schema.M_MEM_PEAK, "gauge", _R, "peak accelerator memory of the last step"),
    (schema.M_LAYER_GRAD_NORM, "gauge", _RL, "per-layer gradient L2 norm, last step"),
    (schema.M_LAYER_MAXVIO, "gauge", _RL, "MaxVio = (max load - mean load) / mean load, last step"),
    (schema.M_LAYER_DEAD, "gauge", _RL, "experts with no token over the dead-expert window"),
    (schema.M_LAYER_LOAD_ENTROPY, "gauge", _RL, "entropy of the expert load histogram / log(E)"),
    (schema.M_LAYER_ROUTER_ENTROPY, "gauge", _RL, "mean per-token router entropy"),
    (schema.M_LAYER_BIAS_NORM, "gauge", _RL, "L2 norm of the expert-selection bias"),
    (
        schema.M_VERDICTS,
        "counter",
        ["run", "detector"],
        "detector verdicts (trainer events and collector-side)",
    ),
    (
        schema.M_ACTIONS,
        "counter",
        ["run", "action"],
        "guard actions (guard/core/actions.py): skipped, "
        "rolled-back and halted steps, bias corrections and LR cool-downs started",
    ),
    (schema.M_NONFINITE, "counter", _R, "rank-0 steps with a non-finite loss or gradient norm"),
    (
        schema.M_HW_FAULTS,
        "counter",
        _RK,
        "flagged steps whose recompute came out clean (guard.rerun), by rank",
    ),
    (schema.M_HALTED, "gauge", _R, "1 when the run halted itself (a halt event arrived), until it resumes"),
    (
        schema.M_HALT_INFO,
        "gauge",
        ["run", *schema.HALT_INFO_LABELS],
        "1 while halted, labelled with the halt's step, who halted it (guard|operator), the "
        "detector(s), the reason and the run's framework (RunHalted's annotations)",
    ),
    (schema.M_LAST_SEEN, "gauge", _RK, "unix time the collector last heard from this rank"),
    (schema.M_HEARTBEAT_AGE, "gauge", _RK, "seconds since the collector last heard from this rank"),
    (schema.M_HEARTBEAT_TIMEOUT, "gauge", _RK, "learned heartbeat timeout (5 x max interval, floored)"),
    (schema.M_HEARTBEAT_LOST, "gauge", _RK, "1 when heartbeat age exceeds the timeout"),
    (schema.M_STRAGGLER, "gauge", _RK, "fastest rank's median step time / this rank's (1 = fastest)"),
    (
        schema.M_RUN_RANKS,
        "gauge",
        ["run", "state"],
        "ranks watched, lost, stuck (named by RunStuck) and waiting in a collective",
    ),
    (schema.M_STRAGGLER_MIN, "gauge", _R, "the slowest rank's straggler score"),
    (schema.M_PROGRESS_AGE, "gauge", _RK, "seconds since this rank last advanced (a new step or phase)"),
    (
        schema.M_PROGRESS_DEADLINE,
        "gauge",
        _RK,
        "learned deadline of the rank's phase (guard/core/progress.py)",
    ),
    (
        schema.M_RANK_STUCK,
        "gauge",
        ["run", "rank", "phase"],
        "1 when the rank has not advanced within its phase's deadline while its heartbeat goes on",
    ),
    (
        schema.M_RUN_STUCK_RANKS,
        "gauge",
        ["run", "phase"],
        "ranks of the run stuck in each phase (RunStuck)",
    ),
    (schema.M_GOODPUT, "gauge", _R, "productive (applied) step time / wall time since the first step"),
    (schema.M_MFU_BASELINE, "gauge", _R, "median MFU over the run's baseline window (frozen)"),
    (schema.M_TPS_BASELINE, "gauge", _R, "median tokens/s over the run's baseline window (frozen)"),
    (schema.M_INGEST_BATCHES, "counter", ["outcome"], "ingest batches by outcome"),
    (schema.M_INGEST_VALUES, "counter", _R, "numeric values ingested (StepReport.n_values)"),
    (schema.M_RUN_INFO, "gauge", ["run", *RUN_INFO_LABELS], "1, labelled with the run's environment"),
    (schema.M_COLLECTOR_HOT_RUNS, "gauge", [], "runs with full state in memory (at most --max-hot-runs)"),
    (schema.M_COLLECTOR_KNOWN_RUNS, "gauge", [], "runs with a record in memory, hot or evicted (compact)"),
    (schema.M_COLLECTOR_PENDING_LOAD, "gauge", [], "run folders the start-up scan has not read yet"),
    (
        schema.M_COLLECTOR_EVICTIONS,
        "counter",
        [],
        "idle runs evicted from memory (least recently used first)",
    ),
    (schema.M_COLLECTOR_LIMIT_REFUSALS, "counter", ["limit"], "batches refused (400) for going over a limit"),
    (schema.M_QUARANTINED_RUNS, "gauge", [], "runs not served because their files are damaged"),
    (
        schema.M_COLLECTOR_SERIES_DROPPED,
        "gauge",
        _R,
        "series of the run left out of the last render (--max-series-per-run)",
    ),
]


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
