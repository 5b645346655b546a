"""`moeguard collector`: the HTTP service trainers stream telemetry to.

    MOEGUARD_TOKEN=... moeguard collector --host 127.0.0.1 --port 18321 --runs runs/

Endpoints
    POST /v1/ingest                 a batch (below); bearer token required
    GET  /v1/runs                   runs: id, status, last step, per rank: last report time,
                                    heartbeat age/timeout/lost, progress age/deadline, stuck
    GET  /v1/runs/{run}/commands?rank=R[&after=ID]   pending operator commands for rank R
    POST /v1/runs/{run}/commands    {"action": "rollback|halt|skip", "reason": str, "rank": int|null}
                                    an operator command; bearer token required
    GET  /metrics                   Prometheus text (guard/collector/metrics.py)
    GET  /healthz                   {"ok": true}

Batch payload: guard/wire/batch.py (the one definition; the exporter encodes with it). What the
collector does with its fields:
    seq        dedupe per (run, rank), and the writer generation (seq >> GEN_SHIFT) that owns
               the rank (below)
    heartbeat  a batch with reports and no heartbeat beats at its last report. A higher step
               or another phase is progress: a rank that keeps beating without it past its
               phase's learned deadline is stuck (guard/core/progress.py, RunStuck)
    trainer_detectors  true: the trainer runs the DetectorSuite in-process (guard on, or
               --no-guard observing); the collector then runs none for the run
    final      the rank's heartbeat is dropped (no HeartbeatLost for a rank that said goodbye);
               its `goodbye` sets the run's status (rank 0's, or peer_lost from any rank;
               status.py). Only a rank's own final ends its watch: a rank that goes silent with
               none is paged HeartbeatLost even when its peers ended the run (issue #37)
The listing GET /v1/runs answers is guard/wire/runs.py.

Answers: 200 {"ok": true, "duplicate": bool, "commands": [...]} once the batch is durably on
disk; 400 {"error": "..."} naming the bad field; 400 {"error": ..., "limit": {"name", "value",
"max", "flag"}} for a batch over a limit (below); 401 without the token; 409 for a batch of a
writer generation that no longer owns its (run, rank) (below); 413 for a body over
--max-body-bytes (on every endpoint: refused from its Content-Length before it is read, or at the
byte that passes the limit when it streams; guard/wire/http_limits.py); 503 with Retry-After when
the run's storage failed or the run is quarantined (retry later), 507 with Retry-After when the
disk is full. The whole batch is validated before anything is stored, so a rejected batch changes
nothing; a report's step, tokens and mem_peak_bytes are counts within Int64, and a writer's steps
strictly increase: the step it sent last, sent again, is left out (idempotent), one before it is a
400 naming it (a resumed trainer is a new generation and may re-run steps, below).

Transient is not damage: an OS error that says nothing about a run's content (EMFILE, ENOSPC,
EDQUOT, EFBIG, EIO, ENOMEM, ...; errors.py) answers 503/507 and quarantines nothing; a run whose
checkpoint failed that way is recovered from its log by the checkpointer as soon as its storage
works again, with or without a request. Only content that does not parse is quarantined.

Clocks: the collector's own clock decides liveness (a beat's arrival), the log's replay (the time
its segment was written, never the trainer's heartbeat time) and goodput's wall span. A trainer's
times are data: a beat or report time more than MAX_CLOCK_AHEAD_S (60 s) ahead of the collector's
clock is clamped to it (logged once per rank), and a writer generation ahead of the collector's
clock by more than that may not take a rank over from the generation writing it (409 naming the
skew): a clock running ahead would otherwise own the run until it caught up.

Connections (guard/wire/conn_guard.py, set up in main.py): the open-files soft limit is raised at
start to what --rank-capacity ranks need, up to the hard limit (guard/wire/open_files.py; a short
hard limit is one warning naming the ranks it covers); connections are capped at what the limit
leaves after the runs' files, half of the cap kept for connections that sent the bearer token; a request
head must arrive within --header-timeout; keep-alive is 75 s, above a step; repeated warnings are
counted, not written (lograte.py).

All or nothing: a batch is stored when its log record is fdatasync'd (the commit point), and
only then applied in memory; an I/O error before that answers 503 with nothing applied, so the
retry stores it once. meta.json is derived state: written after the commit (and, if that
fails, again before the next checkpoint lets the log go), never a reason to answer an error for
a batch that is already in the log. A failed append is cut off the log, so a torn record never
hides the records after it.

Idempotence: a batch whose seq is <= the high-water mark of its (run, rank) answers
200 {"duplicate": true} and stores nothing. The marks are in the write-ahead log and in
runs/<run>/.collector/state.json, so a restarted collector still dedupes.

Counters (guard actions, verdicts, suspected hardware faults, tokens, non-finite steps) are
in state.json too, as of each checkpoint, and the log replayed after it adds its batches once:
a restart neither resets them nor counts anything twice. A state.json without them (a folder
taken over, or written by an older collector) gets guard actions and verdicts counted from the
run store at start-up.

Durability: rank 0's reports, and every batch's events, meta and command acks, are appended to
a per-run write-ahead log (runs/<run>/.collector/wal-*.log, fdatasync'd) before the 200. Every
--checkpoint-interval seconds the pending rows go to Parquet parts in the run store's own format
(runs/<run>/<table>/part-<first step>-<seq>.parquet, written by guard/store/writer.py) and
state.json is replaced: that rename is
the commit; the log segments it covers are then deleted. On start, parts newer than the commit
are deleted and the log is replayed, so a SIGKILL at any point loses nothing that was answered
200 and stores nothing twice. Other ranks' reports feed heartbeats and per-rank timing only.

Writers and generations: each (run, rank) is written by one exporter generation at a time
(seq >> 32). A batch of a newer generation takes over (a restarted trainer); from then on the
older generation's batches answer 409 {"error": ..., "conflict": {...}} (a second trainer on the
same run id, or one that was superseded), except retries of batches it had stored before, which
stay duplicates (the last seq of each of the last 16 superseded generations is kept). A batch
whose generation is more than an hour ahead of the collector's clock is a 400: it would own the
run until the clock caught up (seq = 2**63 - 1 would block it for good); one ahead by more than 60 s
may not take a rank over from another generation (Clocks, above).

Resumed trainers: when rank 0 starts a new generation whose first step is not after the last
stored step, the steps it re-runs carry new data, so everything stored after `first step - 1`
is moved out of the live tables, as the trainer drops it locally: into
runs/<run>/.collector/superseded/<seq>/<table>/ (same layout, readable with read_table), never
deleted, since a newer generation may also be a writer that should not have been there.
"New generation" compares with the generation of rank 0's last batch WITH reports, so a
heartbeat the restarted exporter sends before its first step does not hide the restart.

Halted runs: a halt event (kind "halt", or an action event with action "halt") latches
moeguard_run_halted{run} = 1 and the run's status "halted" in meta.json. The run un-halts on a
"resume" event, or when rank 0 sends reports of a new generation (the trainer was restarted with
--resume; the collector then records a resume event itself, detail.source = "collector"), so
RunHalted resolves and a later halt pages again. After a collector restart the latch is rebuilt
from meta.json and the events (a halt at or after the last resume). With --alertmanager-url, the
halt, and the other critical guard alerts (guard/core/paging.py), are also posted straight to every
Alertmanager in the background (guard/collector/paging.py) once durable, labelled as the RunHalted
rule's alert: the page goes out in seconds and Alertmanager holds one alert for both sources.

Limits (guard/core/limits.py; flags --max-hot-runs, --max-ranks, --max-layers, --max-detectors,
--max-series-per-run): a batch with a rank >= max_ranks, a report with more than max_layers layer
ids or a layer id >= max_layers, or events that would give the run more than max_detectors
distinct detector names is refused whole (400, the limit named, counted in
moeguard_collector_limit_refusals_total{limit}); never truncated. The log replay applies no
limit, so lowering one never drops a batch that was acknowledged. /metrics series of one run
past max_series_per_run are left out and counted in moeguard_collector_series_dropped{run}.

Memory: at most max_hot_runs runs are held in full; the least recently used beyond that are
checkpointed and evicted (moeguard_collector_run_evictions_total) and reload from disk on their
next request, dedupe marks, generations, commands and the halt latch intact. While evicted a run
keeps a compact record in the metrics (counters, halt latch, heartbeats, the last step's
scalars), so RunHalted and HeartbeatLost still work; its per-layer series and expert-share
histograms go until it reports again, and its server-side detectors warm up again (as after a
restart).

Start-up: the collector listens first, then scans the run folders in the background
(meta.json and state.json only, the same damage checks as a full load; a run with log records
to replay is loaded, and checkpointed, in full). A request for a run the scan has not reached
loads it on the spot. /healthz says how many folders are left (pending_load).

A /metrics scrape never blocks ingest: runs are copied one at a time under the metrics lock and
rendered after it is released (guard/collector/metrics.py).

Server-side detectors: the detectors of one guard engine (guard/core/engine.py) per run see
every rank-0 report, for runs that only stream telemetry (a run whose batches say
trainer_detectors=true has its own verdicts, and the collector skips the duplicate work from then on). Rule against duplicate events: a collector verdict for
step S is written as an event (detail.source = "collector", action "none") only when the batch
that carried step S had no verdict, action or halt event for S from the trainer (the exporter
ships a step's events with its report). Detector state is not persisted: after a collector
restart the detectors warm up again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from guard.collector.book import HealthBook
from guard.collector.config import PAGING_STATE_FILE, STATE_DIR, CollectorConfig
from guard.collector.errors import (
    RETRY_AFTER_S,
    GenerationConflict,
    RunDamaged,
    RunEvicted,
    RunQuarantined,
    StorageBusy,
    StorageFailed,
    busy_or_none,
)
from guard.collector.metrics import CollectorMetrics
from guard.collector.paging import AlertmanagerNotifier
from guard.collector.run import RunState
from guard.collector.startup import load_all, quarantine
from guard.collector.storage import restore_health
from guard.core import schema
from guard.core.limits import FLAGS as LIMIT_FLAGS
from guard.core.limits import LimitExceeded
from guard.store.reader import read_meta
from guard.wire.batch import BadRequest, check_generation, parse_batch
from guard.wire.runs import RankListing, RunListing

log = logging.getLogger("moeguard.collector")


class Collector:
    """All runs, their health and the background checkpointer; no HTTP (app.py).

    Memory: at most cfg.limits.max_hot_runs runs are held in full (`runs`); the least recently
    used beyond that are checkpointed and evicted by a background thread, keeping a compact
    record in the HealthBook (alerts keep working), and load again on their next request.
    Start-up: `start(background=True)` returns at once and a background thread scans the run
    folders (meta.json and state.json only; a run with log records to replay loads in full);
    a request for a run not scanned yet loads it on the spot."""

    def __init__(self, cfg: CollectorConfig, health: HealthBook | None = None) -> None:
        self.cfg = cfg
        self.health = health or HealthBook(heartbeat=cfg.heartbeat, progress=cfg.progress)
        self.runs: dict[str, RunState] = {}
        self.quarantined: dict[str, str] = {}  # run -> why it was not loaded
        self.runs_lock = threading.Lock()
        self.stop_event = threading.Event()
        self._evict_wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self.started = False
        self.pending_load = 0  # run folders the start-up scan has not read yet
        self.loaded = threading.Event()  # the start-up scan is done
        self.notifier = (
            AlertmanagerNotifier(
                cfg.alertmanager_urls,
                self.health,
                labels=cfg.alert_labels,
                resend_s=cfg.alert_resend_s,
                resolve_delay_s=cfg.alert_resolve_delay_s,
                state=cfg.runs_dir / PAGING_STATE_FILE,
            )
            if cfg.alertmanager_urls
            else None
        )
        self.metrics = CollectorMetrics(
            self.health,
            limits=cfg.limits,
            hot_runs=lambda: len(self.runs),
            pending_load=lambda: self.pending_load,
            quarantined=lambda: len(self.quarantined),
        )
        cfg.runs_dir.mkdir(parents=True, exist_ok=True)

    def start(self, background: bool = False) -> None:
        """Start checkpointing and eviction, and scan the runs this collector wrote before (in a
        background thread with `background`, so the service can listen first). A run that cannot
        be recovered is quarantined (startup.py); the others serve."""
        self.started = True
        if self.notifier is not None:
            self.notifier.start()
        for target, name in ((self._checkpointer, "moeguard-checkpoint"), (self._evictor, "moeguard-evict")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self.pending_load = 1  # until the folder listing is done
        if background:
            t = threading.Thread(target=load_all, args=(self,), name="moeguard-load", daemon=True)
            t.start()
            self._threads.append(t)
        else:
            load_all(self)

    def close(self) -> None:
        self.stop_event.set()
        self._evict_wake.set()
        for t in self._threads:
            t.join(timeout=30)
        for rs in list(self.runs.values()):
            try:
                rs.close()
            except Exception:
                log.exception("run %s: final checkpoint failed", rs.run)
        if self.notifier is not None:
            self.notifier.close(timeout=5)

    def _checkpointer(self) -> None:
        while not self.stop_event.wait(self.cfg.checkpoint_interval_s):
            for rs in list(self.runs.values()):
                if rs.failed is not None:  # recovered by itself once its storage works again
                    with self.runs_lock:
                        if self.runs.get(rs.run) is rs:
                            self._reload_failed(rs)
                    continue
                try:
                    rs.checkpoint()
                except Exception:
                    pass  # logged by checkpoint(); the run now answers 503

    def _evictor(self) -> None:
        while not self.stop_event.is_set():
            self._evict_wake.wait(self.cfg.checkpoint_interval_s)
            self._evict_wake.clear()
            if not self.stop_event.is_set():
                self.evict_idle()

    def evict_idle(self) -> int:
        """Evict the least recently used runs beyond max_hot_runs; returns how many went."""
        over = len(self.runs) - self.cfg.limits.max_hot_runs
        if over <= 0:
            return 0
        n = 0
        for rs in sorted(list(self.runs.values()), key=lambda r: r.last_touch)[:over]:
            if not rs.evict():
                continue
            with self.runs_lock:
                if self.runs.get(rs.run) is rs:
                    del self.runs[rs.run]
                    self.health.compact(rs.run, rs.last_step if rs.last_step >= 0 else None)
                    n += 1
        return n

    def run_state(self, run: str) -> RunState:
        """The run's state, loaded (recovered) on first use or after an eviction. Raises
        RunQuarantined for a run whose files are damaged, StorageFailed when its folder cannot
        be set up right now."""
        rs = self.runs.get(run)
        if rs is not None and not rs.evicted and rs.failed is None:
            rs.last_touch = time.monotonic()
            return rs
        with self.runs_lock:
            rs = self.runs.get(run)
            if rs is not None and rs.failed is not None:
                return self._reload_failed(rs)
            if rs is not None and not rs.evicted:
                return rs
            why = self.quarantined.get(run)
            if why is not None:
                raise RunQuarantined(run, why)
            existed = os.path.lexists(self.cfg.runs_dir / run / STATE_DIR)  # a run this collector wrote
            try:
                rs = RunState(run, self.cfg.runs_dir / run, self.cfg, self.health, self.notifier)
            except RunDamaged as e:
                raise quarantine(self, run, str(e)) from e
            except Exception as e:
                # Out of descriptors, a full disk, EIO: nothing is wrong with the run; 503/507, and
                # its next request (or the checkpointer) tries again. Only content is damage.
                busy = busy_or_none(run, "cannot load it now", e)
                if busy is not None:
                    log.warning("%s", busy)
                    raise busy from e
                if isinstance(e, OSError) and not existed:
                    raise StorageFailed(f"run {run}: cannot set up its folder: {e!r}") from e
                if not isinstance(e, OSError):  # a bug or a shape of damage nobody foresaw: one run, not all
                    log.exception("run %s: recovery failed", run)
                raise quarantine(self, run, f"recovery failed: {e!r}") from e
            self.health.ensure_run(run)
            if rs.meta:
                self.health.set_meta(run, rs.meta)
            if not self.health.is_complete(run):  # an evicted run's record is complete already
                restore_health(self.health, run, rs.dir, rs.meta or {})
                self.health.mark_complete(run)
            self.runs[run] = rs
            if len(self.runs) > self.cfg.limits.max_hot_runs:
                self._evict_wake.set()
            return rs

    def _reload_failed(self, old: RunState) -> RunState:
        """A run whose storage failed (a checkpoint that hit an I/O error) is recovered from disk
        as a restart would (its write-ahead log holds every acknowledged batch) once its folder
        works again: a brief I/O error must not block the run until the collector restarts.
        While the folder still fails, the failed state stays and answers 503. Caller holds
        runs_lock."""
        if time.monotonic() - old.failed_at < self.cfg.checkpoint_interval_s / 4:
            return old  # at most a few reload attempts per checkpoint interval
        old.failed_at = time.monotonic()
        try:
            fresh = RunState(old.run, old.dir, self.cfg, self.health, self.notifier)
        except Exception as e:  # still failing (or worse): keep answering 503, try again later
            log.warning("run %s: storage still failing (%r); retrying later", old.run, e)
            return old
        old.journal.close()
        self.runs[old.run] = fresh
        log.warning("run %s: recovered from its write-ahead log after a storage failure", old.run)
        return fresh

    # ---- request handlers (synchronous; called from a worker thread) ------------------
    def ingest(self, body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            batch = parse_batch(body, self.cfg.limits)
        except BadRequest as e:
            self.health.batch("bad_request")
            return 400, {"error": str(e)}
        except LimitExceeded as e:
            return self._over_limit(e)
        try:
            check_generation(batch, time.time())
        except BadRequest as e:
            self.health.batch("bad_request")
            return 400, {"error": str(e)}
        try:
            ans = self.with_run(batch.run, lambda rs: rs.ingest(batch, body))
        except LimitExceeded as e:
            return self._over_limit(e)
        except BadRequest as e:  # what the run already holds makes it wrong (a step going back)
            self.health.batch("bad_request")
            return 400, {"error": str(e)}
        except GenerationConflict as e:
            self.health.batch("conflict")
            return 409, {
                "error": str(e),
                "conflict": {
                    "run": e.run,
                    "rank": e.rank,
                    "generation": e.generation,
                    "current_generation": e.current,
                },
            }
        except RunQuarantined as e:
            self.health.batch("quarantined")
            return 503, {"error": str(e)}
        except StorageBusy as e:
            self.health.batch("unavailable")
            return e.status, {"error": str(e), "retry_after_s": RETRY_AFTER_S}
        except StorageFailed as e:
            self.health.batch("unavailable")
            return 503, {"error": str(e)}
        self.health.batch("duplicate" if ans["duplicate"] else "ok")
        return 200, ans

    def with_run(self, run: str, fn: Callable[[RunState], Any]) -> Any:
        """fn(the run's state), again with a fresh state if it was evicted in between."""
        while True:
            try:
                return fn(self.run_state(run))
            except RunEvicted:
                continue

    def _over_limit(self, e: LimitExceeded) -> tuple[int, dict[str, Any]]:
        self.health.refused(e.limit)
        return 400, {
            "error": str(e),
            "limit": {"name": e.limit, "value": e.value, "max": e.maximum, "flag": LIMIT_FLAGS[e.limit]},
        }

    def list_runs(self) -> list[RunListing]:
        """Every run this collector knows or has a folder of (GET /v1/runs, guard/wire/runs.py)."""
        now = time.time()
        names = (
            set(self.runs)
            | set(self.quarantined)
            | {d.name for d in self.cfg.runs_dir.iterdir() if d.is_dir() and (d / schema.META_FILE).is_file()}
        )
        out = []
        for run in sorted(names):
            rs = self.runs.get(run)
            meta = (rs.meta if rs is not None else read_meta(self.cfg.runs_dir / run)) or {}
            status = meta.get("status", schema.STATUS_RUNNING)
            if run in self.quarantined:
                out.append(RunListing(run=run, status=status, quarantined=self.quarantined[run]))
                continue
            ranks = {k: RankListing(**v) for k, v in self.health.rank_status(run, now).items()}
            if self.health.is_halted(run):
                status = schema.STATUS_HALTED
            elif status == schema.STATUS_RUNNING and self.health.all_lost(run, now):
                status = schema.STATUS_STALE
            last = self.health.last_step(run)
            if last is None and rs is not None and rs.last_step >= 0:
                last = rs.last_step
            out.append(
                RunListing(
                    run=run, status=status, last_step=last, ranks=ranks, hot=rs is not None and not rs.evicted
                )
            )
        return out
