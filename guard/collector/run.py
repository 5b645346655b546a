"""One run in the collector: ingest (dedupe, the write-ahead log, apply), recovery from the log,
checkpoints to the run store, server-side detectors and operator commands.

`lock` guards memory; `ckpt_lock` serialises checkpoints and truncations (taken before `lock`).
The run's live health (halt latch, heartbeats, last step) is the collector's HealthBook; its
files go through storage.py; its writer generations through generations.py.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.collector.book import HealthBook
from guard.collector.commands import CommandLog
from guard.collector.config import COMMANDS_FILE, STATE_DIR, STATE_FILE, SUPERSEDED_DIR, CollectorConfig
from guard.collector.errors import RunEvicted, StorageFailed
from guard.collector.generations import CONFLICT, DUPLICATE, NEW, WriterGenerations
from guard.collector.health import is_halt
from guard.collector.status import ENDED, minimal_meta, next_status, resume_event
from guard.collector.storage import (
    check_run_layout,
    commit_state,
    initial_state,
    load_commands,
    load_json,
    parse_state,
    remove_uncommitted_parts,
    supersede,
    write_meta,
    write_rows,
)
from guard.collector.wal import Wal
from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.engine import Engine
from guard.core.events import Event
from guard.core.heartbeat import PHASE_TRAIN
from guard.core.limits import check_detectors
from guard.core.report import StepReport
from guard.pager.notify import PagerNotifier
from guard.store.layout import next_part_seq
from guard.store.reader import last_step as scan_last_step
from guard.store.reader import read_meta
from guard.wire.batch import BadRequest, Batch, parse_batch

log = logging.getLogger("moeguard.collector")


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
        health: HealthBook,
        notifier: PagerNotifier | None = None,
    ) -> None:
        self.run, self.dir, self.cfg, self.health, self.notifier = run, run_dir, cfg, health, notifier
        self.lock = threading.Lock()
        self.ckpt_lock = threading.Lock()
        self.evicted = False  # set under both locks; a request that finds it set goes to the collector again
        self.last_touch = time.monotonic()  # LRU order for eviction
        self.state_dir = run_dir / STATE_DIR
        check_run_layout(run_dir)  # raises RunDamaged before anything is created or changed
        for t in schema.TABLES:
            (run_dir / t).mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(exist_ok=True)
        self.gens = WriterGenerations()
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
        self.commands = CommandLog(
            self.state_dir / COMMANDS_FILE, load_commands(self.state_dir / COMMANDS_FILE)
        )
        self.wal = Wal(self.state_dir)
        try:
            self._recover()
        except BaseException:
            self.wal.close()
            raise

    # ---- recovery ------------------------------------------------------------------
    def _recover(self) -> None:
        st = load_json(self.state_dir / STATE_FILE, None)
        if st is None:  # first time: commit an empty state over whatever is already there
            st = initial_state(self.dir, next_part_seq(self.dir), scan_last_step(self.dir))
            commit_state(self.state_dir, st)
        p = parse_state(st)
        self.segment_done, self.next_part, self.last_step, self.report_gen = (
            p.segment_done,
            p.next_part,
            p.last_step,
            p.report_gen,
        )
        self.gens = WriterGenerations(p.hwm, p.retired, p.writers)
        self.commands.acks = p.acks
        self.trainer_detectors, ranks = p.trainer_detectors, p.ranks
        self.meta = read_meta(self.dir)  # a JSON object or None: check_run_layout refused anything else
        self.status = (self.meta or {}).get("status")
        if self.trainer_detectors:
            self.detectors = None
        for rank, seen, sent, step, phase in ranks:
            self.health.beat(self.run, rank, seen, step, phase, sent)
        try:
            self.health.load_liveness_state(self.run, st.get("liveness", {}))
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # learned again from the next beats
            log.warning(
                "run %s: %s liveness state not restored (%s: %s)", self.run, STATE_FILE, type(e).__name__, e
            )
        remove_uncommitted_parts(self.run, self.dir, self.next_part)
        segs = self.wal.segments()
        self.wal.delete_upto(self.segment_done)
        n = 0
        for seg in (x for x in segs if x > self.segment_done):
            for rec in self.wal.read(seg):
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
            kind = self.gens.classify(batch)
            if kind == CONFLICT:
                raise self.gens.conflict(self.run, batch)
            if kind == DUPLICATE:
                return self._answer(batch, duplicate=True)
            self._check_limits(batch)
            if not self._needs_truncate(batch):
                self._ingest_or_fail(batch, body, now)
                return self._answer(batch, duplicate=False)
        with self.ckpt_lock, self.lock:  # rare: a resumed trainer re-runs stored steps
            self._usable()
            kind = self.gens.classify(batch)
            if kind == CONFLICT:
                raise self.gens.conflict(self.run, batch)
            if kind == DUPLICATE:
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
            check_detectors(self.health.detectors(self.run), names, self.cfg.limits)

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
        if replay and self.gens.classify(b) != NEW:
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
            or self.commands.is_new_ack(b.rank, b.commands_ack)
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
        moved = supersede(self.dir, dest, first, (self.pending_reports, self.pending_events), self.next_part)
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

    def _apply(self, b: Batch, now: float, truncated_from: int | None, live: bool) -> None:
        """The in-memory part of `_ingest` (no I/O)."""
        self.gens.accept(b)
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
        m = self.health
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
            self._set_meta(minimal_meta(self.run))
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
        events = resume_event(b) if was_halted and resumed else []
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
        self.commands.ack(b.rank, b.commands_ack)

    def _detect(self, rep: StepReport) -> list[Any]:
        if self.detectors is None:
            return []
        try:
            return self.detectors.verdicts(rep)
        except Exception:  # a detector bug must not take ingest down
            log.exception("run %s: server-side detectors failed; disabled for this run", self.run)
            self.detectors = None
            return []

    def _update_status(self, b: Batch, was_halted: bool, was_status: str | None, resumed: bool) -> None:
        """Keep meta.json's status in step with what the batch says (status.py). Written only on
        a change; an ended run stops being watched for heartbeats."""
        halted = self.health.is_halted(self.run)
        status = next_status(self.status, b, halted=halted, was_halted=was_halted, resumed=resumed)
        if status in ENDED and was_status not in ENDED:
            self.health.end_heartbeats(self.run)  # every rank: the run is over
        if status != self.status and status is not None:
            self._set_meta(
                {**(self.meta or minimal_meta(self.run)), "status": status, "updated_at": time.time()}
            )
            self.status = status

    def _set_meta(self, meta: dict[str, Any]) -> None:
        self.meta, self.meta_dirty = meta, True

    def _write_meta(self) -> None:
        """Write meta.json from memory. Caller holds `lock`."""
        if self.meta is not None:
            write_meta(self.dir, self.meta)
        self.meta_dirty = False

    def _answer(self, b: Batch, duplicate: bool) -> dict[str, Any]:
        return {"ok": True, "duplicate": duplicate, "commands": self.commands.pending(b.rank, None)}

    # ---- commands ------------------------------------------------------------------
    def pending_commands(self, rank: int, after: int | None) -> list[dict[str, Any]]:
        with self.lock:
            return self.commands.pending(rank, after)

    def add_command(self, action: str, reason: str, rank: int | None) -> dict[str, Any]:
        with self.lock:
            if self.evicted:
                raise RunEvicted(self.run)
            return self.commands.add(action, reason, rank)

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
                        **self.gens.state_dict(),
                        "acks": dict(self.commands.acks),
                        "last_step": self.last_step,
                        "trainer_detectors": self.trainer_detectors,
                        "report_gen": self.report_gen,
                        "ranks": self._rank_beats(),
                        "liveness": self.health.liveness_state(self.run),
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
        return {str(r): v for r, v in self.health.beats(self.run).items()}

    def _write(self, snap: _Snapshot) -> None:
        seq = write_rows(self.dir, snap.reports, snap.events, self.next_part)
        commit_state(self.state_dir, {**snap.state, "segment_done": snap.segment, "next_part_seq": seq})
        self.next_part, self.segment_done = seq, snap.segment
        self.wal.delete_upto(snap.segment)

    def close(self) -> None:
        try:
            self.checkpoint()
        finally:
            self.wal.close()


def _make_detectors(cfg: GuardConfig | None) -> Engine | None:
    """The guard engine, of which the collector runs the detectors (no policy: it acts on nothing)."""
    return Engine(cfg) if cfg is not None else None
