"""A run's durable side in the collector: the write-ahead log (wal.py) of the batches stored
since the last checkpoint, and state.json, the checkpoint that says which log segments are
already in Parquet parts (and which part number comes next).

A checkpoint writes the pending rows as parts, then replaces state.json (the commit point),
then deletes the log it covers. On load, parts of a checkpoint that never committed are
removed and the log after the committed segment is replayed through the ingest path, so a
crash at any point stores every acknowledged batch exactly once.

RunState (run.py) owns the memory; this module owns the files and their order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.collector.book import HealthBook
from guard.collector.config import STATE_DIR, STATE_FILE, SUPERSEDED_DIR
from guard.collector.storage import (
    COUNTERS_KEY,
    Side,
    StoredState,
    check_run_layout,
    commit_liveness,
    commit_state,
    initial_state,
    load_json,
    parse_state,
    remove_uncommitted_parts,
    row_frames,
    stored_counters,
    supersede,
    with_liveness,
)
from guard.collector.wal import Wal
from guard.core import schema
from guard.core.report import StepReport
from guard.store.layout import next_part_seq
from guard.store.maintain import StoreMaintainer
from guard.store.policy import StoreConfig
from guard.store.reader import last_step as scan_last_step
from guard.store.reader import read_meta
from guard.store.writer import write_parts
from guard.wire.batch import BadRequest, Batch, parse_batch

log = logging.getLogger("moeguard.collector")


@dataclass(slots=True)
class Checkpoint:
    """What one checkpoint commits: the rows pending since the last one, the log segment they
    end in, and the run's state (state.json less the journal's own keys)."""

    segment: int
    reports: list[StepReport]
    events: list[dict[str, Any]]
    state: dict[str, Any]
    liveness: dict[str, Any] | None = None  # liveness.json's new content, or None: keep it as is
    side: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # rank 0's evals, host rows


class RunJournal:
    """The log and state.json of one run. `lock` serialises checkpoints and truncations (the
    writers of parts); a caller that also needs the run's memory lock takes this one first."""

    def __init__(self, run: str, run_dir: Path, policy: StoreConfig | None = None) -> None:
        """Check the run folder's layout (RunDamaged before anything is created or changed),
        then make the run store's tables and the collector's state folder. `policy`: the
        `[store]` table (summary.json, rollups, compaction, retention after each checkpoint)."""
        self.run, self.dir = run, run_dir
        self.policy = policy
        self._maint: StoreMaintainer | None = None  # made at the first commit (after replay's cleanup)
        self.state_dir = run_dir / STATE_DIR
        check_run_layout(run_dir)
        for t in schema.TABLES:
            (run_dir / t).mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(exist_ok=True)
        # Re-entrant: RunState.evict holds it around close(), which takes it again to roll up an
        # ended run's tail (a plain Lock deadlocked the evictor and, behind it, the checkpointer).
        self.lock = threading.RLock()
        self.wal = Wal(self.state_dir)
        self.segment_done = 0  # the last log segment whose batches are in parts
        self.next_part = 0  # the next part number a checkpoint writes

    def load(self) -> tuple[StoredState, Any, Any]:
        """state.json, checked, its liveness record and its counters (both checked by their
        readers); a run's first load commits an empty one over whatever is already in the
        folder (the parts present, the last step stored, the counters of what they hold)."""
        st = load_json(self.state_dir / STATE_FILE, None)
        if st is None:
            st = initial_state(self.dir, next_part_seq(self.dir), scan_last_step(self.dir))
        st = with_liveness(st, self.state_dir)
        p = parse_state(st)
        if COUNTERS_KEY not in st:  # first load, or a state from before counters were kept
            remove_uncommitted_parts(self.run, self.dir, p.next_part)  # counted: committed rows only
            st[COUNTERS_KEY] = stored_counters(self.dir)
            commit_state(self.state_dir, st)
        self.segment_done, self.next_part = p.segment_done, p.next_part
        return p, st.get("liveness", {}), st[COUNTERS_KEY]

    def replay(self, apply: Callable[[Batch, float], None]) -> None:
        """After `load`: drop what an uncommitted checkpoint left, then hand every batch logged
        after the committed segment to `apply`, in log order, with the time its segment was last
        written (the collector's clock, within a checkpoint interval of when it arrived; never the
        trainer's, which may run a day ahead or behind); new records go to a new segment."""
        remove_uncommitted_parts(self.run, self.dir, self.next_part)
        segs = self.wal.segments()
        self.wal.delete_upto(self.segment_done)
        n = 0
        for seg in (x for x in segs if x > self.segment_done):
            arrived = self.wal.written_at(seg)
            for rec in self.wal.read(seg):
                try:
                    batch = parse_batch(rec)
                except BadRequest as e:  # validated when logged; only a stricter new version gets here
                    log.error("run %s: logged batch no longer parses, skipped: %s", self.run, e)
                    continue
                apply(batch, arrived)
                n += 1
        self.wal.cur = max([*segs, self.segment_done]) + 1
        if n:
            log.info("run %s: replayed %d logged batches", self.run, n)

    def append(self, body: bytes) -> None:
        """Log one batch durably: the commit point of its ingest."""
        self.wal.append(body)

    def end_segment(self) -> int:
        """Close the log segment being written; returns the last one holding records (what a
        checkpoint taken now covers)."""
        return self.wal.rotate()

    def commit(self, ckpt: Checkpoint) -> None:
        """Write the checkpoint's rows as parts, commit state.json, delete the log it covers;
        then the run store's upkeep (summary.json, and a closed segment's compaction, rollups and
        retention: guard/store/maintain.py), which only reads and rewrites committed parts."""
        if self._maint is None:
            self._maint = self._maintainer()
        frames = row_frames(ckpt.reports, ckpt.events, ckpt.side)
        seq = write_parts(self.dir, frames, self.next_part)
        if ckpt.liveness is not None:  # before state.json: a crash between keeps the newer liveness
            commit_liveness(self.state_dir, ckpt.liveness)
        commit_state(self.state_dir, {**ckpt.state, "segment_done": ckpt.segment, "next_part_seq": seq})
        self.next_part, self.segment_done = seq, ckpt.segment
        self.wal.delete_upto(ckpt.segment)
        if self._maint is not None:
            try:
                self._maint.wrote(frames)
            except Exception:  # the checkpoint is committed; raw rows stay until a later upkeep
                log.exception(
                    "run %s: store upkeep failed (rows all kept; retried next checkpoint)", self.run
                )

    def _maintainer(self) -> StoreMaintainer | None:
        try:
            return StoreMaintainer(self.dir, self.policy)
        except Exception:
            log.exception(
                "run %s: no summary/rollups/compaction for this run (its rows are all kept)", self.run
            )
            return None

    def finish(self) -> None:
        """The run ended (or is evicted): its last open segment's rollups written."""
        if self._maint is not None:
            try:
                self._maint.finish()
            except Exception:
                log.exception("run %s: final store upkeep failed (rows all kept)", self.run)

    def supersede(
        self, batch: Batch, first: int, pending: tuple[list[StepReport], list[dict[str, Any]], Side]
    ) -> None:
        """Before a new generation's re-run of steps >= `first` is stored: move every row after
        `first - 1` (in parts, and still `pending`) out of the live tables into
        .collector/superseded/<seq>/<table>/, a store of the same layout. Nothing is deleted:
        whether this was a resumed trainer or a second writer that should not have been, the
        rows it replaced can be read back. Idempotent (redone after a failure or in replay)."""
        dest = self.state_dir / SUPERSEDED_DIR / f"{batch.seq:020d}"
        moved = supersede(self.dir, dest, first, pending, self.next_part)
        log.warning(
            "run %s: rank 0 generation %d re-runs steps from %d; %d rows after step %d moved to %s "
            "(kept, not deleted)",
            self.run,
            batch.generation,
            first,
            moved,
            first - 1,
            dest,
        )

    def close(self) -> None:
        """Close the log; a run that has ended (meta.json's status) gets its last segment rolled
        up. A live run's tail stays raw (readers read it raw): an eviction or a shutdown of a
        collector holding many runs does not re-read every run's tail."""
        meta = read_meta(self.dir) or {}
        if meta.get("status") not in (None, schema.STATUS_RUNNING, schema.STATUS_STALE):
            with self.lock:
                self.finish()
        self.wal.close()


