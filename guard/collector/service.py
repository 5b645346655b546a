"""`moeguard collector`: the HTTP service trainers stream telemetry to.

    MOEGUARD_TOKEN=... moeguard collector --host 127.0.0.1 --port 9090 --runs runs/

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
    final      the rank's heartbeat is dropped (no HeartbeatLost for a run that ended), and
               rank 0's final sets the run's status to finished (halted if it halted)
The listing GET /v1/runs answers is guard/wire/runs.py.

Answers: 200 {"ok": true, "duplicate": bool, "commands": [...]} once the batch is durably on
disk; 400 {"error": "..."} naming the bad field; 400 {"error": ..., "limit": {"name", "value",
"max", "flag"}} for a batch over a limit (below); 401 without the token; 409 for a batch of a
writer generation that no longer owns its (run, rank) (below); 413 for a body over
--max-body-bytes (on every endpoint: refused from its Content-Length before it is read, or at the
byte that passes the limit when it streams; guard/wire/http_limits.py); 503 when the run's storage
failed or the run is quarantined (retry later). The whole batch is validated before anything is
stored, so a rejected batch changes nothing.

All or nothing: a batch is stored when its log record is fdatasync'd (the commit point), and
only then applied in memory; an I/O error before that answers 503 with nothing applied, so the
retry stores it once. meta.json is derived state: written after the commit (and, if that
fails, again before the next checkpoint lets the log go), never a reason to answer an error for
a batch that is already in the log. A failed append is cut off the log, so a torn record never
hides the records after it.

Idempotence: a batch whose seq is <= the high-water mark of its (run, rank) answers
200 {"duplicate": true} and stores nothing. The marks are in the write-ahead log and in
runs/<run>/.collector/state.json, so a restarted collector still dedupes.

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
run until the clock caught up (seq = 2**63 - 1 would block it for good).

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
from meta.json and the events (a halt at or after the last resume). With --pager-url, each halt
event is also posted to `moeguard pager` /v1/events in the background (guard/pager/notify.py) once it
is durable, so the page goes out in seconds; the pager files it under the RunHalted incident.

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

import argparse
import errno
import hmac
import json
import logging
import os
import re
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from prometheus_client.core import GaugeMetricFamily, Metric

from guard.collector.metrics import CollectorMetrics
from guard.core import schema
from guard.core.config import GuardConfig, load_guard_config
from guard.core.engine import Engine
from guard.core.events import Event
from guard.core.heartbeat import PHASE_TRAIN, PHASES, HeartbeatConfig
from guard.core.limits import FLAGS as LIMIT_FLAGS
from guard.core.limits import CollectorLimits, LimitExceeded, check_detectors
from guard.core.progress import ProgressConfig
from guard.core.report import StepReport
from guard.pager.notify import PagerNotifier
from guard.store.layout import atomic_write_bytes, fsync_dir, next_part_seq, parse_part_name, part_files
from guard.store.reader import last_step as scan_last_step
from guard.store.reader import read_meta, scan_table
from guard.store.writer import event_frame, report_frames, truncate_after, write_parts
from guard.wire.batch import (
    MAX_RANK,
    BadRequest,
    Batch,
    check_generation,
    dumps,
    generation_of,
    loads,
    parse_batch,
    parse_int,
    valid_run_id,
)
from guard.wire.http_limits import BodyLimit, BodyTooLarge
from guard.wire.listen import bind_tcp
from guard.wire.runs import RankListing, RunListing, runs_body

log = logging.getLogger("moeguard.collector")

COMMAND_ACTIONS = (schema.ACT_ROLLBACK, schema.ACT_HALT, schema.ACT_SKIP)
STATE_DIR = ".collector"
_REC_HDR = struct.Struct("<II")  # length, crc32
_WAL_RE = re.compile(r"^wal-(\d{10})\.log$")
SUPERSEDED_DIR = "superseded"  # in STATE_DIR: rows a new generation re-ran, kept
RETIRED_GENERATIONS = 16  # superseded generations per rank whose late retries still dedupe
SWITCH_INTERVAL_S = 0.001  # see run()
STATE_FILE, COMMANDS_FILE, QUARANTINE_FILE = "state.json", "commands.json", "quarantine.json"
M_QUARANTINED_RUNS = schema.M_QUARANTINED_RUNS  # runs refused at start-up or load (damaged files)


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class CollectorConfig:
    runs_dir: Path
    token: str | None  # None: no auth (only with --insecure-no-auth)
    max_body_bytes: int = 8 << 20
    checkpoint_interval_s: float = 1.0
    guard: GuardConfig | None = field(default_factory=GuardConfig)  # None: no server-side detectors
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)  # RunStuck deadlines
    pager_url: str | None = None  # `moeguard pager` base URL: halt events are posted to its /v1/events
    pager_token: str | None = None  # its bearer token (MOEGUARD_PAGER_TOKEN), if it wants one
    limits: CollectorLimits = field(default_factory=CollectorLimits)  # guard/core/limits.py

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes = {self.max_body_bytes}: must be >= 1024")
        if not self.checkpoint_interval_s > 0:
            raise ValueError(f"checkpoint_interval_s = {self.checkpoint_interval_s}: must be > 0")
        if self.pager_url is not None and not self.pager_url.startswith(("http://", "https://")):
            raise ValueError(f"pager_url = {self.pager_url!r}: must be an http(s) URL")


# ---------------------------------------------------------------------------------------
# Write-ahead log: length + crc framed records in numbered segments
# ---------------------------------------------------------------------------------------
class Wal:
    def __init__(self, d: Path) -> None:
        self.dir = d
        self._warned: set[str] = set()
        self.cur = max(self.segments(), default=0) + 1
        self._fd: int | None = None
        self._size = 0  # bytes of whole records in the open segment
        self._dir_synced = False  # the open segment's directory entry is durable

    def _path(self, seg: int) -> Path:
        return self.dir / f"wal-{seg:010d}.log"

    def segments(self) -> list[int]:
        """Segment numbers on disk; anything else in the folder (a stray `wal-abc.log`) is
        not ours: left alone, named once in the log, never parsed."""
        out = []
        for p in self.dir.glob("wal-*.log"):
            m = _WAL_RE.match(p.name)
            if m is not None:
                out.append(int(m.group(1)))
            elif p.name not in self._warned:
                self._warned.add(p.name)
                log.warning("%s: %s is not a log segment of this collector; ignored", self.dir, p.name)
        return sorted(out)

    def append(self, rec: bytes) -> None:
        """Append one record, durably (data and, for a new segment, its directory entry), or
        raise with the segment as it was: a failed append never leaves a torn record that would
        hide the records appended after it."""
        data = _REC_HDR.pack(len(rec), zlib.crc32(rec)) + rec
        if self._fd is None:
            self._fd = os.open(self._path(self.cur), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._size, self._dir_synced = os.fstat(self._fd).st_size, False
        try:
            if os.write(self._fd, data) != len(data):
                raise OSError(errno.EIO, "short write to the write-ahead log")
            os.fdatasync(self._fd)
            if not self._dir_synced:  # a new segment's name must survive a power loss too
                fsync_dir(self.dir)
                self._dir_synced = True
        except BaseException:
            self._undo()
            raise
        self._size += len(data)

    def _undo(self) -> None:
        """Cut the segment back to its last whole record; failing that, end it there (a reader
        stops at the torn tail of a segment and goes on with the next one)."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self._size)
            os.fdatasync(self._fd)
        except OSError:
            log.warning("wal %s: could not cut a failed append; starting a new segment", self._path(self.cur))
            self.rotate()

    def rotate(self) -> int:
        """Close the segment being written; returns the last segment holding records."""
        if self._fd is None:
            return self.cur - 1
        os.close(self._fd)
        self._fd = None
        self.cur += 1
        return self.cur - 1

    def read(self, seg: int) -> Iterator[bytes]:
        """Records of a segment; stops at a torn or corrupt tail (never acknowledged)."""
        data = self._path(seg).read_bytes()
        off = 0
        while off + _REC_HDR.size <= len(data):
            n, crc = _REC_HDR.unpack_from(data, off)
            rec = data[off + _REC_HDR.size : off + _REC_HDR.size + n]
            if len(rec) != n or zlib.crc32(rec) != crc:
                log.warning("wal %s: torn record at byte %d ignored", self._path(seg), off)
                return
            yield rec
            off += _REC_HDR.size + n

    def delete_upto(self, seg: int) -> None:
        for s in self.segments():
            if s <= seg and s != self.cur:
                self._path(s).unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _part_seq(p: Path) -> int:
    pn = parse_part_name(p.name)
    return pn.seq if pn is not None else -1


