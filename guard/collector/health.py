"""The collector's live view of every run: halt latch, heartbeats and progress, the last step,
counters, baselines, goodput and expert-share histograms. The application owns this state; the
Prometheus exposition (metrics.py) only reads it, through `HealthBook.views()` (a snapshot per
run, the collect() side of prometheus client_python's model).

Why references and counters instead of ready-made series: ingest keeps a reference to each
run's last rank-0 StepReport plus a few counters, O(1) per report; label sets and values are
built at scrape time, and heartbeat age is computed then, so it grows while a run is silent.

Evicted runs (guard/core/limits.py, max_hot_runs) keep a compact record here (`compact`):
counters, halt latch, heartbeats, the last step's scalars; the per-layer arrays, expert-share
histograms and per-rank step-time windows go, and come back as the run reports again.

Expert-share histogram: per-expert load shares (load_i / sum), one observation per expert per
rank-0 step, bucketed at EXPERT_SHARE_BUCKETS; le="0" counts experts that got no token. The
bounds sit at 1/E and 1.5/E for E = 2, 4, ..., 256 (each uniform share 1/E is a bound of its own,
and so are half and double it), so a balanced 8-expert layer reads as one band at 0.125 instead
of vanishing into a 0.1-0.2 bucket that also held shares 60% above the uniform one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guard.core import actions as guard_actions
from guard.core import schema
from guard.core.heartbeat import HeartbeatTracker
from guard.core.progress import ProgressTracker
from guard.core.report import StepReport
from guard.wire.batch import MAX_CLOCK_AHEAD_S, MAX_CLOCK_BEHIND_S

# 0, then 1/256 .. 1/2 by powers of two with 1.5/E between them, then 3/4 and 1: the uniform
# share 1/E of E = 2..256 experts is a bound, and so are half and double it.
EXPERT_SHARE_BUCKETS = (0.0, *(m / 2**k for k in range(8, 0, -1) for m in (1.0, 1.5)), 1.0)
_BOUNDS = np.asarray(EXPERT_SHARE_BUCKETS)
N_BUCKETS = len(EXPERT_SHARE_BUCKETS) + 1  # + the +Inf bucket
STRAGGLER_WINDOW = 50  # per-rank step times kept for the straggler median
# A job of at most this many ranks keeps every rank's liveness and straggler series; a larger one
# exports per-rank series only for ranks out of line (lost, late, stuck, straggling) plus the
# run's rank counts (issue #30: /metrics must not grow with a 16,384-rank job's healthy ranks).
PER_RANK_ALL_UP_TO = 64
RUN_INFO_LABELS = ("torch", "device", "attention", "expert_kernel", "compile")
# meta keys searched (anywhere in the nested meta) for each run_info label, first match wins
_INFO_KEYS: dict[str, tuple[str, ...]] = {
    "torch": ("torch", "torch_version"),
    "device": ("device_name", "device"),
    "attention": ("attention", "attention_backend", "sdpa_backend", "attn_backend"),
    "expert_kernel": ("expert_kernel", "experts_kernel"),  # the kernel, not the expert count
    "compile": ("compile", "torch_compile"),
}
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


def is_halt(ev: Mapping[str, Any]) -> bool:
    """A halt event, or an action event whose action is halt (both latch the run's halt)."""
    kind = ev.get("kind")
    return kind == schema.EV_HALT or (kind == schema.EV_ACTION and ev.get("action") == schema.ACT_HALT)


@dataclass(kw_only=True, slots=True)
class BaselineConfig:
    """Steps whose median MFU / tokens-per-second become the run's frozen baseline."""

    start: int = 20
    end: int = 120


@dataclass(slots=True)
class RunView:
    """What one run's series are built from, copied under the lock (see `HealthBook.views`).
    `last` and the scalars are immutable once written; the rest are copies."""

    run: str
    last: StepReport | None
    scalars: dict[str, float]  # run-level values by metric name (schema.M_*)
    info: dict[str, str] | None
    verdicts: dict[str, int]
    actions: dict[str, int]
    hist_rows: dict[int, int]
    hist_counts: np.ndarray
    hist_sum: np.ndarray
    beats: list[tuple[int, float, float, float]]  # rank, last_seen, age, timeout
    progress: list[tuple[int, str, float, float, bool]]  # rank, phase, progress age, deadline, stuck
    step_times: dict[int, list[float]]
    rank_scores: dict[int, float]
    hw_faults: dict[str, int] = field(default_factory=dict)  # rank ("-1": unknown) -> count
    # ranks watched / lost / stuck (named) / waiting in a collective; `beats` and `progress` list
    # every rank up to PER_RANK_ALL_UP_TO ranks, beyond that only those out of line
    rank_counts: dict[str, int] = field(default_factory=dict)
    all_ranks: bool = True  # the per-rank lists hold every rank (else only those out of line)
    halt: dict[str, str] | None = None  # schema.HALT_INFO_LABELS while halted (RunHealth.halt_labels)


@dataclass(slots=True)
class RunHealth:
    """One run's live state. Not thread-safe: HealthBook holds the lock."""

    heartbeats: HeartbeatTracker
    progress: ProgressTracker
    last: StepReport | None = None
    tokens_total: int = 0
    nonfinite_total: int = 0
    values_total: int = 0
    verdicts: Counter = field(default_factory=Counter)
    hw_faults: Counter = field(default_factory=Counter)  # by rank: transient reruns (trainer/rerun.py)
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
    hist_counts: np.ndarray = field(default_factory=lambda: np.zeros((0, N_BUCKETS), np.int64))
    hist_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    row_cache: dict[bytes, np.ndarray] = field(default_factory=dict)
    rank_step_times: dict[int, deque] = field(default_factory=dict)
    rank_scores: dict[int, float] = field(default_factory=dict)  # straggler scores the trainer reported
    goodput: float | None = None  # the trainer's own figure (meta["goodput"]), when it sent one
    stored_step: int | None = None  # last stored step, for a run whose last report is not in memory
    halt_info: dict[str, str] | None = None  # what halted it (halt_info_of), while it is halted
    framework: str = ""  # meta.json["framework"]
    complete: bool = False  # restored from the run store (or seen from its start) by this process

    def observe_report(self, rep: StepReport, baseline: BaselineConfig, now: float | None = None) -> None:
        """Any rank's report: values ingested and per-rank step time; rank 0 also run health.
        `now`: the collector's clock when it arrived (goodput clamps the report's time to it)."""
        self.values_total += rep.n_values()
        if math.isfinite(rep.straggler_score):
            self.rank_scores[rep.rank] = rep.straggler_score
        if math.isfinite(rep.step_time_s):
            dq = self.rank_step_times.get(rep.rank)
            if dq is None:
                dq = self.rank_step_times[rep.rank] = deque(maxlen=STRAGGLER_WINDOW)
            dq.append(rep.step_time_s)
        if rep.rank != 0:
            return
        self.last = rep
        guard_actions.tally(self.actions, rep.action)  # the step's decision: skip, rollback, halt
        self.tokens_total += max(0, rep.tokens)
        if not rep.finite:
            self.nonfinite_total += 1
        self._goodput(rep, now)
        self._baseline(rep, baseline)
        if rep.load_ME.size:
            self._observe_shares(rep)

    def observe_ranks(self, vectors: Mapping[str, Any]) -> None:
        """Every rank's straggler score, gathered in the job and sent in rank 0's batch."""
        scores = np.asarray(vectors.get("straggler_score", ()), dtype=np.float64)
        ok = np.flatnonzero(np.isfinite(scores))
        self.rank_scores = dict(zip(ok.tolist(), scores[ok].tolist(), strict=True))

    def _goodput(self, rep: StepReport, now: float | None) -> None:
        """Productive time over wall time. The wall span is the trainer's report times, but only
        as far as the collector's clock agrees: one report stamped a month ahead must not turn
        the run's goodput to ~0 for good (issue #32)."""
        st = rep.step_time_s if math.isfinite(rep.step_time_s) else 0.0
        t = rep.time if math.isfinite(rep.time) else now
        if now is not None and t is not None:
            t = min(max(t, now - MAX_CLOCK_BEHIND_S), now + MAX_CLOCK_AHEAD_S)
        if t is None:
            return
        start = t - st
        self.first_time = start if self.first_time is None else min(self.first_time, start)
        self.last_time = t if self.last_time is None else max(self.last_time, t)
        if rep.action in schema.APPLYING_ACTIONS:
            self.productive_s += st

    def _baseline(self, rep: StepReport, b: BaselineConfig) -> None:
        if self.baseline_frozen:
            return
        if b.start <= rep.step <= b.end:
            if math.isfinite(rep.mfu):
                self.mfu_vals.append(rep.mfu)
            if math.isfinite(rep.tokens_per_s):
                self.tps_vals.append(rep.tokens_per_s)
        elif rep.step > b.end and (self.mfu_vals or self.tps_vals):
            self.set_baselines(
                float(np.median(self.mfu_vals)) if self.mfu_vals else None,
                float(np.median(self.tps_vals)) if self.tps_vals else None,
            )

    def set_baselines(self, mfu: float | None, tps: float | None) -> None:
        self.mfu_baseline, self.tps_baseline, self.baseline_frozen = mfu, tps, True
        self.mfu_vals, self.tps_vals = [], []

    def _observe_shares(self, rep: StepReport) -> None:
        load = rep.load_ME.astype(np.float64)
        tot = load.sum(axis=1, keepdims=True)
        ok = tot[:, 0] > 0
        if not ok.any():
            return
        shares = load[ok] / tot[ok]  # (M', E)
        ids = rep.moe_layer_ids_M[ok]
        key = ids.tobytes()
        rows = self.row_cache.get(key)
        if rows is None:
            for lid in ids.tolist():
                if lid not in self.hist_rows:
                    self.hist_rows[lid] = len(self.hist_rows)
            n = len(self.hist_rows)
            if self.hist_counts.shape[0] < n:
                grow = n - self.hist_counts.shape[0]
                self.hist_counts = np.vstack([self.hist_counts, np.zeros((grow, N_BUCKETS), np.int64)])
                self.hist_sum = np.concatenate([self.hist_sum, np.zeros(n - self.hist_sum.shape[0])])
            rows = self.row_cache[key] = np.asarray([self.hist_rows[lid] for lid in ids.tolist()], np.int64)
        # bucket i holds shares in (bound[i-1], bound[i]]; the last one is (1.0, +Inf)
        b = np.searchsorted(_BOUNDS, shares, side="left")
        flat = (rows[:, None] * N_BUCKETS + b).reshape(-1)
        n = self.hist_counts.shape[0]
        self.hist_counts += np.bincount(flat, minlength=n * N_BUCKETS).reshape(n, N_BUCKETS)
        np.add.at(self.hist_sum, rows, shares.sum(axis=1))

    def observe_events(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Verdict events count by detector, LR cool-down events by action (step decisions,
        corrections included, are counted from reports: guard/core/actions.py); a halt sets
        halted, a resume clears it (in event order, so a batch may resume and halt again)."""
        detectors: dict[int, set[str]] = {}  # step -> detectors whose verdicts came with it
        for ev in rows:
            if ev.get("kind") == schema.EV_VERDICT:
                self.verdicts[str(ev.get("detector") or "unknown")] += 1
                detectors.setdefault(int(ev.get("step", -1)), set()).add(str(ev.get("detector") or ""))
            elif ev.get("kind") == schema.EV_RERUN and ev.get("detector") == schema.RERUN_TRANSIENT:
                for rank in rerun_ranks(ev):
                    self.hw_faults[rank] += 1
            guard_actions.tally(self.actions, None, [ev])
            if is_halt(ev):
                self.halted = True
                self.halt_info = halt_info_of(ev, detectors.get(int(ev.get("step", -1)), set()))
            elif ev.get("kind") == schema.EV_OPERATOR and ev.get("action") == schema.ACT_HALT:
                self.halt_info = halt_info_of(ev, set())  # its latch comes with meta's status
            elif ev.get("kind") == schema.EV_RESUME:
                self.halted, self.halt_info = False, None

    def set_meta(self, meta: Mapping[str, Any]) -> None:
        self.info = {k: _find_key(meta, keys) for k, keys in _INFO_KEYS.items()}
        if isinstance(meta.get("framework"), str):
            self.framework = meta["framework"]
        g = meta.get("goodput")
        if (
            isinstance(g, Mapping)
            and isinstance(g.get("goodput"), int | float)
            and math.isfinite(g["goodput"])
        ):
            self.goodput = float(g["goodput"])  # the trainer's: counts startup and restarts
        if meta.get("status") == schema.STATUS_HALTED:
            self.halted = True

    def counter_state(self) -> dict[str, Any]:
        """The counters a collector restart must not reset (state.json "counters"). Each comes
        from rank 0's reports and the events, which are in the write-ahead log, so the record a
        checkpoint commits plus the log replayed after it count every batch exactly once."""
        return {
            "actions": dict(self.actions),
            "verdicts": dict(self.verdicts),
            "hw_faults": dict(self.hw_faults),
            "tokens": self.tokens_total,
            "nonfinite": self.nonfinite_total,
        }

    def load_counter_state(self, st: Mapping[str, Any]) -> None:
        """Replace the counters with `counter_state()`'s record (keys it lacks count from 0);
        ValueError/TypeError/AttributeError when it is damaged, leaving them as they were."""
        actions, verdicts, hw = (_counts(st.get(k, {})) for k in ("actions", "verdicts", "hw_faults"))
        tokens, nonfinite = _count(st.get("tokens", 0)), _count(st.get("nonfinite", 0))
        self.actions = Counter({**guard_actions.zero(), **actions})
        self.verdicts, self.hw_faults = Counter(verdicts), Counter(hw)
        self.tokens_total, self.nonfinite_total = tokens, nonfinite

    def compact(self, stored_step: int | None) -> None:
        """Keep what alerts and /v1/runs need, drop the per-layer and per-rank arrays."""
        if self.last is not None:
            self.last = dataclasses.replace(self.last, **_EMPTY_ARRAYS)
        self.stored_step = stored_step
        self.hist_rows, self.row_cache, self.rank_step_times, self.rank_scores = {}, {}, {}, {}
        self.hist_counts, self.hist_sum = np.zeros((0, N_BUCKETS), np.int64), np.zeros(0)

    def stalled(self, rank: int, now: float) -> bool:
        """No progress within the deadline while the heartbeat is alive (silence is HeartbeatLost)."""
        hb = self.heartbeats
        alive = (rank in hb.ranks or hb.is_covered(rank)) and not hb.age(rank, now) > hb.timeout(rank)
        return alive and self.progress.effective(rank) is not None and self.progress.stalled(rank, now)

    def stuck_ranks(self, now: float) -> list[int]:
        """The stuck ranks to name: stalled, and not waiting in a collective for a stalled peer
        (guard/core/progress.py `culprits`). Cheap while rank 0's proof is fresh (none is)."""
        hb, pr = self.heartbeats, self.progress
        cv = pr.covered
        if cv is not None and now - cv.since_seen <= pr.cfg.floor_s:  # deadlines are >= the floor
            # the job advanced within the floor: only a rank of its own (a later step, a quiet
            # phase) or beyond the proof can be stalled
            pool: Iterable[int] = [r for r in pr.ranks if pr.effective(r) is not cv]
        else:
            free = pr.free_since_stall()
            pool = free if free is not None and any(self.stalled(r, now) for r in free) else hb.expected()
        return pr.culprits([r for r in pool if self.stalled(r, now)])

    def _out_of_line(self, now: float) -> tuple[list[int], bool, list[int]]:
        """(ranks whose series /metrics exports, whether that is every rank, the stuck ranks
        named). Past PER_RANK_ALL_UP_TO ranks: only those lost, late (half their timeout gone),
        named stuck, or beating without rank 0's proof; ranks that wait for a stalled peer are
        in line (16,384 of them must not become 16,384 x 9 series)."""
        hb = self.heartbeats
        expected = hb.expected()
        named = self.stuck_ranks(now)
        if len(expected) <= PER_RANK_ALL_UP_TO:
            return expected, True, named
        uncovered = [r for r in hb.ranks if not hb.is_covered(r)]
        pool = uncovered if hb.proof_fresh(now) else expected
        late = [r for r in pool if hb.age(r, now) > 0.5 * hb.timeout(r)]
        return sorted(set(late) | set(uncovered) | set(named)), False, named

    def rank_status(self, now: float) -> dict[int, dict[str, Any]]:
        hb, pr = self.heartbeats, self.progress
        ranks, _, named_list = self._out_of_line(now)
        named = set(named_list)
        out = {}
        for rank in ranks:
            rb, rp = hb.ranks.get(rank), pr.effective(rank)
            out[rank] = {
                "last_report_time": hb.seen(rank),
                "last_step": max(rb.step if rb else -1, rp.step if rp else -1),
                "phase": rb.phase if rb else (rp.phase if rp else "train"),
                "age_s": hb.age(rank, now),
                "timeout_s": hb.timeout(rank),
                "lost": hb.age(rank, now) > hb.timeout(rank),
                "progress_age_s": pr.age(rank, now),
                "progress_deadline_s": pr.deadline(rank),
                "stuck": rank in named,
                "waiting": bool(rank in pr.ranks and pr.ranks[rank].waiting),
            }
        return out

    def all_lost(self, now: float) -> bool:
        """Every watched rank silent past its timeout (the run is stale)."""
        hb = self.heartbeats
        if hb.proof_fresh(now):
            return False
        ranks = hb.expected()
        return bool(ranks) and all(hb.age(r, now) > hb.timeout(r) for r in ranks)

    def rank_counts(self, now: float, ranks: list[int], named: list[int]) -> dict[str, int]:
        hb, pr = self.heartbeats, self.progress
        return {
            "watched": len(hb.expected()),
            "lost": sum(1 for r in ranks if hb.age(r, now) > hb.timeout(r)),
            "stuck": len(named),
            "waiting": sum(1 for p in pr.ranks.values() if p.waiting),
        }

    def halt_labels(self) -> dict[str, str] | None:
        """schema.HALT_INFO_LABELS while halted by a halt this collector saw (None otherwise)."""
        if not self.halted or self.halt_info is None:
            return None
        return {**self.halt_info, "framework": self.framework or "unknown"}

    def view(self, run: str, now: float) -> RunView:
        hb, pr = self.heartbeats, self.progress
        ranks, every, named = self._out_of_line(now)
        named_set = set(named)
        return RunView(
            run=run,
            last=self.last,
            scalars=self._scalars(),
            info=self.info,
            verdicts=dict(self.verdicts),
            actions=dict(self.actions),
            hist_rows=dict(self.hist_rows),
            hist_counts=self.hist_counts.copy(),
            hist_sum=self.hist_sum.copy(),
            beats=[(rank, hb.seen(rank), hb.age(rank, now), hb.timeout(rank)) for rank in ranks],
            progress=[
                (rank, rp.phase, pr.age(rank, now), pr.deadline(rank), rank in named_set)
                for rank in ranks
                for rp in (pr.effective(rank),)
                if rp is not None
            ],
            step_times={rank: list(dq) for rank, dq in self.rank_step_times.items() if dq},
            rank_scores=dict(self.rank_scores),
            hw_faults=dict(self.hw_faults),
            rank_counts=self.rank_counts(now, ranks, named),
            all_ranks=every,
            halt=self.halt_labels(),
        )

    def _scalars(self) -> dict[str, float]:
        out: dict[str, float] = {
            schema.M_INGEST_VALUES: self.values_total,
            schema.M_HALTED: 1.0 if self.halted else 0.0,
            schema.M_TOKENS: self.tokens_total,
            schema.M_NONFINITE: self.nonfinite_total,
        }
        if self.mfu_baseline is not None:
            out[schema.M_MFU_BASELINE] = self.mfu_baseline
        if self.tps_baseline is not None:
            out[schema.M_TPS_BASELINE] = self.tps_baseline
        if self.goodput is not None:
            out[schema.M_GOODPUT] = self.goodput
        elif self.first_time is not None and self.last_time is not None and self.last_time > self.first_time:
            out[schema.M_GOODPUT] = min(1.0, self.productive_s / (self.last_time - self.first_time))
        return out


def _count(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"expected a count (an integer >= 0), got {str(v)[:40]!r}")
    return v


def _counts(d: Any) -> dict[str, int]:
    if not isinstance(d, Mapping):
        raise TypeError(f"expected counts by name, got {type(d).__name__}")
    return {str(k): _count(v) for k, v in d.items()}


def halt_info_of(ev: Mapping[str, Any], detectors: set[str]) -> dict[str, str]:
    """What halted the run, from its halt event (or an operator's halt command event) and the
    detectors whose verdicts came at the same step: step, halted_by, detector, reason."""
    detail = ev.get("detail")
    try:
        d = json.loads(detail) if isinstance(detail, str) else dict(detail or {})
    except (ValueError, TypeError):
        d = {}
    operator = ev.get("kind") == schema.EV_OPERATOR
    return {
        "step": str(ev.get("step", "")),
        "halted_by": schema.HALTED_BY_OPERATOR if operator else schema.HALTED_BY_GUARD,
        "detector": "" if operator else ",".join(sorted(x for x in detectors if x)),
        "reason": str(d.get("reason") or ("an operator command" if operator else "the guard's policy"))[:300],
    }


def rerun_ranks(ev: Mapping[str, Any]) -> list[str]:
    """The ranks a transient `rerun` event names (its detail's "ranks"), or ["-1"]: unknown."""
    detail = ev.get("detail")
    try:
        d = json.loads(detail) if isinstance(detail, str) else dict(detail or {})
        ranks = [str(int(r)) for r in d.get("ranks", [])]
    except (ValueError, TypeError, AttributeError):
        ranks = []
    return ranks or ["-1"]


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
