"""The in-process run store: one run's rows buffered in memory, written in chunks by a
background thread (guard/store/writer.py writes them; guard/store/layout.py names them).

Why chunks written by a background thread: a step must never wait on disk, and a crash may
lose at most the rows not yet on disk (those since the last flush and the chunk the writer is
writing: under 2 x flush_every steps), never corrupt what is there. Each part is written to a
temporary name, fsynced and renamed, so a reader sees a whole part or none. Read a run back
with guard/store/reader.py.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from guard.core import schema
from guard.core.events import Event
from guard.core.report import StepReport
from guard.core.rows import expert_columns, group_columns, layer_columns, steps_row
from guard.store.full import StoreFull, full_errno, full_text
from guard.store.layout import atomic_write_json, next_part_seq
from guard.store.maintain import StoreMaintainer
from guard.store.policy import StoreConfig
from guard.store.reader import read_meta
from guard.store.writer import table_frame, write_parts

log = logging.getLogger("moeguard.store")
_UPKEEP = "<upkeep>"  # queue item: the flush's parts are written; summary, rollups, compaction

# Tables whose rows are built in bulk from the buffered reports at flush time.
_BULK_TABLES = {
    schema.TABLE_LAYERS: layer_columns,
    schema.TABLE_EXPERTS: expert_columns,
    schema.TABLE_GROUPS: group_columns,
}


def _bulk_frame(table: str, reps: list[StepReport]) -> pl.DataFrame:
    return table_frame(table, _BULK_TABLES[table](reps))


class _TableBuffer:
    """Column buffers for one table, flushed into one Parquet part."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.cols: dict[str, list] = {c: [] for c in schema.TABLE_COLUMNS[table]}
        self.rows = 0

    def add_row(self, row: dict[str, Any]) -> None:
        for c, lst in self.cols.items():
            lst.append(row[c])
        self.rows += 1

    def add_columns(self, cols: dict[str, list]) -> None:
        n = len(next(iter(cols.values()))) if cols else 0
        for c, lst in self.cols.items():
            lst.extend(cols[c])
        self.rows += n

    def take(self) -> pl.DataFrame | None:
        if not self.rows:
            return None
        df = table_frame(self.table, self.cols)
        self.cols = {c: [] for c in self.cols}
        self.rows = 0
        return df


