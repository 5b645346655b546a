"""The HealthBook: every run's RunHealth (health.py) plus the collector-wide counters, behind
one lock. The application writes it (ingest, start-up, eviction); the exposition (metrics.py)
reads `views()` and `counts()`."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from guard.collector.health import BaselineConfig, RunHealth, RunView
from guard.core.heartbeat import PHASES, HeartbeatConfig, HeartbeatTracker
from guard.core.progress import ProgressConfig, ProgressTracker
from guard.core.report import StepReport


@dataclass(slots=True)
class ServiceCounts:
    """Collector-wide counters, copied for a scrape."""

    batches: dict[str, int]  # ingest outcome -> batches
    refusals: dict[str, int]  # limit name -> batches refused
    evictions: int
    known_runs: int


class HealthBook:
    """Every run's RunHealth plus the collector-wide counters. Thread-safe: ingest threads
    write, the scrape thread reads `views()` (one run copied at a time under the lock)."""

    def __init__(
        self,
        *,
        heartbeat: HeartbeatConfig | None = None,
        progress: ProgressConfig | None = None,
        baseline: BaselineConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.heartbeat_cfg = heartbeat or HeartbeatConfig()
        self.progress_cfg = progress or ProgressConfig()
        self.baseline = baseline or BaselineConfig()
        self.clock = clock
        self._lock = threading.RLock()
        self._runs: dict[str, RunHealth] = {}
        self._batches: Counter = Counter()
        self._refusals: Counter = Counter()
        self._evictions = 0

    def _run(self, run: str) -> RunHealth:
        r = self._runs.get(run)
        if r is None:
            r = self._runs[run] = RunHealth(
                heartbeats=HeartbeatTracker(self.heartbeat_cfg), progress=ProgressTracker(self.progress_cfg)
            )
        return r

    def _update(self, run: str, fn: Callable[[RunHealth], Any]) -> Any:
        with self._lock:
            return fn(self._run(run))

    def _read(self, run: str, fn: Callable[[RunHealth], Any], default: Any) -> Any:
        with self._lock:
            r = self._runs.get(run)
            return default if r is None else fn(r)

    # ---- collector-wide counters ----------------------------------------------------
    def batch(self, outcome: str) -> None:
        """Count one ingest batch: ok | duplicate | unauthorized | too_large | bad_request | ..."""
        with self._lock:
            self._batches[outcome] += 1

    def refused(self, limit: str) -> None:
        """Count a batch refused by a limit (guard/core/limits.py)."""
        with self._lock:
            self._refusals[limit] += 1
            self._batches["over_limit"] += 1

    def counts(self) -> ServiceCounts:
        with self._lock:
            return ServiceCounts(dict(self._batches), dict(self._refusals), self._evictions, len(self._runs))

    # ---- writers (ingest) -------------------------------------------------------------
    def ensure_run(self, run: str) -> None:
        self._update(run, lambda r: None)

    def observe_report(self, run: str, rep: StepReport, now: float | None = None) -> None:
        self._update(run, lambda r: r.observe_report(rep, self.baseline, now))

    def observe_events(self, run: str, rows: Iterable[Mapping[str, Any]]) -> None:
        self._update(run, lambda r: r.observe_events(rows))

    def set_halted(self, run: str, halted: bool = True) -> None:
        self._update(run, lambda r: setattr(r, "halted", halted))

    def set_meta(self, run: str, meta: Mapping[str, Any]) -> None:
        self._update(run, lambda r: r.set_meta(meta))

    def set_baselines(self, run: str, mfu: float | None, tps: float | None) -> None:
        """Restore frozen baselines (computed from the run store after a collector restart)."""
        self._update(run, lambda r: r.set_baselines(mfu, tps))

    def beat(
        self,
        run: str,
        rank: int,
        now: float,
        step: int,
        phase: str,
        sent: float | None = None,
        generation: int | None = None,
        *,
        every: float = 0.0,
        waiting: bool = False,
        world: int = 0,
    ) -> None:
        """A rank's beat (`every`: its declared own-beat interval; `waiting`: made inside a
        collective); rank 0's with `world` > 1 also proves every rank's progress at its step."""
        with self._lock:
            r = self._run(run)
            r.heartbeats.beat(rank, now, step, phase, sent, every)
            r.progress.beat(rank, now, step, phase, sent, generation, waiting)
            if rank == 0 and world > 1:
                r.heartbeats.cover(world, now, step, phase, sent)
                r.progress.cover(world, now, step, phase, sent)
            elif rank == 0 and r.progress.covered is not None:  # no report: rank 0's phase only
                r.progress.covered.phase = phase
                if r.heartbeats.covered is not None:
                    r.heartbeats.covered.phase = phase

    def observe_ranks(self, run: str, vectors: Mapping[str, Any]) -> None:
        """Rank 0's per-rank window vectors (guard/wire/batch.py `ranks`)."""
        self._update(run, lambda r: r.observe_ranks(vectors))

    def end_heartbeats(self, run: str, rank: int | None = None) -> None:
        """Stop watching `rank` (every rank if None): it stopped on purpose, so its heartbeat
        series go away instead of turning into HeartbeatLost. A later beat watches it again."""
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return
            r.heartbeats.end(rank)
            r.progress.end(rank)

    def load_counter_state(self, run: str, st: Mapping[str, Any]) -> None:
        """Restore `counter_state()` (replacing the run's counters); ValueError/TypeError if damaged."""
        self._update(run, lambda r: r.load_counter_state(st))

    def load_liveness_state(self, run: str, st: dict[str, Any]) -> None:
        """Restore `liveness_state()` (after the ranks' beats); ValueError/TypeError/KeyError if damaged."""
        with self._lock:
            r = self._run(run)
            r.progress.load_state_dict(st.get("progress", {}))
            r.heartbeats.quiet_max = {
                PHASES[PHASES.index(k)]: float(v) for k, v in st.get("quiet_max", {}).items()
            }

    # ---- memory: eviction and the start-up scan -----------------------------------------
    def compact(self, run: str, stored_step: int | None) -> None:
        """The run was evicted from memory: keep what alerts and /v1/runs need (counters, halt
        latch, heartbeats, baselines, the last step's scalars). The rest comes back as it reports."""
        with self._lock:
            r = self._runs.get(run)
            if r is not None:
                self._evictions += 1
                r.compact(stored_step)

    def cold_load(
        self,
        run: str,
        *,
        meta: Mapping[str, Any] | None,
        beats: Mapping[int, list[Any]],
        stored_step: int | None,
        liveness: Mapping[str, Any] | None = None,
        counters: Mapping[str, Any] | None = None,
    ) -> bool:
        """A run read at start-up from its meta.json and state.json only (no Parquet scan): the
        halt latch from meta's status, heartbeats and counters as last committed. False if the
        run already has a record (it was loaded in full first). The full restore happens on its
        first request."""
        with self._lock:
            if run in self._runs:
                return False
            r = self._run(run)
            r.stored_step = stored_step
            if meta:
                r.set_meta(meta)
            for rank, (seen, sent, step, phase) in beats.items():
                r.heartbeats.beat(rank, seen, step, phase, sent)
                r.progress.beat(rank, seen, step, phase, sent)
            if liveness:
                try:
                    self.load_liveness_state(run, dict(liveness))
                except (KeyError, TypeError, ValueError, AttributeError):
                    pass  # learned again from the next beats (the full load logs it)
            if counters:
                try:
                    r.load_counter_state(counters)
                except (TypeError, ValueError, AttributeError):
                    pass  # the full load logs it
            return True

    def mark_complete(self, run: str) -> None:
        self._update(run, lambda r: setattr(r, "complete", True))

    # ---- readers ---------------------------------------------------------------------
    def runs(self) -> list[str]:
        with self._lock:
            return list(self._runs)

    def is_complete(self, run: str) -> bool:
        return self._read(run, lambda r: r.complete, False)

    def is_halted(self, run: str) -> bool:
        return self._read(run, lambda r: r.halted, False)

    def halt_labels(self, run: str) -> dict[str, str] | None:
        """What halted the run (schema.HALT_INFO_LABELS), while it is halted; None if not known."""
        return self._read(run, lambda r: r.halt_labels(), None)

    def detectors(self, run: str) -> list[str]:
        """Detector names this run's verdict counters hold."""
        return self._read(run, lambda r: list(r.verdicts), [])

    def last_step(self, run: str) -> int | None:
        return self._read(run, lambda r: r.stored_step if r.last is None else r.last.step, None)

    def rank_status(self, run: str, now: float | None = None) -> dict[int, dict[str, Any]]:
        """rank -> last report time, step, phase, age, timeout, lost, progress, stuck (GET /v1/runs)."""
        now = self.clock() if now is None else now
        return self._read(run, lambda r: r.rank_status(now), {})

    def liveness_key(self, run: str) -> tuple[Any, ...]:
        """What makes liveness.json worth rewriting at once: how many ranks beat on their own, and
        what was learned (phase durations, quiet-phase intervals); cheap, not the ranks' times."""
        return self._read(
            run,
            lambda r: (
                # a quarter more ranks: a 16,384-rank job's first beats (spread over a minute)
                # rewrite it a few times, not at every checkpoint of that minute
                int(math.log(len(r.heartbeats.ranks) + 1) / math.log(1.25)),
                _grown(r.progress.longest),
                _grown(r.heartbeats.quiet_max),
                # the phases decide deadlines: every rank's in a small job, rank 0's and the
                # proof's in a big one (its ranks move in step with them)
                tuple(b.phase for b in r.heartbeats.ranks.values())
                if len(r.heartbeats.ranks) <= 64
                else (
                    getattr(r.heartbeats.ranks.get(0), "phase", ""),
                    getattr(r.progress.covered, "phase", ""),
                ),
            ),
            (),
        )

    def all_lost(self, run: str, now: float | None = None) -> bool:
        now = self.clock() if now is None else now
        return self._read(run, lambda r: r.all_lost(now), False)

    def beats(self, run: str) -> dict[int, list[Any]]:
        """rank -> [last_seen, last_sent, step, phase], to persist and restore heartbeats."""
        return self._read(
            run,
            lambda r: {
                k: [rb.last_seen, rb.last_sent, rb.step, rb.phase] for k, rb in r.heartbeats.ranks.items()
            },
            {},
        )

    def counter_state(self, run: str) -> dict[str, Any]:
        """The run's counters as state.json keeps them (RunHealth.counter_state)."""
        return self._read(run, lambda r: r.counter_state(), {})

    def liveness_state(self, run: str) -> dict[str, Any]:
        """What heartbeats learned beyond `beats()`: progress deadlines and quiet-phase intervals."""
        return self._read(
            run,
            lambda r: {"progress": r.progress.state_dict(), "quiet_max": dict(r.heartbeats.quiet_max)},
            {},
        )

    def views(self, now: float | None = None) -> Iterator[RunView]:
        """A snapshot of each run, by name, copied one run at a time under the lock: a scrape
        makes an ingest wait for one run's copy, never for a whole render."""
        now = self.clock() if now is None else now
        for run in sorted(self.runs()):
            with self._lock:
                r = self._runs.get(run)
                view = None if r is None else r.view(run, now)
            if view is not None:
                yield view


def _grown(durations: Mapping[str, float]) -> tuple[tuple[str, int], ...]:
    """Learned durations in steps of 1.5x: a key that changes when one grew by half, not with
    every new maximum by a few milliseconds."""
    return tuple(sorted((k, int(math.log(max(v, 1e-3)) / math.log(1.5))) for k, v in durations.items()))
