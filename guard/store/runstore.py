"""The run store: runs/<run_id>/meta.json plus Parquet tables written in chunks.

Layout (readable with `polars.scan_parquet("runs/<id>/<table>/*.parquet")`):
    runs/<run_id>/meta.json
    runs/<run_id>/<table>/part-<first_step:010d>-<seq:06d>.parquet

Part names are defined here once (`part_name` / `parse_part_name`) and every reader and writer
(this module, the collector, the app) goes through them. Both numbers are zero-padded to a
minimum width and grow past it (seq 1000000 is `part-...-1000000.parquet`), so no count can
overflow the name; order is by the parsed integers (first step, then seq), never by the string.

Why chunks written by a background thread: a step must never wait on disk, and a crash may
lose at most the rows not yet flushed, never corrupt what is there. Each part is written to a
temporary name, fsynced and renamed, so a reader sees a whole part or none.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import polars as pl

from guard.core import schema
from guard.core.events import Event
from guard.core.report import StepReport, expert_columns, layer_columns

# Minimum widths of the two numbers (older stores have exactly these; larger numbers widen).
PART_STEP_WIDTH = 10
PART_SEQ_WIDTH = 6
_PART_RE = re.compile(rf"^part-(\d{{{PART_STEP_WIDTH},}})-(\d{{{PART_SEQ_WIDTH},}})\.parquet$")


class PartName(NamedTuple):
    """A part file's numbers: the first step it holds and its writer sequence number.
    Tuples order as readers must: by first step, then seq."""

    first_step: int
    seq: int


def part_name(first_step: int, seq: int) -> str:
    """The file name of a table part (the one definition every writer uses)."""
    if first_step < 0 or seq < 0:
        raise ValueError(f"part numbers must be >= 0, got first_step={first_step}, seq={seq}")
    return f"part-{first_step:0{PART_STEP_WIDTH}d}-{seq:0{PART_SEQ_WIDTH}d}.parquet"


def parse_part_name(name: str) -> PartName | None:
    """(first step, seq) of a part file name, or None for anything else (temp files, strays)."""
    m = _PART_RE.match(name)
    return PartName(int(m.group(1)), int(m.group(2))) if m else None


def polars_schema(table: str) -> dict[str, pl.DataType]:
    return {name: getattr(pl, dtype)() for name, dtype in schema.TABLE_COLUMNS[table].items()}


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())


# Tables whose rows are built in bulk from the buffered reports at flush time.
_BULK_TABLES = {schema.TABLE_LAYERS: layer_columns, schema.TABLE_EXPERTS: expert_columns}


def _bulk_frame(table: str, reps: list[StepReport]) -> pl.DataFrame:
    return pl.DataFrame(_BULK_TABLES[table](reps), schema=polars_schema(table), strict=False)


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
        df = pl.DataFrame(self.cols, schema=polars_schema(self.table), strict=False)
        self.cols = {c: [] for c in self.cols}
        self.rows = 0
        return df


class RunStore:
    """Writer for one run. Only one process (rank 0) writes a run.

    `add_step()` / `add_event()` only append to in-memory buffers (cheap, no I/O); every
    `flush_every` steps the buffers are handed to a background thread that writes the parts.
    Events flush on the next step so a crash right after an action still records it.
    """

    def __init__(self, run_dir: str | Path, *, flush_every: int = 50, max_pending: int = 64) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for t in schema.TABLES:
            (self.dir / t).mkdir(exist_ok=True)
        self.flush_every = flush_every
        self._buffers = {t: _TableBuffer(t) for t in schema.TABLES}
        self._first_step: dict[str, int | None] = {t: None for t in schema.TABLES}
        self._seq = self._next_seq()
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
        self._buffers[schema.TABLE_STEPS].add_row(rep.steps_row())
        if len(rep.layer_ids_L):
            self._note_first(schema.TABLE_LAYERS, rep.step)
        if rep.load_ME.size:
            self._note_first(schema.TABLE_EXPERTS, rep.step)
        if len(rep.layer_ids_L) or rep.load_ME.size:
            self._reports.append(rep)
        self._since_flush += 1
        if self._since_flush >= self.flush_every or self._events_pending:
            self.flush(wait=False)

    def add_event(self, ev: Event) -> None:
        self._note_first(schema.TABLE_EVENTS, ev.step)
        self._buffers[schema.TABLE_EVENTS].add_row(ev.row())
        self._events_pending = True

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
            df: pl.DataFrame | Callable[[], pl.DataFrame] | None = buf.take()
            if t in _BULK_TABLES and reps and self._first_step[t] is not None:
                df = functools.partial(_bulk_frame, t, reps)  # built on the writer thread
            if df is not None:
                first = self._first_step[t] or 0
                self._q.put((t, first, df))
                self._first_step[t] = None
        self._since_flush = 0
        self._events_pending = False
        if wait:
            self._q.join()
            self._raise_if_failed()

    def close(self, status: str | None = None, **meta_fields: Any) -> None:
        self.flush(wait=True)
        self._q.put(None)
        self._thread.join(timeout=60)
        if status is not None or meta_fields:
            fields = dict(meta_fields)
            if status is not None:
                fields["status"] = status
            self.update_meta(**fields)

    def _next_seq(self) -> int:
        return next_part_seq(self.dir)

    def _writer(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                table, first, df = item
                if callable(df):
                    df = df()
                # seq is only touched by this thread after __init__; it keeps growing across
                # restarts (initialised from the parts on disk) so names never collide.
                path = self.dir / table / part_name(first, self._seq)
                self._seq += 1
                write_part_file(path, df)
            except BaseException as e:  # surfaced on the next flush, never lost silently
                self._error = e
            finally:
                self._q.task_done()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"run store writer failed: {err!r}") from err


# ---------------------------------------------------------------------------------------
# Readers and maintenance
# ---------------------------------------------------------------------------------------
def read_meta(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's meta.json, or None when it is missing or is not a JSON object."""
    p = Path(run_dir) / schema.META_FILE
    if not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def part_files(run_dir: str | Path, table: str) -> list[Path]:
    """A table's part files (regular files with a part name), in (first step, seq) order."""
    d = Path(run_dir) / table
    if not d.is_dir():
        return []
    named = []
    with os.scandir(d) as it:
        for e in it:
            pn = parse_part_name(e.name)
            if pn is not None and e.is_file():
                named.append((pn, Path(d, e.name)))
    return [p for _, p in sorted(named)]


