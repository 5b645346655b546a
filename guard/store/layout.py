"""The run-store layout, defined once: where things live, how parts are named, which are live,
how files land.

    runs/<run_id>/meta.json
    runs/<run_id>/summary.json                        (guard/store/summary.py; absent in old stores)
    runs/<run_id>/<table>/part-<first_step:010d>-<seq:06d>.parquet
    runs/<run_id>/<table>/part-<first:010d>-<hi:06d>-<lo:06d>-<last:010d>.parquet   (compacted)
    runs/<run_id>/rollups/<table>-r<res>/part-....parquet  (ROLLUP_RESOLUTIONS; same names)

readable with `polars.scan_parquet("runs/<id>/<table>/*.parquet")` once no compaction is half
done. Every reader and writer (the in-process run store, the collector, the app, replay) goes
through `part_name` / `parse_part_name` / `part_files`. The numbers are zero-padded to a
minimum width and grow past it (seq 1000000 is `part-...-1000000.parquet`), so no count can
overflow the name; order is by the parsed integers (first step, then seq), never by the string.

Compaction and the LIVE rule (guard/store/compaction.py writes compacted parts). A compacted
part `part-<first>-<hi>-<lo>-<last>` holds every row of the parts it replaced: those of its
folder whose seq lies in [lo, hi] and whose first step lies in [first, last]. A part is LIVE
unless a compacted part of the same folder covers it that way (a compacted part covers a smaller
compacted part too). `part_files` / `rollup_part_files` list live parts only, so the order
"write the merged part (temp name, fsync, rename, fsync folder), then delete its inputs" is
right for every reader at every instant: before the rename the inputs are live, after it the
merged part is, and inputs a crash left behind are hidden (never read twice) and deleted by the
next compaction or writer open (`remove_hidden`). Seqs only grow, so a part written after a
compaction (a late event) is never covered by it; the next compaction of that span merges it.
A part rewritten in place under the same name (retention dropping rolled-up rows, resume
truncation) is replaced atomically by rename.

Files land atomically: written to a temporary name, fsynced, renamed, so a reader sees a whole
file or none; `fsync_dir` makes the new name itself durable.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

import polars as pl

from guard.core import schema

# Minimum widths of the two numbers (older stores have exactly these; larger numbers widen).
PART_STEP_WIDTH = 10
PART_SEQ_WIDTH = 6
_PART_RE = re.compile(
    rf"^part-(\d{{{PART_STEP_WIDTH},}})-(\d{{{PART_SEQ_WIDTH},}})"
    rf"(?:-(\d{{{PART_SEQ_WIDTH},}})-(\d{{{PART_STEP_WIDTH},}}))?\.parquet$"
)

# Rollup resolutions in steps (guard/store/rollup.py): each coarser tier is built from the rows
# of one closed segment, and SEGMENT_STEPS is a multiple of every resolution, so a segment closes
# every tier's buckets at once. The step ranges a compaction merges are SEGMENT_STEPS long.
ROLLUP_RESOLUTIONS = (10, 100, 1000)
SEGMENT_STEPS = 1000
ROLLUP_DIR = "rollups"


class PartName(NamedTuple):
    """A part file's numbers: the first step it holds and its writer sequence number (a compacted
    part's largest input seq). Tuples order as readers must: by first step, then seq."""

    first_step: int
    seq: int


class PartInfo(NamedTuple):
    """Everything a part's name says. A plain part: lo == seq, last == first_step. A compacted
    part covers the parts of its folder with seq in [lo, seq] and first step in [first_step, last]."""

    first_step: int
    seq: int
    lo: int
    last: int
    compacted: bool


def part_name(first_step: int, seq: int) -> str:
    """The file name of a table part (the one definition every writer uses)."""
    if first_step < 0 or seq < 0:
        raise ValueError(f"part numbers must be >= 0, got first_step={first_step}, seq={seq}")
    return f"part-{first_step:0{PART_STEP_WIDTH}d}-{seq:0{PART_SEQ_WIDTH}d}.parquet"