class RunStore:
    """Writer for one run. Only one process (rank 0) writes a run.

    `add_step()` / `add_event()` only append to in-memory buffers (cheap, no I/O); every
    `flush_every` steps the buffers are handed to a background thread that writes the parts.
    Events flush on the next step so a crash right after an action still records it.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        flush_every: int = 50,
        max_pending: int = 64,
        policy: StoreConfig | None = None,
    ) -> None:
        """`policy`: the `[store]` table (retention, rollups, compaction; guard/store/policy.py)."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for t in schema.TABLES:
            (self.dir / t).mkdir(exist_ok=True)
        # summary.json, rollups, compaction and retention, on the writer thread after each flush.
        # Made at the first upkeep, not here: opening a store must read and write nothing of it (a
        # resume that a damaged part or checkpoint then refuses leaves the run folder as it was).
        self._policy = policy
        self._maint: StoreMaintainer | None = None
        self._written: dict[str, list[pl.DataFrame]] = {}
        self._status: str | None = None  # meta.json's status, for summary.json
        self.flush_every = flush_every
        self._buffers = {t: _TableBuffer(t) for t in schema.TABLES}
        self._side_lock = threading.Lock()  # the host table's buffer: filled from the sampler's thread
        self._first_step: dict[str, int | None] = {t: None for t in schema.TABLES}
        self._seq = next_part_seq(self.dir)
        self._since_flush = 0
        self._events_pending = False
        self._reports: list[StepReport] = []  # their layer/expert rows are built at the flush
        # Bounded: if the disk is slower than training for a long time, the step blocks here
        # rather than growing memory without limit. 64 chunks of slack is minutes of steps.
        self._q: queue.Queue[tuple[str, int, pl.DataFrame | Callable[[], pl.DataFrame]] | None] = queue.Queue(
            maxsize=max_pending
        )
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._writer, name="moeguard-runstore", daemon=True)
        self._thread.start()

    # ---- meta ----------------------------------------------------------------------
    def write_meta(self, meta: dict[str, Any]) -> None:
        meta = {**meta, "schema_version": schema.SCHEMA_VERSION, "updated_at": time.time()}
        atomic_write_json(self.dir / schema.META_FILE, meta)
        if isinstance(meta.get("status"), str):
            self._status = meta["status"]  # summary.json takes it at the next upkeep (writer thread)

    def update_meta(self, **fields: Any) -> None:
        meta = read_meta(self.dir) or {}
        meta.update(fields)
        self.write_meta(meta)

    # ---- rows ----------------------------------------------------------------------
    def add_step(self, rep: StepReport) -> None:
        """Keep the report; its layer and expert rows are built in bulk at the flush (numpy over
        all buffered reports, on the writer thread), not per step on the training thread. The
        caller must not mutate `rep` afterwards."""
        self._note_first(schema.TABLE_STEPS, rep.step)
        self._buffers[schema.TABLE_STEPS].add_row(steps_row(rep))
        if len(rep.layer_ids_L):
            self._note_first(schema.TABLE_LAYERS, rep.step)
        if rep.load_ME.size:
            self._note_first(schema.TABLE_EXPERTS, rep.step)
        if rep.group_grad_norm_G.size:
            self._note_first(schema.TABLE_GROUPS, rep.step)
        if len(rep.layer_ids_L) or rep.load_ME.size or rep.group_grad_norm_G.size:
            self._reports.append(rep)
        self._since_flush += 1
        if self._since_flush >= self.flush_every or self._events_pending:
            self.flush(wait=False)

    def add_event(self, ev: Event) -> None:
        self._note_first(schema.TABLE_EVENTS, ev.step)
        self._buffers[schema.TABLE_EVENTS].add_row(ev.row())
        self._events_pending = True

    def add_evals(self, step: int, time_s: float, metrics: dict[str, float]) -> None:
        """Evaluation metrics measured at `step` (schema.EVALS_COLUMNS); written with the next step's
        flush check, as events are, or at close."""
        if not metrics:
            return
        self._note_first(schema.TABLE_EVALS, step)
        for name, value in metrics.items():
            self._buffers[schema.TABLE_EVALS].add_row(
                {"step": step, "time": time_s, "name": name, "value": value}
            )
        self._events_pending = True

    def add_host_row(self, row: dict[str, Any]) -> None:
        """A host sample (schema.HOST_COLUMNS), from the sampler's own thread (guard/runtime/host.py):
        the only table written from outside the training thread, so it takes the lock flush() does."""
        with self._side_lock:
            self._note_first(schema.TABLE_HOST, int(row["step"]))
            self._buffers[schema.TABLE_HOST].add_row(row)

    def add_rank_rows(self, cols: dict[str, list]) -> None:
        if cols["step"]:
            self._note_first(schema.TABLE_RANKS, cols["step"][0])
            self._buffers[schema.TABLE_RANKS].add_columns(cols)

    def _note_first(self, table: str, step: int) -> None:
        if self._first_step[table] is None:
            self._first_step[table] = step

    # ---- flushing ------------------------------------------------------------------
    def flush(self, wait: bool = True) -> None:
        self._raise_if_failed()
        reps, self._reports = self._reports, []
        for t, buf in self._buffers.items():
            with self._side_lock:
                df: pl.DataFrame | Callable[[], pl.DataFrame] | None = buf.take()
                first = self._first_step[t] or 0
                if df is not None:
                    self._first_step[t] = None
            if t in _BULK_TABLES and reps and self._first_step[t] is not None:
                df = functools.partial(_bulk_frame, t, reps)  # built on the writer thread
                self._first_step[t] = None
            if df is not None:
                self._q.put((t, first, df))
        self._q.put((_UPKEEP, 0, pl.DataFrame()))
        self._since_flush = 0
        self._events_pending = False
        if wait:
            self._q.join()
            self._raise_if_failed()

    def close(self, status: str | None = None, **meta_fields: Any) -> None:
        try:
            self.flush(wait=True)
        except StoreFull as full:
            self._q.put(None)
            self._thread.join(timeout=60)
            self._end_full(full, meta_fields.get("status_note", ""), meta_fields)
            raise
        self._q.put(None)
        self._thread.join(timeout=60)
        if status is not None or meta_fields:
            fields = dict(meta_fields)
            if status is not None:
                fields["status"] = status
            self.update_meta(**fields)
        if self._maint is None:  # nothing was written by this process: nothing to roll up
            return
        try:
            self._maint.finish(status or self._status)
        except Exception:
            log.exception("run store %s: final rollups/compaction failed (raw rows are all kept)", self.dir)

    def _end_full(self, full: StoreFull, note: str, fields: dict[str, Any]) -> None:
        """The disk filled up: meta.json still says how the run ended (crashed, the full disk as its
        note; the parts written before are kept), or the error says it could not."""
        kept = "the rows written before it are kept"
        if note and str(full) in note:  # the loop's own note names the step: "crashed during step N: ..."
            why = f"{note}; {kept}"
        else:
            why = f"{full}; {kept}" + (f"; {note}" if note else "")
        try:
            self.update_meta(**{**fields, "status": schema.STATUS_CRASHED, "status_note": why})
        except OSError as e:
            raise StoreFull(
                f"{full}; meta.json could not be written either ({e.strerror}): it still says running"
            ) from e

    def _writer(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                table, first, df = item
                if table == _UPKEEP:
                    self._upkeep()
                    continue
                if callable(df):
                    df = df()
                # seq is only touched by this thread after __init__; it keeps growing across
                # restarts (initialised from the parts on disk) so names never collide.
                self._seq = write_parts(self.dir, {table: df}, self._seq, first_steps={table: first})
                if table in (schema.TABLE_STEPS, schema.TABLE_EVENTS):
                    self._written.setdefault(table, []).append(df)
            except BaseException as e:  # surfaced on the next flush, never lost silently
                self._error = e
            finally:
                self._q.task_done()

    def _upkeep(self) -> None:
        """After a flush's parts: summary.json, and a closed segment's compaction, rollups and
        retention (guard/store/maintain.py). A failure there is logged, never raised into training:
        raw rows stay until a later upkeep succeeds."""
        written, self._written = self._written, {}
        frames = {t: pl.concat(dfs, how="vertical_relaxed") for t, dfs in written.items()}
        try:
            first = self._maint is None
            if first:  # counts every row on disk, this flush's too (so they are not noted twice)
                self._maint = StoreMaintainer(self.dir, self._policy)
            if self._status is not None:
                self._maint.doc["status"] = self._status
            if first:
                self._maint.upkeep()
                self._maint.save()
            else:
                self._maint.wrote(frames)
        except Exception:
            log.exception("run store %s: upkeep failed (raw rows are all kept; retried next flush)", self.dir)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            if (code := full_errno(err)) is not None:  # one line, not polars' IO error text
                raise StoreFull(f"disk full: run store {full_text(self.dir, code)}") from err
            raise RuntimeError(f"run store writer failed: {err!r}") from err