def next_part_seq(run_dir: str | Path) -> int:
    """One more than the largest seq of any part of any table (0 for an empty store)."""
    seqs = [pn.seq for t in schema.TABLES for p in part_files(run_dir, t) if (pn := parse_part_name(p.name))]
    return max(seqs, default=-1) + 1


def scan_table(run_dir: str | Path, table: str) -> pl.LazyFrame:
    """Lazy scan of a table; an empty frame with the right schema when there is no part yet."""
    parts = part_files(run_dir, table)
    if not parts:
        return pl.LazyFrame(schema=polars_schema(table))
    return pl.scan_parquet([str(p) for p in parts])


def read_table(run_dir: str | Path, table: str) -> pl.DataFrame:
    return scan_table(run_dir, table).collect()


def truncate_after(run_dir: str | Path, step: int, *, archive_dir: str | Path | None = None) -> int:
    """Drop rows with step > `step` from every table (used when resuming from a checkpoint,
    so steps re-run after a crash are not stored twice). Returns the rows dropped.

    With `archive_dir`, nothing is lost: the dropped rows of each part are first written,
    fsynced, to `archive_dir/<table>/<the part's name>` (a store of the same layout), and only
    then removed from the live part. Idempotent: a retry after a failure part-way rewrites the
    same archive files and drops nothing twice."""
    dropped = 0
    for t in schema.TABLES:
        for p in part_files(run_dir, t):
            df = pl.read_parquet(p)
            if df.height == 0 or df["step"].max() <= step:  # type: ignore[operator]
                continue
            keep = df.filter(pl.col("step") <= step)
            dropped += df.height - keep.height
            if archive_dir is not None:  # durable (file and name) before the live rows go
                dest = Path(archive_dir) / t
                dest.mkdir(parents=True, exist_ok=True)
                write_part_file(dest / p.name, df.filter(pl.col("step") > step))
                fsync_dir(dest)
            if keep.height == 0:
                p.unlink()
            else:
                write_part_file(p, keep)
    return dropped


def fsync_dir(d: str | Path) -> None:
    """Make the names created in, or renamed into, folder `d` durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_part_file(path: Path, df: pl.DataFrame) -> None:
    """Write a part atomically: temp name, fsync, rename (a reader sees all of it or none)."""
    tmp = path.with_name(f".{path.name}.tmp")
    df.write_parquet(tmp, compression="zstd", statistics=True)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_runs(runs_dir: str | Path) -> list[Path]:
    d = Path(runs_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and (p / schema.META_FILE).is_file())


def add_rows_iter(store: RunStore, reports: Iterable[StepReport]) -> None:
    for r in reports:
        store.add_step(r)