def liveness_state(health: HealthBook, run: str) -> dict[str, Any]:
    """The run's liveness as state.json keeps it: each rank's last beat, and what was learned
    of its heartbeat intervals and phase durations."""
    return {
        "ranks": {str(r): v for r, v in health.beats(run).items()},
        "liveness": health.liveness_state(run),
    }


def counter_state(health: HealthBook, run: str) -> dict[str, Any]:
    """The run's counters as state.json keeps them (guard actions, verdicts, ...): what the
    checkpoint covers, so a restart that replays the log after it counts nothing twice."""
    return {COUNTERS_KEY: health.counter_state(run)}


def restore_counters(health: HealthBook, run: str, counters: Any) -> None:
    """Put `counter_state`'s record back into the book, replacing the run's counters (before the
    log is replayed onto them); a damaged record is logged and the counters start from 0."""
    try:
        health.load_counter_state(run, counters)
    except (TypeError, ValueError, AttributeError) as e:
        log.warning("run %s: %s counters not restored (%s: %s)", run, STATE_FILE, type(e).__name__, e)
        health.load_counter_state(run, {})


def restore_liveness(health: HealthBook, run: str, stored: StoredState, liveness: Any) -> None:
    """Put `liveness_state`'s record back into the book; what does not load is learned again
    from the next beats."""
    now = time.time()
    for rank, seen, sent, step, phase in stored.ranks:  # a time in the future is from a trainer's clock
        health.beat(run, rank, min(seen, now), step, phase, sent)
    try:
        health.load_liveness_state(run, liveness)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        log.warning("run %s: %s liveness state not restored (%s: %s)", run, STATE_FILE, type(e).__name__, e)