def compacted_part_name(first_step: int, last_step: int, lo: int, hi: int) -> str:
    """The name of a part that replaces every part of its folder with seq in [lo, hi] and first
    step in [first_step, last_step] (guard/store/compaction.py)."""
    if not (0 <= first_step <= last_step and 0 <= lo <= hi):
        raise ValueError(f"bad compacted part range: steps {first_step}..{last_step}, seqs {lo}..{hi}")
    return (
        f"part-{first_step:0{PART_STEP_WIDTH}d}-{hi:0{PART_SEQ_WIDTH}d}"
        f"-{lo:0{PART_SEQ_WIDTH}d}-{last_step:0{PART_STEP_WIDTH}d}.parquet"
    )


def parse_part(name: str) -> PartInfo | None:
    """Everything a part file name says, or None for anything else (temp files, strays)."""
    m = _PART_RE.match(name)
    if m is None:
        return None
    first, seq = int(m.group(1)), int(m.group(2))
    if m.group(3) is None:
        return PartInfo(first, seq, seq, first, False)
    lo, last = int(m.group(3)), int(m.group(4))
    if lo > seq or last < first:
        return None
    return PartInfo(first, seq, lo, last, True)


def parse_part_name(name: str) -> PartName | None:
    """(first step, seq) of a part file name, or None for anything else (temp files, strays)."""
    p = parse_part(name)
    return PartName(p.first_step, p.seq) if p is not None else None


def _covers(c: PartInfo, p: PartInfo) -> bool:
    return (
        c.compacted and c != p and c.lo <= p.lo and p.seq <= c.seq and c.first_step <= p.first_step <= c.last
    )


def _split_live(
    infos: list[tuple[PartInfo, str]],
) -> tuple[list[tuple[PartInfo, str]], list[tuple[PartInfo, str]]]:
    """(live, hidden) by the LIVE rule (module docstring). O(n log n) plus the covered parts."""
    if not any(pi.compacted for pi, _ in infos):
        return infos, []
    by_lo = sorted(infos, key=lambda x: x[0].lo)
    los = [pi.lo for pi, _ in by_lo]
    hidden: set[str] = set()
    for c, _ in infos:
        if not c.compacted:
            continue
        for pi, name in by_lo[bisect.bisect_left(los, c.lo) : bisect.bisect_right(los, c.seq)]:
            if name not in hidden and _covers(c, pi):
                hidden.add(name)
    return [x for x in infos if x[1] not in hidden], [x for x in infos if x[1] in hidden]


