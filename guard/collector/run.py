"""One run in the collector: ingest (dedupe, the write-ahead log's commit point, apply),
server-side detectors, operator commands, and the memory a checkpoint commits.

`lock` guards memory; `journal.lock` serialises checkpoints and truncations (taken before
`lock`). The run's durable side (the log, state.json, recovery and checkpoint writes) is
journal.py's RunJournal; its live health (halt latch, heartbeats, last step) is the collector's
HealthBook; its files go through storage.py; its writer generations through generations.py.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from guard.collector.book import HealthBook
from guard.collector.commands import CommandLog
from guard.collector.config import COMMANDS_FILE, LIVENESS_EVERY_S, CollectorConfig
from guard.collector.errors import ClockAhead, RunEvicted, StorageFailed, busy_or_none
from guard.collector.generations import CONFLICT, DUPLICATE, NEW, WriterGenerations
from guard.collector.journal import (
    Checkpoint,
    RunJournal,
    counter_state,
    liveness_state,
    restore_counters,
    restore_liveness,
)
from guard.collector.ordering import WriterOrder
from guard.collector.paging import AlertmanagerNotifier
from guard.collector.run_meta import RunMeta
from guard.collector.status import resume_event
from guard.collector.storage import StoredState, load_commands
from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.engine import Engine
from guard.core.events import Event
from guard.core.heartbeat import PHASE_TRAIN
from guard.core.limits import check_detectors
from guard.core.report import StepReport
from guard.wire.batch import MAX_CLOCK_AHEAD_S, Batch

log = logging.getLogger("moeguard.collector")


class RunState:
    """A run's dedupe marks, pending rows and detectors, over its RunJournal. `lock` guards
    memory; `journal.lock` serialises checkpoints and truncations (taken before `lock`)."""

    def __init__(
        self,
        run: str,
        run_dir: Path,
        cfg: CollectorConfig,
        health: HealthBook,
        notifier: AlertmanagerNotifier | None = None,
    ) -> None:
        self.run, self.dir, self.cfg, self.health, self.notifier = run, run_dir, cfg, health, notifier
        self.lock = threading.Lock()
        self.evicted = False  # set under both locks; a request that finds it set goes to the collector again
        self.last_touch = time.monotonic()  # LRU order for eviction
        # raises RunDamaged before anything is created or changed
        self.journal = RunJournal(run, run_dir, cfg.store)
        self.gens = WriterGenerations()
        self.last_step = -1  # last rank-0 step stored or pending
        self.report_gen = -1  # generation of rank 0's last batch with reports (restart detection)
        self.order = WriterOrder(run)  # steps strictly increase, times no further ahead than ours
        self.meta_file = RunMeta(run, run_dir)
        self.pending_reports: list[StepReport] = []
        self.pending_events: list[dict[str, Any]] = []
        self.pending_side: dict[str, list[dict[str, Any]]] = {}  # rank 0's evals and host rows
        self.dirty = False
        self._liveness_at = -float("inf")  # monotonic time liveness.json was last handed to a checkpoint
        self._liveness_ranks: tuple[Any, ...] = ()  # liveness_key() then
        self.failed: BaseException | None = None
        self.failed_at = 0.0  # monotonic time of the failure (or of the last reload attempt)
        self.detectors = _make_detectors(cfg.guard)
        self.trainer_detectors = False
        commands_file = self.journal.state_dir / COMMANDS_FILE
        self.commands = CommandLog(commands_file, load_commands(commands_file))
        try:
            self._recover()
        except BaseException:
            self.journal.close()
            raise

    # ---- recovery (journal.py: state.json, then the log after it) ----------------
    def _recover(self) -> None:
        stored, liveness, counters = self.journal.load()
        self._restore(stored)
        restore_liveness(self.health, self.run, stored, liveness)
        restore_counters(self.health, self.run, counters)  # replaces: replay then adds the log's batches
        self.journal.replay(lambda batch, now: self._ingest(batch, None, now, replay=True))
        self.checkpoint()

    def _restore(self, p: StoredState) -> None:
        """Memory as the last checkpoint committed it (state.json and meta.json)."""
        self.last_step, self.report_gen = p.last_step, p.report_gen
        self.gens = WriterGenerations(p.hwm, p.retired, p.writers)
        self.commands.acks = p.acks
        self.trainer_detectors = p.trainer_detectors
        self.meta_file.load()
        if self.trainer_detectors:
            self.detectors = None

    # ---- ingest --------------------------------------------------------------------
    def ingest(self, batch: Batch, body: bytes) -> dict[str, Any]:
        """Store a batch all or nothing: once the answer says stored, the batch is in the
        fdatasync'd log and applied exactly once; on any error nothing of it is applied (503,
        and a retry stores it once). Raises StorageFailed."""
        now = time.time()
        with self.lock:
            if self._is_duplicate(batch):
                return self._answer(batch, duplicate=True)
            self._check_limits(batch)
            if not self._needs_truncate(batch):
                self._ingest_or_fail(batch, body, now)
                return self._answer(batch, duplicate=False)
        with self.journal.lock, self.lock:  # rare: a resumed trainer re-runs stored steps
            if self._is_duplicate(batch):
                return self._answer(batch, duplicate=True)
            self._ingest_or_fail(batch, body, now)
            return self._answer(batch, duplicate=False)

    def _is_duplicate(self, b: Batch) -> bool:
        """Whether `b` is stored already; raises when the run cannot take it (evicted, failed,
        or another writer generation owns it). Caller holds `lock`."""
        self._usable()
        kind = self.gens.classify(b)
        if kind == CONFLICT:
            raise self.gens.conflict(self.run, b)
        if kind == NEW and (ahead := self.gens.takeover_ahead(b, time.time())) > MAX_CLOCK_AHEAD_S:
            raise ClockAhead(self.run, b, self.gens.owner(b.rank), ahead)
        return kind == DUPLICATE

    def _usable(self) -> None:
        """Caller holds `lock`."""
        if self.evicted:
            raise RunEvicted(self.run)
        if self.failed is not None:
            busy = busy_or_none(self.run, "storage failed, recovering", self.failed)
            raise busy or StorageFailed(f"run {self.run}: storage failed: {self.failed!r}")

    def _check_limits(self, b: Batch) -> None:
        """Limits that depend on what the run holds already (guard/core/limits.py). Caller holds `lock`."""
        if names := _verdict_detectors(b):
            check_detectors(self.health.detectors(self.run), names, self.cfg.limits)

    def evict(self) -> bool:
        """Checkpoint and let go of the run (the collector then drops it from memory); False when
        it cannot go now (new rows since the checkpoint, or its storage failed)."""
        try:
            self.checkpoint()
        except Exception:
            return False  # logged by checkpoint(); the run stays, answering 503
        with self.journal.lock, self.lock:
            if self.dirty or self.failed is not None or self.evicted:
                return False
            self.evicted = True
            self.journal.close()
            return True

    def _ingest_or_fail(self, b: Batch, body: bytes, now: float) -> None:
        try:
            self._ingest(b, body, now)
        except OSError as e:  # before the commit point: nothing was applied
            log.warning(
                "run %s: batch rank %d seq %d not stored (%r); the client retries", self.run, b.rank, b.seq, e
            )
            busy = busy_or_none(self.run, "batch not stored", e)
            raise busy or StorageFailed(f"run {self.run}: storage error, nothing stored, retry: {e!r}") from e

    def _is_restart(self, b: Batch) -> bool:
        """Rank 0 reports from a new trainer process (a resume or a restart) of a known run."""
        return b.rank == 0 and bool(b.reports) and 0 <= self.report_gen < b.generation

    def _needs_truncate(self, b: Batch) -> bool:
        return self._is_restart(b) and min(r.step for r in b.reports) <= self.last_step

    def _ingest(self, b: Batch, body: bytes | None, now: float, replay: bool = False) -> None:
        """Apply a validated, non-duplicate batch. Caller holds `lock` (and `journal.lock` when the
        batch truncates). `body` None means replay: the record is already in the log.

        Order: storage work that can fail and is safe to redo (the truncation of re-run steps),
        then the log append (the commit point), then memory only. An OSError before the commit
        leaves memory untouched; an error after it (a bug) stops the run until a restart
        replays the log, so a batch is never half-applied. meta.json is derived state: written
        after the commit, and if that fails, again at the next checkpoint."""
        if replay and self.gens.classify(b) != NEW:
            return
        b.reports = self.order.steps(b, self.last_step, self.report_gen, strict=not replay)
        first = min(r.step for r in b.reports) if self._needs_truncate(b) else None
        if first is not None:
            self.journal.supersede(b, first, (self.pending_reports, self.pending_events, self.pending_side))
        changes = _changes_state(b) or (b.trainer_detectors and not self.trainer_detectors)
        if body is not None and (changes or self.commands.is_new_ack(b.rank, b.commands_ack)):
            self.journal.append(body)  # the commit point: the batch is durable from here on
        try:
            self._apply(b, now, first, live=body is not None)
        except BaseException as e:
            if body is None:
                raise  # replay at start: the run is quarantined
            self.failed, self.failed_at = e, time.monotonic()
            log.exception(
                "run %s: applying a logged batch failed; run refuses ingest until restart", self.run
            )
            raise StorageFailed(f"run {self.run}: internal error after the batch was logged: {e!r}") from e
        if self.meta_file.dirty and not replay:
            try:
                self.meta_file.write()
            except OSError as e:
                log.warning("run %s: meta.json not written (%r); retried at the next checkpoint", self.run, e)

    def _apply(self, b: Batch, now: float, truncated_from: int | None, live: bool) -> None:
        """The in-memory part of `_ingest` (no I/O)."""
        self.gens.accept(b)
        self.dirty = True
        if truncated_from is not None:
            self._drop_pending_from(truncated_from)
        restart = self._is_restart(b)
        if b.rank == 0 and b.reports:
            self.report_gen = max(self.report_gen, b.generation)
        if b.trainer_detectors and not self.trainer_detectors:
            self.trainer_detectors, self.detectors = True, None
        was_halted, was_status = self.health.is_halted(self.run), self.meta_file.status
        if b.meta:
            self.health.set_meta(self.run, self.meta_file.merge(b.meta))
        elif b.reports:
            self.meta_file.ensure()
        # Not a meta "running": a halted trainer still sends meta snapshots from its own store
        # (checkpoint time) that say running; only a new process that trains again resumes.
        events = resume_event(b) if was_halted and restart else []
        events += b.events + self._take_reports(b, now)
        if events:
            self.pending_events.extend(events)
            self.health.observe_events(self.run, events)
        for t, rows in b.side.items():  # rank 0's evals and host samples, stored as they came
            self.pending_side.setdefault(t, []).extend(rows)
        halted = self.health.is_halted(self.run)
        status = self.meta_file.advance(b, halted=halted, was_halted=was_halted, resumed=restart)
        if status == schema.STATUS_HALTED and was_status != schema.STATUS_HALTED:
            self.health.end_heartbeats(self.run)  # every rank: RunHalted pages a halted run
        if b.ranks is not None:
            self.health.observe_ranks(self.run, b.ranks)
        # Any other ending keeps watching the ranks that have not said goodbye (status.py): a
        # rank that is silent with no final batch pages, whatever its peers said.
        if self.meta_file.status != schema.STATUS_HALTED:
            hb = _beat_of(b)
            if hb is not None:
                self.health.beat(
                    self.run,
                    b.rank,
                    now,
                    hb["step"],
                    hb["phase"],
                    self.order.sent(b.rank, hb["time"], now),
                    b.generation,
                    every=float(hb.get("every", 0.0)),
                    waiting=bool(hb.get("waiting", False)),
                    world=int(hb.get("world", 0)) if b.reports else 0,  # a report's step is the proof
                )
        if b.final:
            self.health.end_heartbeats(self.run, b.rank)
        if self.notifier is not None and live:  # durable now; a replay never pages
            self.notifier.observe(self.run, b.reports, events)
        self.commands.ack(b.rank, b.commands_ack)

    def _drop_pending_from(self, first: int) -> None:
        """Forget pending rows of steps >= `first` (journal.supersede kept them)."""
        self.pending_reports = [r for r in self.pending_reports if r.step < first]
        self.pending_events = [e for e in self.pending_events if e["step"] < first]
        self.pending_side = {
            t: [r for r in rows if r["step"] < first] for t, rows in self.pending_side.items()
        }
        self.last_step = first - 1

    def _take_reports(self, b: Batch, now: float) -> list[dict[str, Any]]:
        """Count every report in the run's health; keep rank 0's and run the server-side
        detectors on them. Returns their verdicts as event rows, except at steps where the
        trainer sent its own guard events."""
        trainer_steps = _guarded_steps(b)
        server_events: list[dict[str, Any]] = []
        for rep in b.reports:
            self.health.observe_report(self.run, rep, now)
            if b.rank != 0:
                continue
            self.pending_reports.append(rep)
            self.last_step = max(self.last_step, rep.step)
            verdicts = self._detect(rep)
            if rep.step not in trainer_steps:
                server_events += [_server_event(rep, v) for v in verdicts]
        return server_events

    def _detect(self, rep: StepReport) -> list[Any]:
        if self.detectors is None:
            return []
        try:
            return self.detectors.verdicts(rep)
        except Exception:  # a detector bug must not take ingest down
            log.exception("run %s: server-side detectors failed; disabled for this run", self.run)
            self.detectors = None
            return []

    @property
    def meta(self) -> dict[str, Any] | None:
        """meta.json as it is (or is about to be) on disk."""
        return self.meta_file.doc

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

    # ---- checkpoint (journal.py writes it) ---------------------------------------
    def checkpoint(self) -> None:
        """Move pending rows to Parquet and commit; the log up to here is then deleted."""
        with self.journal.lock:
            with self.lock:
                ckpt = self._take_checkpoint()
            if ckpt is None:
                return
            try:
                self.journal.commit(ckpt)
            except BaseException as e:
                # Acknowledged rows are still in the log; a restart replays them. Until then
                # this run answers 503 so exporters keep their data.
                self.failed, self.failed_at = e, time.monotonic()
                log.exception("run %s: checkpoint failed; 503 until its storage works again", self.run)
                raise

    def _take_checkpoint(self) -> Checkpoint | None:
        """Hand the pending rows and the run's state to a checkpoint (None: nothing to commit,
        or meta.json could not be written first). Caller holds both locks."""
        if not self.dirty or self.failed is not None:
            return None
        if self.meta_file.dirty:
            try:  # before the commit deletes the log that holds the batches it came from
                self.meta_file.write()
            except OSError as e:
                log.warning("run %s: meta.json not written (%r); checkpoint postponed", self.run, e)
                return None
        ckpt = Checkpoint(
            segment=self.journal.end_segment(),
            reports=self.pending_reports,
            events=self.pending_events,
            side=self.pending_side,
            state={
                **self.gens.state_dict(),
                "acks": dict(self.commands.acks),
                "last_step": self.last_step,
                "trainer_detectors": self.trainer_detectors,
                "report_gen": self.report_gen,
                **counter_state(self.health, self.run),
            },
            liveness=self._liveness_due(),
        )
        self.pending_reports, self.pending_events, self.pending_side, self.dirty = [], [], {}, False
        return ckpt

    def _liveness_due(self, force: bool = False) -> dict[str, Any] | None:
        """liveness.json's content when it is due (the set of ranks or what was learned changed, LIVENESS_EVERY_S
        passed, or `force`), else None: a 16,384-rank run does not rewrite ~1 MB a second.
        Caller holds `lock`."""
        n = self.health.liveness_key(self.run)
        now = time.monotonic()
        if not force and n == self._liveness_ranks and now - self._liveness_at < LIVENESS_EVERY_S:
            return None
        self._liveness_at, self._liveness_ranks = now, n
        return liveness_state(self.health, self.run)

    def close(self) -> None:
        self._liveness_ranks = ()  # the last checkpoint writes liveness as it is now
        try:
            self.checkpoint()
        finally:
            self.journal.close()


def _make_detectors(cfg: GuardConfig | None) -> Engine | None:
    """The guard engine, of which the collector runs the detectors (no policy: it acts on nothing)."""
    return Engine(cfg) if cfg is not None else None


def _changes_state(b: Batch) -> bool:
    """Whether `b` carries what a restart must bring back, so it is logged: events, meta, rank
    0's rows (reports, evals, host samples), a rank's end (so do a new commands ack and the trainer taking over detection).
    Other ranks' reports and heartbeats only feed live health, learned again after a restart."""
    return bool(b.events or b.meta or (b.rank == 0 and (b.reports or b.side)) or b.final)


def _verdict_detectors(b: Batch) -> set[str]:
    """The detectors named by the verdict events in `b`."""
    return {str(e.get("detector") or "unknown") for e in b.events if e["kind"] == schema.EV_VERDICT}


def _guarded_steps(b: Batch) -> set[int]:
    """Steps at which the trainer sent its own verdict, action or halt events."""
    return {e["step"] for e in b.events if e["kind"] in (schema.EV_VERDICT, schema.EV_ACTION, schema.EV_HALT)}


def _server_event(rep: StepReport, verdict: Any) -> dict[str, Any]:
    """A server-side detector's verdict on `rep`, as an event row (no action: the collector acts on nothing)."""
    ev = Event.from_verdict(rep.step, verdict, schema.ACT_NONE)
    ev.detail["source"] = "collector"
    ev.time = rep.time
    return ev.row()


def _beat_of(b: Batch) -> dict[str, Any] | None:
    """The rank's liveness in `b` (guard/wire/batch.py `heartbeat`): its heartbeat, else its last report."""
    if b.heartbeat is not None:
        return b.heartbeat
    if b.reports:
        last = max(b.reports, key=lambda r: r.step)
        return {"time": last.time, "step": last.step, "phase": PHASE_TRAIN}
    return None