# ---------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Snapshot:
    segment: int
    reports: list[StepReport]
    events: list[dict[str, Any]]
    state: dict[str, Any]


class RunState:
    """A run's dedupe marks, pending rows, log and detectors. `lock` guards memory;
    `ckpt_lock` serialises checkpoints and truncations (taken before `lock`)."""

    def __init__(
        self,
        run: str,
        run_dir: Path,
        cfg: CollectorConfig,
        metrics: CollectorMetrics,
        notifier: PagerNotifier | None = None,
    ) -> None:
        self.run, self.dir, self.cfg, self.metrics, self.notifier = run, run_dir, cfg, metrics, notifier
        self.lock = threading.Lock()
        self.ckpt_lock = threading.Lock()
        self.evicted = False  # set under both locks; a request that finds it set goes to the collector again
        self.last_touch = time.monotonic()  # LRU order for eviction
        self.state_dir = run_dir / STATE_DIR
        check_run_layout(run_dir)  # raises RunDamaged before anything is created or changed
        for t in schema.TABLES:
            (run_dir / t).mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(exist_ok=True)
        self.hwm: dict[int, int] = {}
        self.retired: dict[int, dict[int, int]] = {}  # rank -> superseded generation -> its last seq
        self.writers: dict[int, str] = {}  # rank -> writer id of the generation that owns it
        self._conflicts_logged: set[tuple[int, int]] = set()
        self.acks: dict[int, int] = {}
        self.last_step = -1  # last rank-0 step stored or pending
        self.report_gen = -1  # generation of rank 0's last batch with reports (restart detection)
        self.status: str | None = None  # the run's status in meta.json, as this collector last set it
        self.meta: dict[str, Any] | None = None  # meta.json as it is (or is about to be) on disk
        self.meta_dirty = False  # self.meta differs from the file: written after ingest, or at checkpoint
        self.pending_reports: list[StepReport] = []
        self.pending_events: list[dict[str, Any]] = []
        self.dirty = False
        self.failed: BaseException | None = None
        self.detectors = _make_detectors(cfg.guard)
        self.trainer_detectors = False
        self.commands: list[dict[str, Any]] = _load_commands(self.state_dir / COMMANDS_FILE)
        self.wal = Wal(self.state_dir)
        try:
            self._recover()
        except BaseException:
            self.wal.close()
            raise

    # ---- recovery ------------------------------------------------------------------
    def _recover(self) -> None:
        st = _load_json(self.state_dir / STATE_FILE, None)
        if st is None:  # first time: commit an empty state over whatever is already there
            last = scan_last_step(self.dir)
            st = {
                "segment_done": 0,
                "next_part_seq": next_part_seq(self.dir),
                "hwm": {},
                "acks": {},
                "last_step": last,
                "ranks": {},
            }
            self._commit_state(st)
        p = parse_state(st)
        self.segment_done, self.next_part, self.hwm, self.acks = p.segment_done, p.next_part, p.hwm, p.acks
        self.retired, self.writers, self.last_step, self.report_gen = (
            p.retired,
            p.writers,
            p.last_step,
            p.report_gen,
        )
        self.trainer_detectors, ranks = p.trainer_detectors, p.ranks
        self.meta = read_meta(self.dir)  # a JSON object or None: check_run_layout refused anything else
        self.status = (self.meta or {}).get("status")
        if self.trainer_detectors:
            self.detectors = None
        for rank, seen, sent, step, phase in ranks:
            self.metrics.beat(self.run, rank, seen, step, phase, sent)
        try:
            self.metrics.load_liveness_state(self.run, st.get("liveness", {}))
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # learned again from the next beats
            log.warning(
                "run %s: %s liveness state not restored (%s: %s)", self.run, STATE_FILE, type(e).__name__, e
            )
        # parts written by a checkpoint that never committed
        for t in schema.TABLES:
            for p in part_files(self.dir, t):
                if _part_seq(p) >= self.next_part:
                    log.warning("run %s: removing uncommitted part %s", self.run, p.name)
                    p.unlink()
        segs = self.wal.segments()
        self.wal.delete_upto(self.segment_done)
        n = 0
        for s in (s for s in segs if s > self.segment_done):
            for rec in self.wal.read(s):
                try:
                    batch = parse_batch(rec)
                except BadRequest as e:  # validated when logged; only a stricter new version gets here
                    log.error("run %s: logged batch no longer parses, skipped: %s", self.run, e)
                    continue
                sent = batch.heartbeat["time"] if batch.heartbeat else None
                self._ingest(batch, None, now=sent if sent is not None else time.time(), replay=True)
                n += 1
        self.wal.cur = max([*segs, self.segment_done]) + 1
        if n:
            log.info("run %s: replayed %d logged batches", self.run, n)
        self.checkpoint()

    # ---- ingest --------------------------------------------------------------------
    def ingest(self, batch: Batch, body: bytes) -> dict[str, Any]:
        """Store a batch all or nothing: once the answer says stored, the batch is in the
        fdatasync'd log and applied exactly once; on any error nothing of it is applied (503,
        and a retry stores it once). Raises StorageFailed."""
        now = time.time()
        with self.lock:
            self._usable()
            kind = self.classify(batch)
            if kind == "conflict":
                raise self._conflict(batch)
            if kind == "duplicate":
                return self._answer(batch, duplicate=True)
            self._check_limits(batch)
            if not self._needs_truncate(batch):
                self._ingest_or_fail(batch, body, now)
                return self._answer(batch, duplicate=False)
        with self.ckpt_lock, self.lock:  # rare: a resumed trainer re-runs stored steps
            self._usable()
            kind = self.classify(batch)
            if kind == "conflict":
                raise self._conflict(batch)
            if kind == "duplicate":
                return self._answer(batch, duplicate=True)
            self._ingest_or_fail(batch, body, now)
            return self._answer(batch, duplicate=False)

    def _usable(self) -> None:
        """Caller holds `lock`."""
        if self.evicted:
            raise RunEvicted(self.run)
        if self.failed is not None:
            raise StorageFailed(f"run {self.run}: storage failed: {self.failed!r}")

    def _check_limits(self, b: Batch) -> None:
        """Limits that depend on what the run holds already (guard/core/limits.py). Caller holds `lock`."""
        names = {str(e.get("detector") or "unknown") for e in b.events if e["kind"] == schema.EV_VERDICT}
        if names:
            check_detectors(self.metrics.detectors(self.run), names, self.cfg.limits)

    def evict(self) -> bool:
        """Checkpoint and let go of the run (the collector then drops it from memory); False when
        it cannot go now (new rows since the checkpoint, or its storage failed)."""
        try:
            self.checkpoint()
        except Exception:
            return False  # logged by checkpoint(); the run stays, answering 503
        with self.ckpt_lock, self.lock:
            if self.dirty or self.failed is not None or self.evicted:
                return False
            self.evicted = True
            self.wal.close()
            return True

    def _ingest_or_fail(self, b: Batch, body: bytes, now: float) -> None:
        try:
            self._ingest(b, body, now)
        except OSError as e:  # before the commit point: nothing was applied
            log.warning(
                "run %s: batch rank %d seq %d not stored (%r); the client retries", self.run, b.rank, b.seq, e
            )
            raise StorageFailed(f"run {self.run}: storage error, nothing stored, retry: {e!r}") from e

    def _is_restart(self, b: Batch) -> bool:
        """Rank 0 reports from a new trainer process (a resume or a restart) of a known run."""
        return b.rank == 0 and bool(b.reports) and 0 <= self.report_gen < b.generation

    def _needs_truncate(self, b: Batch) -> bool:
        return self._is_restart(b) and min(r.step for r in b.reports) <= self.last_step

    def _ingest(self, b: Batch, body: bytes | None, now: float, replay: bool = False) -> None:
        """Apply a validated, non-duplicate batch. Caller holds `lock` (and `ckpt_lock` when the
        batch truncates). `body` None means replay: the record is already in the log.

        Order: storage work that can fail and is safe to redo (the truncation of re-run steps),
        then the log append (the commit point), then memory only. An OSError before the commit
        leaves memory untouched; an error after it (a bug) stops the run until a restart
        replays the log, so a batch is never half-applied. meta.json is derived state: written
        after the commit, and if that fails, again at the next checkpoint."""
        if replay and self.classify(b) != "new":
            return
        first = min(r.step for r in b.reports) if self._needs_truncate(b) else None
        if first is not None:
            self._supersede(b, first)
        durable = bool(
            b.events
            or b.meta
            or (b.rank == 0 and b.reports)
            or b.final
            or (b.trainer_detectors and not self.trainer_detectors)
            or (b.commands_ack is not None and b.commands_ack > self.acks.get(b.rank, -1))
        )
        if durable and body is not None:
            self.wal.append(body)  # the commit point: the batch is durable from here on
        try:
            self._apply(b, now, first, live=body is not None)
        except BaseException as e:
            if body is None:
                raise  # replay at start: the run is quarantined
            self.failed = e
            log.exception(
                "run %s: applying a logged batch failed; run refuses ingest until restart", self.run
            )
            raise StorageFailed(f"run {self.run}: internal error after the batch was logged: {e!r}") from e
        if self.meta_dirty and not replay:
            try:
                self._write_meta()
            except OSError as e:
                log.warning("run %s: meta.json not written (%r); retried at the next checkpoint", self.run, e)

    def _supersede(self, b: Batch, first: int) -> None:
        """Before a new generation's re-run of steps >= `first` is stored: move every row after
        `first - 1` (in parts, and still pending) out of the live tables into
        .collector/superseded/<seq>/<table>/, a store of the same layout. Nothing is deleted:
        whether this was a resumed trainer or a second writer that should not have been, the
        rows it replaced can be read back. Idempotent (redone after a failure or in replay)."""
        dest = self.state_dir / SUPERSEDED_DIR / f"{b.seq:020d}"
        moved = truncate_after(self.dir, first - 1, archive_dir=dest)
        frames = report_frames([r for r in self.pending_reports if r.step >= first])
        stale_events = [e for e in self.pending_events if e["step"] >= first]
        if stale_events:
            frames[schema.TABLE_EVENTS] = event_frame(stale_events)
        write_parts(dest, frames, self.next_part)
        moved += sum(df.height for df in frames.values())
        log.warning(
            "run %s: rank 0 generation %d re-runs steps from %d; %d rows after step %d moved to %s "
            "(kept, not deleted)",
            self.run,
            b.generation,
            first,
            moved,
            first - 1,
            dest,
        )

    def classify(self, b: Batch) -> str:
        """new | duplicate | conflict, for a batch of (run, rank). A rank is written by one
        exporter generation at a time: a newer generation takes over (a restarted trainer);
        an older one's batches that were stored before are duplicates, any other is a second
        writer on this run id (or a superseded trainer) and is refused. Caller holds `lock`."""
        hwm = self.hwm.get(b.rank, -1)
        owner = self.writers.get(b.rank)
        if b.generation == generation_of(hwm) and None not in (b.writer, owner) and b.writer != owner:
            return "conflict"  # one generation, two processes (both started within the same second)
        if b.seq > hwm:
            return "new"
        if b.generation == generation_of(hwm) or b.seq <= self.retired.get(b.rank, {}).get(b.generation, -1):
            return "duplicate"
        return "conflict"

    def _conflict(self, b: Batch) -> GenerationConflict:
        current = generation_of(self.hwm[b.rank])
        key = (b.rank, b.generation)
        if key not in self._conflicts_logged and len(self._conflicts_logged) < 64:
            self._conflicts_logged.add(key)
            log.warning(
                "run %s rank %d: refusing batches of writer generation %d; generation %d writes this "
                "run now (two trainers on one run id?)",
                self.run,
                b.rank,
                b.generation,
                current,
            )
        return GenerationConflict(self.run, b.rank, b.generation, current)

    def _apply(self, b: Batch, now: float, truncated_from: int | None, live: bool) -> None:
        """The in-memory part of `_ingest` (no I/O)."""
        old = self.hwm.get(b.rank, -1)
        if old >= 0 and b.generation > generation_of(old):  # a new writer generation takes over
            gens = self.retired.setdefault(b.rank, {})
            gens[generation_of(old)] = old
            for g in sorted(gens)[:-RETIRED_GENERATIONS]:
                del gens[g]
            self.writers.pop(b.rank, None)
        self.hwm[b.rank] = b.seq
        if b.writer is not None:
            self.writers[b.rank] = b.writer
        self.dirty = True
        if truncated_from is not None:
            first = truncated_from
            self.pending_reports = [r for r in self.pending_reports if r.step < first]
            self.pending_events = [e for e in self.pending_events if e["step"] < first]
            self.last_step = first - 1
        restart = self._is_restart(b)
        if b.rank == 0 and b.reports:
            self.report_gen = max(self.report_gen, b.generation)
        if b.trainer_detectors and not self.trainer_detectors:
            self.trainer_detectors, self.detectors = True, None
        m = self.metrics
        was_halted, was_status = m.is_halted(self.run), self.status
        if b.meta:
            meta = {
                **(self.meta or {}),
                **b.meta,
                "schema_version": schema.SCHEMA_VERSION,
                "updated_at": time.time(),
            }
            meta.setdefault("run_id", self.run)
            self._set_meta(meta)
            m.set_meta(self.run, meta)
            self.status = meta.get("status", self.status)
        elif b.reports and self.meta is None:
            self._set_meta(self._minimal_meta())
            self.status = schema.STATUS_RUNNING
        trainer_steps = {
            e["step"] for e in b.events if e["kind"] in (schema.EV_VERDICT, schema.EV_ACTION, schema.EV_HALT)
        }
        server_events: list[dict[str, Any]] = []
        for rep in b.reports:
            m.observe_report(self.run, rep)
            if b.rank != 0:
                continue
            self.pending_reports.append(rep)
            self.last_step = max(self.last_step, rep.step)
            for v in self._detect(rep):
                if rep.step in trainer_steps:
                    continue
                ev = Event.from_verdict(rep.step, v, schema.ACT_NONE)
                ev.detail["source"] = "collector"
                ev.time = rep.time
                server_events.append(ev.row())
        # Not a meta "running": a halted trainer still sends meta snapshots from its own store
        # (checkpoint time) that say running; only a new process that trains again resumes.
        resumed = restart
        events = self._resume_event(b) if was_halted and resumed else []
        events += b.events + server_events
        if events:
            self.pending_events.extend(events)
            m.observe_events(self.run, events)
        self._update_status(b, was_halted, was_status, resumed)
        if self.status not in ENDED:  # an ended run has no liveness to watch
            hb = b.heartbeat
            if hb is not None:
                m.beat(self.run, b.rank, now, hb["step"], hb["phase"], hb["time"], b.generation)
            elif b.reports:
                last = max(b.reports, key=lambda r: r.step)
                m.beat(self.run, b.rank, now, last.step, PHASE_TRAIN, last.time, b.generation)
        if b.final:
            m.end_heartbeats(self.run, b.rank)
        if self.notifier is not None and live:  # durable now; a replay never re-pages
            for ev in b.events:
                if is_halt(ev):
                    self.notifier.submit(self.run, ev)
        if b.commands_ack is not None:
            self.acks[b.rank] = max(self.acks.get(b.rank, -1), b.commands_ack)

    def _detect(self, rep: StepReport) -> list[Any]:
        if self.detectors is None:
            return []
        try:
            return self.detectors.verdicts(rep)
        except Exception:  # a detector bug must not take ingest down
            log.exception("run %s: server-side detectors failed; disabled for this run", self.run)
            self.detectors = None
            return []

    def _resume_event(self, b: Batch) -> list[dict[str, Any]]:
        """The resume event the collector records for a halted run that trains again, unless the
        batch carries the trainer's own."""
        if any(e["kind"] == schema.EV_RESUME for e in b.events):
            return []
        first = min(b.reports, key=lambda r: r.step)
        ev = Event(
            step=first.step,
            kind=schema.EV_RESUME,
            detail={"source": "collector", "after": schema.STATUS_HALTED, "generation": b.generation},
        )
        ev.time = first.time
        return [ev.row()]

    def _update_status(self, b: Batch, was_halted: bool, was_status: str | None, resumed: bool) -> None:
        """Keep meta.json's status in step with what the batch says: halted (a halt event),
        running again (a resume), finished (rank 0's final batch, or the trainer's own meta).
        Written only on a change; an ended run stops being watched for heartbeats."""
        halted = self.metrics.is_halted(self.run)
        status = self.status
        if halted:
            status = schema.STATUS_HALTED
        elif was_halted or (resumed and status in ENDED):
            status = schema.STATUS_RUNNING
        if b.final and b.rank == 0 and not halted:
            status = schema.STATUS_FINISHED
        if status in ENDED and was_status not in ENDED:
            self.metrics.end_heartbeats(self.run)  # every rank: the run is over
        if status != self.status and status is not None:
            self._set_meta(
                {**(self.meta or self._minimal_meta()), "status": status, "updated_at": time.time()}
            )
            self.status = status

    def _minimal_meta(self) -> dict[str, Any]:
        return {
            "run_id": self.run,
            "status": schema.STATUS_RUNNING,
            "source": "collector",
            "schema_version": schema.SCHEMA_VERSION,
            "updated_at": time.time(),
        }

    def _set_meta(self, meta: dict[str, Any]) -> None:
        self.meta, self.meta_dirty = meta, True

    def _write_meta(self) -> None:
        """Write meta.json from memory. Caller holds `lock`."""
        if self.meta is not None:
            atomic_write_bytes(
                self.dir / schema.META_FILE,
                json.dumps(self.meta, indent=2, sort_keys=True, default=str).encode(),
            )
        self.meta_dirty = False

    def _answer(self, b: Batch, duplicate: bool) -> dict[str, Any]:
        return {"ok": True, "duplicate": duplicate, "commands": self._pending_commands(b.rank, None)}

    # ---- commands ------------------------------------------------------------------
    def _pending_commands(self, rank: int, after: int | None) -> list[dict[str, Any]]:
        after = self.acks.get(rank, -1) if after is None else after
        return [c for c in self.commands if c["id"] > after and c.get("rank") in (None, rank)]

    def pending_commands(self, rank: int, after: int | None) -> list[dict[str, Any]]:
        with self.lock:
            return self._pending_commands(rank, after)

    def add_command(self, action: str, reason: str, rank: int | None) -> dict[str, Any]:
        with self.lock:
            if self.evicted:
                raise RunEvicted(self.run)
            cmd = {
                "id": max((c["id"] for c in self.commands), default=0) + 1,
                "action": action,
                "reason": reason,
                "rank": rank,
                "time": time.time(),
            }
            cmds = [*self.commands, cmd]
            atomic_write_bytes(self.state_dir / "commands.json", json.dumps(cmds).encode())
            self.commands = cmds
            return cmd

    # ---- checkpoint ----------------------------------------------------------------
    def checkpoint(self) -> None:
        """Move pending rows to Parquet and commit; the log up to here is then deleted."""
        with self.ckpt_lock:
            with self.lock:
                if not self.dirty or self.failed is not None:
                    return
                if self.meta_dirty:
                    try:  # before the commit below deletes the log that holds the batches it came from
                        self._write_meta()
                    except OSError as e:
                        log.warning("run %s: meta.json not written (%r); checkpoint postponed", self.run, e)
                        return
                snap = _Snapshot(
                    segment=self.wal.rotate(),
                    reports=self.pending_reports,
                    events=self.pending_events,
                    state={
                        "hwm": dict(self.hwm),
                        "acks": dict(self.acks),
                        "last_step": self.last_step,
                        "trainer_detectors": self.trainer_detectors,
                        "report_gen": self.report_gen,
                        "retired": {
                            str(r): {str(g): v for g, v in gens.items()} for r, gens in self.retired.items()
                        },
                        "writers": {str(r): w for r, w in self.writers.items()},
                        "ranks": self._rank_beats(),
                        "liveness": self.metrics.liveness_state(self.run),
                    },
                )
                self.pending_reports, self.pending_events, self.dirty = [], [], False
            try:
                self._write(snap)
            except BaseException as e:
                # Acknowledged rows are still in the log; a restart replays them. Until then
                # this run answers 503 so exporters keep their data.
                self.failed = e
                log.exception("run %s: checkpoint failed; run refuses ingest until restart", self.run)
                raise

    def _rank_beats(self) -> dict[str, list[Any]]:
        return {str(r): v for r, v in self.metrics.beats(self.run).items()}

    def _write(self, snap: _Snapshot) -> None:
        frames = report_frames(snap.reports)
        if snap.events:
            frames[schema.TABLE_EVENTS] = event_frame(snap.events)
        seq = write_parts(self.dir, frames, self.next_part)
        st = {**snap.state, "segment_done": snap.segment, "next_part_seq": seq}
        self._commit_state(st)  # the commit point
        self.next_part, self.segment_done = seq, snap.segment
        self.wal.delete_upto(snap.segment)

    def _commit_state(self, st: dict[str, Any]) -> None:
        atomic_write_bytes(self.state_dir / "state.json", json.dumps(st, sort_keys=True).encode())
        fsync_dir(self.state_dir)

    def close(self) -> None:
        try:
            self.checkpoint()
        finally:
            self.wal.close()