def _scan_parts(table_dir: str | Path) -> list[tuple[PartInfo, str]]:
    try:
        with os.scandir(table_dir) as it:
            return [(pi, e.name) for e in it if (pi := parse_part(e.name)) is not None and e.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        return []


def sorted_part_names(table_dir: str | Path) -> tuple[str, ...]:
    """Names of the LIVE part files (regular files with a part name, not covered by a compacted
    part) in a table folder, in (first step, seq) order; () when the folder does not exist."""
    live, _ = _split_live(_scan_parts(table_dir))
    return tuple(name for _, name in sorted(((pi.first_step, pi.seq), n) for pi, n in live))


def newest_part_names(
    table_dir: str | Path, from_step: int, before: int = 0, limit: int | None = None
) -> tuple[str, ...]:
    """Names of the live parts whose first step is >= `from_step`, and of the `before` newest
    parts before them, in (first step, seq) order: a month-long run's open segment without
    parsing its 1,000 older names (the Runs page). With `limit`, only the newest `limit` of those
    (the collector's open segment holds a part per checkpoint, up to ~1,000: listing and stat()ing
    them all at every save made its saves quadratic in the segment). The folder is listed
    (os.listdir) and its names sorted as strings (C speed): zero-padded first steps order as
    numbers below 10**10 steps; past that every name is parsed."""
    try:
        names = os.listdir(table_dir)
    except (FileNotFoundError, NotADirectoryError):
        return ()
    if from_step >= 10 ** (PART_STEP_WIDTH - 1):  # names may be wider than the minimum: parse all
        pick = names
    else:
        names.sort()
        i = bisect.bisect_left(names, f"part-{from_step:0{PART_STEP_WIDTH}d}")
        j = bisect.bisect_left(names, "part-")  # temp files (".compact-...", ".part-...") sort first
        # a few extra older names: some may be hidden (covered by a compacted part)
        pick = names[max(j, i - 4 * before) :] if before else names[i:]
        if limit is not None:  # the newest names only, with the same slack for hidden ones
            pick = pick[-(limit + 4 * before) :]
    infos = [(pi, n) for n in pick if (pi := parse_part(n)) is not None]
    infos = [x for x in infos if os.path.isfile(os.path.join(table_dir, x[1]))]
    live, _ = _split_live(infos)
    ordered = sorted(((pi.first_step, pi.seq), n) for pi, n in live)
    newer = [n for k, n in ordered if k[0] >= from_step]
    older = [n for k, n in ordered if k[0] < from_step][-before:] if before else []
    out = older + newer
    return tuple(out[-limit:] if limit is not None else out)


def live_parts(table_dir: str | Path) -> list[tuple[PartInfo, Path]]:
    """The live parts of a folder with what their names say, in (first step, seq) order."""
    live, _ = _split_live(_scan_parts(table_dir))
    d = Path(table_dir)
    return [(pi, d / n) for pi, n in sorted(live, key=lambda x: (x[0].first_step, x[0].seq))]


def hidden_part_files(table_dir: str | Path) -> list[Path]:
    """Parts a compacted part covers (inputs a compaction had not deleted yet, or a crash left)."""
    _, hidden = _split_live(_scan_parts(table_dir))
    return [Path(table_dir) / n for _, n in hidden]


def remove_hidden(table_dir: str | Path, *, grace_s: float = 0.0) -> int:
    """Delete the hidden parts of a folder whose covering part is older than `grace_s` (a reader
    that listed the folder just before a compaction may still be reading them). Returns how many."""
    infos = _scan_parts(table_dir)
    live, hidden = _split_live(infos)
    if not hidden:
        return 0
    d = Path(table_dir)
    now = time.time()
    n = 0
    for pi, name in hidden:
        coverers = [d / cn for c, cn in live if _covers(c, pi)]
        try:
            young = grace_s > 0 and any(now - c.stat().st_mtime < grace_s for c in coverers)
        except OSError:
            young = True
        if young:
            continue
        try:
            (d / name).unlink()
            n += 1
        except FileNotFoundError:
            pass
    if n:
        fsync_dir(d)
    return n


def part_files(run_dir: str | Path, table: str) -> list[Path]:
    """A table's LIVE part files, in (first step, seq) order."""
    d = Path(run_dir) / table
    return [d / n for n in sorted_part_names(d)]


def rollup_table_dir(run_dir: str | Path, table: str, res: int) -> Path:
    """Where a table's rollup at `res` steps lives: run_dir/rollups/<table>-r<res>."""
    return Path(run_dir) / ROLLUP_DIR / f"{table}-r{res}"


def rollup_part_files(run_dir: str | Path, table: str, res: int) -> list[Path]:
    """A rollup table's LIVE part files, in (first step, seq) order ([] when it has none)."""
    d = rollup_table_dir(run_dir, table, res)
    return [d / n for n in sorted_part_names(d)]


def rollup_resolutions(run_dir: str | Path, table: str) -> list[int]:
    """The resolutions at which the run has rollup rows of `table` ([] for a store without)."""
    return [r for r in ROLLUP_RESOLUTIONS if sorted_part_names(rollup_table_dir(run_dir, table, r))]


def segment_of(step: int) -> int:
    """The compaction / rollup segment a step belongs to."""
    return step // SEGMENT_STEPS


def next_part_seq(run_dir: str | Path) -> int:
    """One more than the largest seq of any part of any table (0 for an empty store)."""
    names = (n for t in schema.TABLES for n in sorted_part_names(Path(run_dir) / t))
    seqs = [pn.seq for n in names if (pn := parse_part_name(n)) is not None]
    return max(seqs, default=-1) + 1


def polars_schema(table: str) -> dict[str, pl.DataType]:
    """The table's columns as polars types (guard/core/schema.py names them once)."""
    return {name: getattr(pl, dtype)() for name, dtype in schema.TABLE_COLUMNS[table].items()}


def rollup_polars_schema(table: str) -> dict[str, pl.DataType]:
    """A rollup table's columns as polars types (schema.rollup_columns names them once)."""
    return {name: getattr(pl, dtype)() for name, dtype in schema.rollup_columns(table).items()}


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
