"""The run-store layout, defined once: where things live, how parts are named, how files land.

    runs/<run_id>/meta.json
    runs/<run_id>/<table>/part-<first_step:010d>-<seq:06d>.parquet

readable with `polars.scan_parquet("runs/<id>/<table>/*.parquet")`. Every reader and writer
(the in-process run store, the collector, the app, replay) goes through `part_name` /
`parse_part_name` / `part_files`. Both numbers are zero-padded to a minimum width and grow past
it (seq 1000000 is `part-...-1000000.parquet`), so no count can overflow the name; order is by
the parsed integers (first step, then seq), never by the string.

Files land atomically: written to a temporary name, fsynced, renamed, so a reader sees a whole
file or none; `fsync_dir` makes the new name itself durable.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import polars as pl

from guard.core import schema

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


def sorted_part_names(table_dir: str | Path) -> tuple[str, ...]:
    """Names of the part files (regular files with a part name) in a table folder, in
    (first step, seq) order; () when the folder does not exist. Sorting (PartName, str) pairs,
    not Path objects: thousands of parts sort in well under a millisecond."""
    try:
        with os.scandir(table_dir) as it:
            named = [(pn, e.name) for e in it if (pn := parse_part_name(e.name)) is not None and e.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        return ()
    return tuple(name for _, name in sorted(named))


def part_files(run_dir: str | Path, table: str) -> list[Path]:
    """A table's part files, in (first step, seq) order."""
    d = Path(run_dir) / table
    return [d / n for n in sorted_part_names(d)]


def next_part_seq(run_dir: str | Path) -> int:
    """One more than the largest seq of any part of any table (0 for an empty store)."""
    names = (n for t in schema.TABLES for n in sorted_part_names(Path(run_dir) / t))
    seqs = [pn.seq for n in names if (pn := parse_part_name(n)) is not None]
    return max(seqs, default=-1) + 1


def polars_schema(table: str) -> dict[str, pl.DataType]:
    """The table's columns as polars types (guard/core/schema.py names them once)."""
    return {name: getattr(pl, dtype)() for name, dtype in schema.TABLE_COLUMNS[table].items()}


def fsync_dir(d: str | Path) -> None:
    """Make the names created in, or renamed into, folder `d` durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: temp name, fsync, rename. A failed write (a full disk)
    leaves no temp file behind."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise


def discard(tmp: Path) -> None:
    """Remove a temp file a failed write left (it may not exist; a failure here changes nothing)."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())


def run_dir_problem(run_dir: str | Path) -> str | None:
    """Why a run can't be written to `run_dir` (None when it can): it is a file, a file sits
    where one of its parents should be, or the nearest existing folder takes no new entries.
    Leaves nothing behind: the write test creates and removes a temporary folder."""
    import tempfile

    d = Path(run_dir)
    if d.exists() and not d.is_dir():
        return "it is a file, not a folder"
    top = d
    while not top.exists():  # the nearest existing ancestor decides whether the rest can be made
        if top.parent == top:
            break
        top = top.parent
    if top.exists() and not top.is_dir():
        return f"{str(top)!r} is a file, so no folder can be made under it"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".moeguard-probe-", dir=top))
    except OSError as e:
        return f"cannot write in {str(top)!r} ({e.strerror})"
    return None