class StorageFailed(RuntimeError):
    pass


class RunEvicted(Exception):
    """The RunState was evicted between the lookup and the lock; look the run up again."""


class GenerationConflict(Exception):
    """A batch from an exporter generation older than the one that writes (run, rank) now."""

    def __init__(self, run: str, rank: int, generation: int, current: int) -> None:
        since = (
            f"but generation {current} has written this run since"
            if generation != current
            else "but another process of that generation (started in the same second) writes this run"
        )
        super().__init__(
            f"run {run!r} rank {rank}: generation conflict: this batch is from writer generation {generation}, "
            f"{since}. Two trainers are writing one run id, or this trainer was superseded by a restarted one. "
            "Nothing was stored; use a different run id."
        )
        self.run, self.rank, self.generation, self.current = run, rank, generation, current


class RunQuarantined(StorageFailed):
    def __init__(self, run: str, reason: str) -> None:
        super().__init__(
            f"run {run} is quarantined (its files are damaged; repair them and restart the "
            f"collector): {reason}"
        )
        self.run, self.reason = run, reason


class _QuarantineMetrics:
    """moeguard_collector_quarantined_runs: runs refused at load because their files are damaged."""

    def __init__(self, quarantined: dict[str, str]) -> None:
        self._q = quarantined

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(M_QUARANTINED_RUNS, "runs not served because their files are damaged")]

    def collect(self) -> list[Metric]:
        g = GaugeMetricFamily(M_QUARANTINED_RUNS, "runs not served because their files are damaged")
        g.add_metric([], len(self._q))
        return [g]


ENDED = (schema.STATUS_FINISHED, schema.STATUS_HALTED)


def is_halt(ev: dict[str, Any]) -> bool:
    """A halt event, or an action event whose action is halt (both latch moeguard_run_halted)."""
    return ev["kind"] == schema.EV_HALT or (
        ev["kind"] == schema.EV_ACTION and ev.get("action") == schema.ACT_HALT
    )


class RunDamaged(Exception):
    """A run folder this collector cannot load safely; the message says what is wrong."""


def _load_json(p: Path, default: Any) -> Any:
    """A JSON file of the collector's own, `default` when absent; RunDamaged when unreadable."""
    try:
        return json.loads(p.read_bytes())
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RunDamaged(f"{p.parent.name}/{p.name}: unreadable ({type(e).__name__}: {str(e)[:120]})") from e


@dataclass(slots=True)
class _State:
    """state.json, checked (see `parse_state`)."""

    segment_done: int
    next_part: int
    hwm: dict[int, int]
    acks: dict[int, int]
    retired: dict[int, dict[int, int]]
    writers: dict[int, str]
    last_step: int
    report_gen: int
    trainer_detectors: bool
    ranks: list[tuple[int, float, float | None, int, str]]  # rank, last seen, last sent, step, phase


def parse_state(st: Any) -> _State:
    """state.json as the collector wrote it; RunDamaged naming the problem otherwise."""
    try:
        hwm = {_nonneg(int(k)): _nonneg(v) for k, v in st["hwm"].items()}
        return _State(
            segment_done=_nonneg(st["segment_done"]),
            next_part=_nonneg(st["next_part_seq"]),
            hwm=hwm,
            acks={_nonneg(int(k)): int(v) for k, v in st["acks"].items()},
            retired={
                _nonneg(int(r)): {_nonneg(int(g)): _nonneg(v) for g, v in gens.items()}
                for r, gens in st.get("retired", {}).items()
            },
            writers={_nonneg(int(r)): str(w) for r, w in st.get("writers", {}).items()},
            last_step=int(st["last_step"]),
            report_gen=int(st.get("report_gen", generation_of(hwm[0]) if 0 in hwm else -1)),
            trainer_detectors=bool(st.get("trainer_detectors", False)),
            ranks=[
                (
                    int(r),
                    float(seen),
                    sent if sent is None else float(sent),
                    int(step),
                    PHASES[PHASES.index(phase)],
                )
                for r, (seen, sent, step, phase) in st.get("ranks", {}).items()
            ],
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RunDamaged(
            f"{STATE_DIR}/{STATE_FILE}: not a state this collector wrote ({type(e).__name__}: {e})"
        ) from e


@dataclass(slots=True)
class ColdRun:
    """What the start-up scan reads of a run without loading it (meta.json and state.json)."""

    meta: dict[str, Any] | None
    beats: dict[int, list[Any]]  # rank -> [last seen, last sent, step, phase]
    last_step: int
    liveness: dict[str, Any] = field(
        default_factory=dict
    )  # learned deadlines (CollectorMetrics.liveness_state)


def scan_run(run_dir: Path) -> ColdRun | None:
    """Read a run for the start-up scan: None when it must be loaded in full now (log records
    not yet checkpointed, or no state yet); RunDamaged for what loading would quarantine. The
    same checks as a full load, minus the Parquet scans and the log replay."""
    check_run_layout(run_dir)
    state_dir = run_dir / STATE_DIR
    st = _load_json(state_dir / STATE_FILE, None)
    if st is None:
        return None
    p = parse_state(st)
    _load_commands(state_dir / COMMANDS_FILE)
    with os.scandir(state_dir) as it:
        for e in it:
            m = _WAL_RE.match(e.name)
            if m is not None and int(m.group(1)) > p.segment_done and e.stat().st_size > 0:
                return None  # batches to replay
    beats = {rank: [seen, sent, step, phase] for rank, seen, sent, step, phase in p.ranks}
    liveness = st.get("liveness")
    return ColdRun(
        meta=read_meta(run_dir),
        beats=beats,
        last_step=p.last_step,
        liveness=liveness if isinstance(liveness, dict) else {},
    )


def _nonneg(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"expected an integer >= 0, got {str(v)[:40]!r}")
    return v


def _load_commands(p: Path) -> list[dict[str, Any]]:
    cmds = _load_json(p, [])
    if not isinstance(cmds, list) or not all(
        isinstance(c, dict) and isinstance(c.get("id"), int) for c in cmds
    ):
        raise RunDamaged(f"{STATE_DIR}/{COMMANDS_FILE}: expected a list of commands with integer ids")
    return cmds


def check_run_layout(run_dir: Path) -> None:
    """Raise RunDamaged for what would make the collector fail or write over someone's data:
    a table or state path that is not a folder, a non-file named like a part, a meta.json that
    is not a JSON object. Missing pieces are fine (they are created)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDamaged(f"{run_dir.name} is not a folder")
    for name in (*schema.TABLES, STATE_DIR):
        p = run_dir / name
        if p.exists() and not p.is_dir():
            raise RunDamaged(f"{name} is not a folder")
    for t in schema.TABLES:
        d = run_dir / t
        if d.is_dir():
            with os.scandir(d) as it:
                for e in it:
                    if parse_part_name(e.name) is not None and not e.is_file():
                        raise RunDamaged(f"{t}/{e.name} is named like a part file but is not a regular file")
    meta = _load_json(run_dir / schema.META_FILE, None)
    if meta is not None and not isinstance(meta, dict):
        raise RunDamaged(f"{schema.META_FILE}: expected a JSON object, found {type(meta).__name__}")


def _make_detectors(cfg: GuardConfig | None) -> Engine | None:
    """The guard engine, of which the collector runs the detectors (no policy: it acts on nothing)."""
    return Engine(cfg) if cfg is not None else None


# ---------------------------------------------------------------------------------------
# The service
# ---------------------------------------------------------------------------------------
class Collector:
    """All runs, the metrics and the background checkpointer; no HTTP (see build_app).

    Memory: at most cfg.limits.max_hot_runs runs are held in full (`runs`); the least recently
    used beyond that are checkpointed and evicted by a background thread, keeping a compact
    record in the metrics (alerts keep working), and load again on their next request.
    Start-up: `start(background=True)` returns at once and a background thread scans the run
    folders (meta.json and state.json only; a run with log records to replay loads in full);
    a request for a run not scanned yet loads it on the spot."""

    def __init__(self, cfg: CollectorConfig, metrics: CollectorMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or CollectorMetrics(
            heartbeat=cfg.heartbeat, limits=cfg.limits, progress=cfg.progress
        )
        self.runs: dict[str, RunState] = {}
        self.quarantined: dict[str, str] = {}  # run -> why it was not loaded
        self._runs_lock = threading.Lock()
        self._stop = threading.Event()
        self._evict_wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self.started = False
        self.pending_load = 0  # run folders the start-up scan has not read yet
        self.loaded = threading.Event()  # the start-up scan is done
        self.notifier = PagerNotifier(cfg.pager_url, cfg.pager_token) if cfg.pager_url else None
        self.metrics.registry.register(_QuarantineMetrics(self.quarantined))
        self.metrics.hot_runs = lambda: len(self.runs)
        self.metrics.pending_load = lambda: self.pending_load
        cfg.runs_dir.mkdir(parents=True, exist_ok=True)

    def start(self, background: bool = False) -> None:
        """Start checkpointing and eviction, and scan the runs this collector wrote before (in a
        background thread with `background`, so the service can listen first). A run that cannot
        be recovered is quarantined (see `_quarantine`); the others serve."""
        self.started = True
        if self.notifier is not None:
            self.notifier.start()
        for target, name in ((self._checkpointer, "moeguard-checkpoint"), (self._evictor, "moeguard-evict")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self.pending_load = 1  # until the folder listing is done
        if background:
            t = threading.Thread(target=self._load_all, name="moeguard-load", daemon=True)
            t.start()
            self._threads.append(t)
        else:
            self._load_all()

    def _load_all(self) -> None:
        t0 = time.monotonic()
        try:
            with os.scandir(self.cfg.runs_dir) as it:
                names = sorted(e.name for e in it if valid_run_id(e.name) and e.is_dir())
            names = [n for n in names if os.path.lexists(self.cfg.runs_dir / n / STATE_DIR)]
        except OSError as e:
            log.error("cannot list %s: %r; runs load on their first request", self.cfg.runs_dir, e)
            names = []
        self.pending_load = len(names)
        for run in names:
            if self._stop.is_set():
                break
            try:
                self._load_one(run)
            except Exception:  # one run must not stop the scan
                log.exception("run %s: start-up scan failed; it loads on its first request", run)
            self.pending_load -= 1
        self.pending_load = 0
        self.loaded.set()
        log.info(
            "start-up scan done: %d runs in %.1f s (%d held in full, %d quarantined)",
            len(names),
            time.monotonic() - t0,
            len(self.runs),
            len(self.quarantined),
        )

    def _load_one(self, run: str) -> None:
        """Scan one run at start-up: a compact record from its JSON files, or a full load when it
        has log records to replay or its files are damaged (which quarantines it)."""
        if run in self.runs or run in self.quarantined or self.metrics.is_complete(run):
            return
        try:
            cold = scan_run(self.cfg.runs_dir / run)
        except (RunDamaged, OSError):
            cold = None  # the full load below says what is wrong, and quarantines it
        if cold is None:
            try:
                self.run_state(run)
            except StorageFailed:
                pass  # quarantined and logged by run_state
            return
        with self._runs_lock:
            if run not in self.runs and run not in self.quarantined:
                self.metrics.cold_load(
                    run, meta=cold.meta, beats=cold.beats, stored_step=cold.last_step, liveness=cold.liveness
                )

    def close(self) -> None:
        self._stop.set()
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
        while not self._stop.wait(self.cfg.checkpoint_interval_s):
            for rs in list(self.runs.values()):
                try:
                    rs.checkpoint()
                except Exception:
                    pass  # logged by checkpoint(); the run now answers 503

    def _evictor(self) -> None:
        while not self._stop.is_set():
            self._evict_wake.wait(self.cfg.checkpoint_interval_s)
            self._evict_wake.clear()
            if not self._stop.is_set():
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
            with self._runs_lock:
                if self.runs.get(rs.run) is rs:
                    del self.runs[rs.run]
                    self.metrics.compact(rs.run, rs.last_step if rs.last_step >= 0 else None)
                    n += 1
        return n

    def run_state(self, run: str) -> RunState:
        """The run's state, loaded (recovered) on first use or after an eviction. Raises
        RunQuarantined for a run whose files are damaged, StorageFailed when its folder cannot
        be set up right now."""
        rs = self.runs.get(run)
        if rs is not None and not rs.evicted:
            rs.last_touch = time.monotonic()
            return rs
        with self._runs_lock:
            rs = self.runs.get(run)
            if rs is not None and not rs.evicted:
                return rs
            why = self.quarantined.get(run)
            if why is not None:
                raise RunQuarantined(run, why)
            existed = os.path.lexists(self.cfg.runs_dir / run / STATE_DIR)  # a run this collector wrote
            try:
                rs = RunState(run, self.cfg.runs_dir / run, self.cfg, self.metrics, self.notifier)
            except RunDamaged as e:
                raise self._quarantine(run, str(e)) from e
            except OSError as e:
                if existed:
                    raise self._quarantine(run, f"recovery failed: {e!r}") from e
                raise StorageFailed(f"run {run}: cannot set up its folder: {e!r}") from e
            except Exception as e:  # a bug or a shape of damage nobody foresaw: one run, not all
                log.exception("run %s: recovery failed", run)
                raise self._quarantine(run, f"recovery failed: {e!r}") from e
            self.metrics.ensure_run(run)
            if rs.meta:
                self.metrics.set_meta(run, rs.meta)
            if not self.metrics.is_complete(run):  # an evicted run's record is complete already
                _restore_run_metrics(self.metrics, run, rs.dir, rs.meta or {})
                self.metrics.mark_complete(run)
            self.runs[run] = rs
            if len(self.runs) > self.cfg.limits.max_hot_runs:
                self._evict_wake.set()
            return rs

    def _quarantine(self, run: str, reason: str) -> RunQuarantined:
        """Keep a damaged run out of service, say so everywhere (log, metric, /v1/runs, a
        record in the run's own folder when it can be written) and touch nothing else of it.
        Its trainers get 503 and keep their batches spooled until someone repairs the folder
        and restarts the collector. Caller holds `_runs_lock`."""
        self.quarantined[run] = reason
        self.metrics.end_heartbeats(run)  # a refused run is not "lost": the quarantine alerts
        log.warning(
            "run %s: quarantined, not served until repaired and the collector restarts: %s", run, reason
        )
        state_dir = self.cfg.runs_dir / run / STATE_DIR
        if state_dir.is_dir():
            try:
                atomic_write_bytes(
                    state_dir / QUARANTINE_FILE,
                    json.dumps(
                        {"run": run, "reason": reason, "time": time.time(), "pid": os.getpid()}, indent=2
                    ).encode(),
                )
            except OSError as e:
                log.warning("run %s: could not record the quarantine in %s: %r", run, state_dir, e)
        return RunQuarantined(run, reason)

    # ---- request handlers (synchronous; called from a worker thread) ------------------
    def ingest(self, body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            batch = parse_batch(body, self.cfg.limits)
        except BadRequest as e:
            self.metrics.batch("bad_request")
            return 400, {"error": str(e)}
        except LimitExceeded as e:
            return self._over_limit(e)
        try:
            check_generation(batch, time.time())
        except BadRequest as e:
            self.metrics.batch("bad_request")
            return 400, {"error": str(e)}
        try:
            ans = self._with_run(batch.run, lambda rs: rs.ingest(batch, body))
        except LimitExceeded as e:
            return self._over_limit(e)
        except GenerationConflict as e:
            self.metrics.batch("conflict")
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
            self.metrics.batch("quarantined")
            return 503, {"error": str(e)}
        except StorageFailed as e:
            self.metrics.batch("unavailable")
            return 503, {"error": str(e)}
        self.metrics.batch("duplicate" if ans["duplicate"] else "ok")
        return 200, ans

    def _with_run(self, run: str, fn: Callable[[RunState], Any]) -> Any:
        """fn(the run's state), again with a fresh state if it was evicted in between."""
        while True:
            try:
                return fn(self.run_state(run))
            except RunEvicted:
                continue

    def _over_limit(self, e: LimitExceeded) -> tuple[int, dict[str, Any]]:
        self.metrics.refused(e.limit)
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
            ranks = {k: RankListing(**v) for k, v in self.metrics.rank_status(run, now).items()}
            if self.metrics.is_halted(run):
                status = schema.STATUS_HALTED
            elif status == schema.STATUS_RUNNING and ranks and all(r.lost for r in ranks.values()):
                status = schema.STATUS_STALE
            last = self.metrics.last_step(run)
            if last is None and rs is not None and rs.last_step >= 0:
                last = rs.last_step
            out.append(
                RunListing(
                    run=run, status=status, last_step=last, ranks=ranks, hot=rs is not None and not rs.evicted
                )
            )
        return out

    def post_command(self, run: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if not valid_run_id(run):
            return 400, {"error": f"run {run[:60]!r} is not a valid run id"}
        try:
            d = loads(body)
        except (ValueError, RecursionError, UnicodeDecodeError):
            return 400, {"error": "body is not valid JSON"}
        if not isinstance(d, dict):
            return 400, {"error": "body: expected a JSON object"}
        action, reason, rank = d.get("action"), d.get("reason", ""), d.get("rank")
        if action not in COMMAND_ACTIONS:
            return 400, {"error": f"field 'action': {str(action)[:60]!r} not one of {COMMAND_ACTIONS}"}
        if not isinstance(reason, str) or len(reason) > 2000:
            return 400, {"error": "field 'reason': expected a string (<= 2000 chars)"}
        if rank is not None:
            try:
                rank = parse_int(rank, "rank", 0, MAX_RANK)
            except BadRequest as e:
                return 400, {"error": str(e)}
        try:
            cmd = self._with_run(run, lambda rs: rs.add_command(action, reason, rank))
        except StorageFailed as e:
            return 503, {"error": str(e)}
        log.warning("run %s: operator command %s", run, cmd)
        return 200, {"ok": True, "command": cmd}

    def get_commands(self, run: str, rank: str | None, after: str | None) -> tuple[int, dict[str, Any]]:
        if not valid_run_id(run):
            return 400, {"error": f"run {run[:60]!r} is not a valid run id"}
        try:
            r = int(rank) if rank is not None else 0
            a = int(after) if after is not None else None
        except ValueError:
            return 400, {"error": "query 'rank' and 'after' must be integers"}
        rs = self.runs.get(run)
        if rs is None or rs.evicted:
            if not os.path.lexists(self.cfg.runs_dir / run / STATE_DIR):
                return 404, {"error": f"unknown run {run!r}"}
            try:
                rs = self.run_state(run)
            except StorageFailed as e:
                return 503, {"error": str(e)}
        return 200, {"commands": rs.pending_commands(r, a)}


def _restore_run_metrics(metrics: CollectorMetrics, run: str, run_dir: Path, meta: dict[str, Any]) -> None:
    """Baselines and halted flag survive a collector restart (read back from the run store).
    Halted: meta.json says so, or a halt event at or after the last resume event (run stores
    written before the collector kept meta's status)."""
    metrics.set_halted(run, meta.get("status") == schema.STATUS_HALTED)
    try:
        halt = pl.col("kind") == schema.EV_HALT
        halt = halt | ((pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_HALT))
        last_halt, last_resume = (
            scan_table(run_dir, schema.TABLE_EVENTS)
            .select(
                pl.col("step").filter(halt).max().alias("halt"),
                pl.col("step").filter(pl.col("kind") == schema.EV_RESUME).max().alias("resume"),
            )
            .collect()
            .row(0)
        )
        metrics.set_halted(
            run,
            meta.get("status") == schema.STATUS_HALTED
            or (last_halt is not None and (last_resume is None or last_halt >= last_resume)),
        )
        b = metrics.baseline
        steps = scan_table(run_dir, schema.TABLE_STEPS)
        last = steps.select(pl.col("step").max()).collect().item()
        if last is not None and last > b.end:
            w = (
                steps.filter(pl.col("step").is_between(b.start, b.end))
                .select(
                    pl.col("mfu").filter(pl.col("mfu").is_not_nan()).median(),
                    pl.col("tokens_per_s").filter(pl.col("tokens_per_s").is_not_nan()).median(),
                )
                .collect()
            )
            mfu, tps = w.row(0)
            if mfu is not None or tps is not None:
                metrics.set_baselines(run, mfu, tps)
    except Exception:
        log.exception("run %s: could not restore metrics from the run store", run)


# ---------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------
def build_app(collector: Collector) -> Any:
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    cfg = collector.cfg
    token = cfg.token.encode() if cfg.token else None

    def authorized(request: Request) -> bool:
        if token is None:
            return True
        h = request.headers.get("authorization", "")
        scheme, _, cred = h.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(cred.strip().encode(), token)

    def answer(status: int, payload: dict[str, Any]) -> Response:
        return Response(dumps(payload), status_code=status, media_type="application/json")

    async def ingest(request: Request) -> Response:
        if not authorized(request):
            collector.metrics.batch("unauthorized")
            return answer(401, {"error": "missing or wrong bearer token"})
        body = await request.body()  # bounded by BodyLimit (413 past --max-body-bytes)
        status, payload = await run_in_threadpool(collector.ingest, body)
        return answer(status, payload)

    async def runs(request: Request) -> Response:
        return answer(200, runs_body(await run_in_threadpool(collector.list_runs)))

    async def commands(request: Request) -> Response:
        run = request.path_params["run"]
        if request.method == "POST":
            if not authorized(request):
                return answer(401, {"error": "missing or wrong bearer token"})
            body = await request.body()  # bounded by BodyLimit
            return answer(*(await run_in_threadpool(collector.post_command, run, body)))
        q = request.query_params
        return answer(*(await run_in_threadpool(collector.get_commands, run, q.get("rank"), q.get("after"))))

    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await run_in_threadpool(collector.metrics.render), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse(
            {
                "ok": True,
                "runs": len(collector.runs),
                "quarantined": len(collector.quarantined),
                "known_runs": len(collector.metrics.runs()),
                "pending_load": collector.pending_load,
            }
        )

    def refused(path: str) -> None:
        if path == "/v1/ingest":
            collector.metrics.batch("too_large")

    async def body_too_large(request: Request, exc: Exception) -> Response:
        return answer(413, {"error": str(exc)})

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        if not collector.started:  # `moeguard collector`: scan the runs while already listening
            collector.start(background=True)
        yield
        await run_in_threadpool(collector.close)

    return Starlette(
        routes=[
            Route("/v1/ingest", ingest, methods=["POST"]),
            Route("/v1/runs", runs, methods=["GET"]),
            Route("/v1/runs/{run}/commands", commands, methods=["GET", "POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        middleware=[Middleware(BodyLimit, limit=cfg.max_body_bytes, on_refused=refused)],
        exception_handlers={BodyTooLarge: body_too_large},
        lifespan=lifespan,
    )


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9090, help="0 picks a free port (see --port-file)")
    parser.add_argument("--runs", default="runs", help="run store directory (runs/<run_id>/...)")
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help=f"accept writes without a bearer token (otherwise ${schema.ENV_TOKEN} is required)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        help="a larger request body on any endpoint gets 413, read no further",
    )
    parser.add_argument(
        "--checkpoint-interval",
        type=float,
        default=1.0,
        help="seconds between moves of logged rows into Parquet parts",
    )
    parser.add_argument(
        "--guard", default=None, help="guard TOML for the server-side detectors (default config)"
    )
    parser.add_argument("--no-detectors", action="store_true", help="do not run detectors server-side")
    parser.add_argument(
        "--heartbeat-floor", type=float, default=30.0, help="minimum heartbeat timeout, seconds"
    )
    pc = ProgressConfig()
    parser.add_argument(
        "--progress-safety",
        type=float,
        default=pc.safety_factor,
        metavar="X",
        help="RunStuck: a phase's deadline is X times the longest duration seen for it "
        f"(default {pc.safety_factor:g})",
    )
    parser.add_argument(
        "--progress-floor",
        type=float,
        default=pc.floor_s,
        metavar="SECONDS",
        help=f"RunStuck: no deadline is shorter than this (default {pc.floor_s:g})",
    )
    parser.add_argument(
        "--progress-first-deadline",
        type=float,
        default=pc.first_deadline_s,
        metavar="SECONDS",
        help="RunStuck: the deadline of a phase never seen to complete, and of a rank's start-up "
        f"(default {pc.first_deadline_s:g})",
    )
    parser.add_argument("--port-file", default=None, help="write the bound port here once listening")
    parser.add_argument(
        "--pager-url",
        default=None,
        metavar="URL",
        help="`moeguard pager` base URL (e.g. http://127.0.0.1:9095): halt events are posted to its "
        "/v1/events in the background, so a halt pages in seconds (bearer token from $MOEGUARD_PAGER_TOKEN)",
    )
    d = CollectorLimits()
    lim = parser.add_argument_group(
        "limits", "a batch over one is refused whole with 400 naming it; see guard/core/limits.py"
    )
    lim.add_argument(
        "--max-hot-runs",
        type=int,
        default=d.max_hot_runs,
        help="runs held in full in memory; the least recently used beyond are checkpointed and evicted, "
        "and reload on their next batch (default %(default)s)",
    )
    lim.add_argument(
        "--max-ranks", type=int, default=d.max_ranks, help="rank ids must be below this (default %(default)s)"
    )
    lim.add_argument(
        "--max-layers",
        type=int,
        default=d.max_layers,
        help="layer ids per report, and every layer id must be below this (default %(default)s)",
    )
    lim.add_argument(
        "--max-detectors",
        type=int,
        default=d.max_detectors,
        help="distinct detector names per run (default %(default)s)",
    )
    lim.add_argument(
        "--max-series-per-run",
        type=int,
        default=d.max_series_per_run,
        help="/metrics series per run; the rest are left out and counted in "
        f"{schema.M_COLLECTOR_SERIES_DROPPED} (default %(default)s)",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = os.environ.get(schema.ENV_TOKEN) or None
    if token is None and not args.insecure_no_auth:
        print(
            f"moeguard collector: set {schema.ENV_TOKEN} (writes need a bearer token), "
            "or pass --insecure-no-auth to accept unauthenticated writes",
            flush=True,
        )
        return 2
    guard_cfg = None if args.no_detectors else load_guard_config(args.guard) if args.guard else GuardConfig()
    from guard.pager.config import ENV_PAGER_TOKEN

    try:
        limits = CollectorLimits(**{k: getattr(args, k) for k in LIMIT_FLAGS})
    except ValueError as e:
        print(f"moeguard collector: {e}", flush=True)
        return 2
    cfg = CollectorConfig(
        runs_dir=Path(args.runs),
        token=token,
        max_body_bytes=args.max_body_bytes,
        limits=limits,
        checkpoint_interval_s=args.checkpoint_interval,
        guard=guard_cfg,
        heartbeat=HeartbeatConfig(floor_s=args.heartbeat_floor),
        pager_url=args.pager_url,
        progress=ProgressConfig(
            safety_factor=args.progress_safety,
            floor_s=args.progress_floor,
            first_deadline_s=args.progress_first_deadline,
        ),
        pager_token=os.environ.get(ENV_PAGER_TOKEN) or None,
    )
    # A /metrics render is seconds of pure Python at 10k runs; with the default 5 ms GIL switch
    # interval every hand-off an ingest request needs (event loop, worker thread, after each
    # fdatasync) waits up to 5 ms behind it. 1 ms keeps ingest p99 low while a scrape renders.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    collector = Collector(cfg)  # started by the app's lifespan, so it listens before the runs are scanned
    sock = bind_tcp(args.host, args.port)
    port = sock.getsockname()[1]
    if args.port_file:
        atomic_write_bytes(Path(args.port_file), str(port).encode())
    log.info(
        "collector listening on http://%s:%d, runs in %s%s",
        args.host,
        port,
        cfg.runs_dir,
        "" if token else " (NO AUTH)",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(collector), log_level=args.log_level, access_log=False, timeout_graceful_shutdown=10
        )
    )
    server.run(sockets=[sock])
    return 0
