"""The one tolerant run-store reader: the app, `moeguard replay`, the collector and the trainer
read runs through it.

Tolerant of what older or partial writers leave: a meta.json that is missing or not a JSON
object reads as None; a table with no part yet scans as an empty frame of the right schema;
a part written before a column existed gets that column as nulls (and extra columns are
ignored); stray files in a table folder (temp names, anything not named like a part) are
never read; a damaged part (truncated by a crash, a full disk or a copy in progress, or not
Parquet at all) is skipped with a `DamagedPartWarning` naming the file, and the rest of the table
and every other run still read (`damaged_parts` lists them for the app and `moeguard replay`).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import polars as pl

from guard.core import actions, schema
from guard.core.report import StepReport
from guard.core.rows import reports_from_columns
from guard.store import layout, summary
from guard.store.damage import (  # noqa: F401 (the damage checks, re-exported: readers call reader.X)
    DamagedPart,
    DamagedPartWarning,
    PartGone,
    damaged_parts,
    forget_checks,
    forget_gone,
    good_parts,
    newest_damaged,
    part_problem,
    part_truncated,
)
from guard.store.layout import parse_part_name, part_files, polars_schema, sorted_part_names

_T = TypeVar("_T")


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


def list_runs(runs_dir: str | Path) -> list[Path]:
    """Run folders (those with a meta.json) under `runs_dir`, by name."""
    d = Path(runs_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and (p / schema.META_FILE).is_file())


def has_part(run_dir: str | Path, table: str) -> bool:
    """True when the table has at least one part file (stops at the first)."""
    try:
        with os.scandir(Path(run_dir) / table) as it:
            return any(parse_part_name(e.name) is not None and e.is_file() for e in it)
    except OSError:
        return False


def cached_part_files(run_dir: str | Path, table: str) -> list[Path]:
    """`part_files`, remembered until the table folder's mtime changes: for a reader that lists
    the same long run over and over (the app). A listing made within RACY_NS of the folder's
    last change is not reused (`settled`): writers and tests use `part_files`."""
    d = os.path.join(run_dir, table)
    try:
        mtime = os.stat(d).st_mtime_ns
    except OSError:
        return []
    return [Path(d, n) for n in _cached_names(d, mtime)]


# A folder's mtime moves in the kernel's clock ticks (a few ms), not per change: a listing taken
# in the same tick as a part's rename into the folder misses that part, and the folder then keeps
# the mtime the listing was keyed by. (The app's Live mode hit it: a run's last 50 steps never
# showed, as nothing wrote to the folder again.) So a listing, or any cache key built on a
# folder's mtime, is trusted only once it was taken this long after that mtime: git's "racy
# clean" rule. A second of margin also covers file systems with coarser timestamps than ext4's.
RACY_NS = 1_000_000_000


def settled(mtime_ns: int, now_ns: int | None = None) -> bool:
    """Whether a look at a folder taken at `now_ns` (default: now) saw every change made in its
    mtime's tick: a cache keyed by that mtime may reuse what it saw."""
    return (time.time_ns() if now_ns is None else now_ns) - mtime_ns >= RACY_NS


# table folder -> (mtime_ns, part names, settled): one entry per folder listed (no bound to fall
# off: the Runs page of 1,000 runs lists 6,000 folders and must not re-list them on every rerun).
_listings: dict[str, tuple[int, tuple[str, ...], bool]] = {}


def _cached_names(table_dir: str, mtime_ns: int) -> tuple[str, ...]:
    hit = _listings.get(table_dir)
    if hit is not None and hit[0] == mtime_ns and hit[2]:
        return hit[1]
    listed_at = time.time_ns()  # before the listing: a rename after it may share mtime_ns's tick
    names = sorted_part_names(table_dir)
    _listings[table_dir] = (mtime_ns, names, settled(mtime_ns, listed_at))
    forget_gone(table_dir, names)
    return names


def clear_cache() -> None:
    """Forget the remembered part listings (`cached_part_files`) and footer checks."""
    _listings.clear()
    forget_checks()


def scan_table(
    run_dir: str | Path, table: str, parts: list[Path] | None = None, *, cached: bool = False
) -> pl.LazyFrame:
    """Lazy scan of a table (or of the given `parts` of it); an empty frame with the right
    schema when there is no part. Columns an older writer did not have come back as nulls.
    `cached`: list the parts with `cached_part_files`."""
    if parts is None:
        parts = cached_part_files(run_dir, table) if cached else part_files(run_dir, table)
    sch = polars_schema(table)
    parts = good_parts(parts)
    if not parts:
        return pl.LazyFrame(schema=sch)
    return pl.scan_parquet(
        [str(p) for p in parts], schema=sch, missing_columns="insert", extra_columns="ignore"
    )


def parts_overlapping(parts: list[Path], lo: int | None, hi: int | None) -> list[Path]:
    """The parts (in (first step, seq) order) that may hold steps in [lo, hi]: a part is named by
    its first step and holds steps up to the next part's, so the last part starting at or before
    `lo` and every later one starting at or before `hi` (None: unbounded). Names only, no I/O."""
    if not parts or (lo is None and hi is None):
        return parts
    firsts = [pn.first_step if (pn := parse_part_name(p.name)) is not None else 0 for p in parts]
    start = 0
    if lo is not None:
        i = bisect.bisect_right(firsts, lo) - 1
        start = bisect.bisect_left(firsts, firsts[i]) if i >= 0 else 0
    stop = len(parts) if hi is None else bisect.bisect_right(firsts, hi)
    return parts[start:stop]


def scan_steps(
    run_dir: str | Path,
    table: str,
    lo: int | None = None,
    hi: int | None = None,
    *,
    parts: list[Path] | None = None,
    cached: bool = False,
) -> pl.LazyFrame:
    """`scan_table` of the rows with lo <= step <= hi, opening only the parts whose names say
    they can hold such steps; the step filter is pushed down to Parquet's row-group statistics."""
    if parts is None:
        parts = cached_part_files(run_dir, table) if cached else part_files(run_dir, table)
    lf = scan_table(run_dir, table, parts_overlapping(parts, lo, hi))
    if lo is not None:
        lf = lf.filter(pl.col("step") >= lo)
    if hi is not None:
        lf = lf.filter(pl.col("step") <= hi)
    return lf


# ---- series at the resolution a chart needs ----------------------------------------------
ROLLUP_AGGS = schema.ROLLUP_STATS  # a rollup's value columns: c_mean, c_min, c_max, c_last
SERIES_KEYS: dict[str, tuple[str, ...]] = {schema.TABLE_STEPS: (), **schema.ROLLUP_KEYS}


@dataclass(frozen=True, slots=True)
class Series:
    """What `read_series` read: `frame` has the table's key columns, `step` (the bucket's first
    step: step // resolution * resolution), `step_lo` / `step_hi` (the steps the bucket saw), `n`
    (rows in it), and for each value column c: c_mean, c_min, c_max, c_last. `resolution` is
    the steps a row covers (1: every step, read from the full-fidelity rows)."""

    frame: pl.DataFrame
    resolution: int
    lo: int
    hi: int


def rollup_resolutions(run_dir: str | Path, table: str) -> list[int]:
    """The rollup resolutions the table has parts at (none in a store written before rollups)."""
    if table not in schema.ROLLUP_KEYS:
        return []
    return [r for r in layout.ROLLUP_RESOLUTIONS if rollup_parts(run_dir, table, r)]


def rollup_parts(run_dir: str | Path, table: str, res: int) -> list[Path]:
    """The live parts of one rollup resolution of a table, in order (listed with the app's
    per-folder cache)."""
    d = layout.rollup_table_dir(run_dir, table, res)
    try:
        mtime = os.stat(d).st_mtime_ns
    except OSError:
        return []
    return [Path(d, n) for n in _cached_names(str(d), mtime)]


def full_fidelity_ranges(run_dir: str | Path) -> list[tuple[int, int]]:
    """Inclusive step ranges in which every raw layers/experts/groups/ranks row of the run is
    kept. A store without summary.json (written before retention existed) kept everything: its
    whole step range ([] when it has no step)."""
    doc = summary.read_summary(run_dir)
    if doc is not None and isinstance(doc.get("full_fidelity"), list):
        return [(int(lo), int(hi)) for lo, hi in doc["full_fidelity"]]
    # a fallback for old stores only
    lo, hi = (
        scan_table(run_dir, schema.TABLE_STEPS)
        .select(pl.col("step").min().alias("lo"), pl.col("step").max().alias("hi"))
        .collect()
        .row(0)
    )
    return [] if lo is None else [(int(lo), int(hi))]


def raw_ranges(run_dir: str | Path) -> list[tuple[int, int]] | None:
    """The step ranges (inclusive) whose every row is kept at full fidelity; None when the whole
    run is (a store without summary.json was written before retention and kept every row)."""
    if summary.read_summary(run_dir) is None:
        return None
    return full_fidelity_ranges(run_dir)


def _covered(ranges: list[tuple[int, int]] | None, lo: int, hi: int) -> bool:
    return ranges is None or any(a <= lo and hi <= b for a, b in ranges)


def run_step_range(run_dir: str | Path) -> tuple[int, int] | None:
    """(first, last) step of the run: from summary.json when the writer keeps one, else from the
    steps table's first and newest parts (two small reads, never the whole table)."""
    summ = summary.read_summary(run_dir)
    if summ is not None:
        a, b = summ.get("first_step"), summ.get("last_step")
        if isinstance(a, int) and isinstance(b, int) and b >= a:
            return a, b
    parts = good_parts(cached_part_files(run_dir, schema.TABLE_STEPS))
    if not parts:
        return None
    ends = (
        scan_table(run_dir, schema.TABLE_STEPS, list(dict.fromkeys([parts[0], *parts[-3:]])))
        .select(pl.col("step").min().alias("a"), pl.col("step").max().alias("b"))
        .collect()
    )
    a, b = ends["a"][0], ends["b"][0]
    return None if a is None or b is None else (int(a), int(b))


def read_series(
    run_dir: str | Path,
    table: str,
    *,
    columns: tuple[str, ...] | list[str],
    lo: int | None = None,
    hi: int | None = None,
    max_points: int = 2000,
    where: pl.Expr | None = None,
) -> Series:
    """The table's `columns` over steps [lo, hi] (default: the whole run) at the coarsest detail a
    chart of `max_points` columns can show, reading only that.

    Every step (resolution 1) when [lo, hi] spans at most `max_points` steps and is kept at full
    fidelity (always, in a store without rollups); else the finest rollup (10, 100, 1,000 steps)
    with at most `max_points` buckets in [lo, hi] (the coarsest when none is that few). The
    rollups keep each bucket's min and max, so a one-step spike or a dead expert anywhere in the
    run shows in the extremes at every resolution. Steps past what a rollup covers yet (the live
    tail) are read from the next finer rollup, or the full-fidelity rows, and bucketed the same
    way. Only parts whose names say they can hold [lo, hi] are opened; `where` (a filter on key
    columns, e.g. one layer) and the step range are pushed down to Parquet."""
    cols = tuple(columns)
    if lo is None or hi is None:
        span = run_step_range(run_dir)
        if span is None:
            return Series(_empty_series(table, cols), 1, 0, -1)
        lo = span[0] if lo is None else lo
        hi = span[1] if hi is None else hi
    res = pick_resolution(run_dir, table, lo, hi, max_points)
    frame = _read_at(run_dir, table, cols, lo, hi, res, [1, *rollup_resolutions(run_dir, table)], where)
    return Series(frame, res, lo, hi)


def pick_resolution(run_dir: str | Path, table: str, lo: int, hi: int, max_points: int = 2000) -> int:
    """The resolution read_series reads [lo, hi] at (1: every step). Names and summary.json only."""
    have = rollup_resolutions(run_dir, table)
    whole = table not in schema.THINNED_TABLES  # the steps table's raw rows are all kept
    if not have or (hi - lo + 1 <= max_points and (whole or _covered(raw_ranges(run_dir), lo, hi))):
        return 1
    # a finer rollup may be kept for the newest steps only (policy r10_window_steps): one that
    # does not reach back to `lo` is skipped for a coarser one that does
    starts = {r: _first_step(rollup_parts(run_dir, table, r)) for r in have}
    reach = [r for r in have if starts[r] <= lo] or [min(have, key=lambda r: (starts[r], r))]
    fits = [r for r in reach if math.ceil((hi - lo + 1) / r) <= max_points]
    return fits[0] if fits else reach[-1]


def _read_at(
    run_dir: str | Path,
    table: str,
    cols: tuple[str, ...],
    lo: int,
    hi: int,
    res: int,
    finer: list[int],
    where: pl.Expr | None,
) -> pl.DataFrame:
    """Rows of [lo, hi] at `res` (1: raw rows in the series shape); the part of the range the
    rollup does not cover yet comes from the next finer resolution, re-bucketed."""
    keys = SERIES_KEYS[table]
    if res == 1:
        lf = scan_steps(run_dir, table, lo, hi, cached=True)
        if where is not None:
            lf = lf.filter(where)
        return lf.select(
            *keys,
            "step",
            *(pl.col("step").alias(c) for c in ("step_lo", "step_hi")),
            pl.lit(1, pl.Int32).alias("n"),
            *(pl.col(c).alias(f"{c}_{a}") for c in cols for a in ROLLUP_AGGS),
        ).collect()
    parts = rollup_parts(run_dir, table, res)
    lf = _scan_rollup(parts, table, cols, lo, hi)
    if where is not None:
        lf = lf.filter(where)
    got = lf.collect()
    covered = _rollup_hi(parts)
    if covered is None or covered >= hi:
        return got
    below = [r for r in finer if r < res]
    tail = _read_at(run_dir, table, cols, max(lo, covered + 1), hi, below[-1], below, where)
    if tail.height == 0:
        return got
    both = pl.concat([got, tail.select(got.columns)], how="vertical_relaxed") if got.height else tail
    return rebucket(both, keys, cols, res)


def _scan_rollup(parts: list[Path], table: str, cols: tuple[str, ...], lo: int, hi: int) -> pl.LazyFrame:
    keys = SERIES_KEYS[table]
    want = [*keys, "step", "step_lo", "step_hi", "n", *(f"{c}_{a}" for c in cols for a in ROLLUP_AGGS)]
    parts = good_parts(parts_overlapping(parts, lo, hi))
    if not parts:
        return pl.LazyFrame(schema=_series_schema(table, cols))
    lf = pl.scan_parquet([str(p) for p in parts], missing_columns="insert", extra_columns="ignore")
    # a bucket belongs to [lo, hi] when the steps it saw overlap it
    return lf.filter((pl.col("step_hi") >= lo) & (pl.col("step_lo") <= hi)).select(want)


def _first_step(parts: list[Path]) -> int:
    """The first step a rollup's oldest part holds (its name says; no I/O)."""
    pn = parse_part_name(parts[0].name) if parts else None
    return pn.first_step if pn is not None else 0


def _rollup_hi(parts: list[Path]) -> int | None:
    """The last step the rollup covers: the largest step_hi of its newest part (one small read)."""
    for p in reversed(good_parts(parts)):
        v = pl.scan_parquet(str(p)).select(pl.col("step_hi").max()).collect().item()
        if v is not None:
            return int(v)
    return None


def rebucket(df: pl.DataFrame, keys: tuple[str, ...], cols: tuple[str, ...], res: int) -> pl.DataFrame:
    """Series rows (any resolution) merged into `res`-step buckets: means weighted by rows,
    extremes of the extremes, the last value of the last row."""
    n = pl.col("n").cast(pl.Float64)

    def mean(c: str) -> pl.Expr:  # NaN is left out of a mean, as the rollups do
        m = pl.col(f"{c}_mean").cast(pl.Float64).fill_nan(None)
        return ((m * n).sum() / n.filter(m.is_not_null()).sum()).alias(f"{c}_mean")

    aggs: list[pl.Expr] = [
        pl.col("step_lo").min(),
        pl.col("step_hi").max(),
        pl.col("n").sum(),
    ]
    for c in cols:
        aggs += [
            mean(c),
            pl.col(f"{c}_min").min(),
            pl.col(f"{c}_max").max(),
            pl.col(f"{c}_last").sort_by("step_hi").last(),
        ]
    return (
        df.with_columns(step=pl.col("step") // res * res)
        .group_by(*keys, "step")
        .agg(aggs)
        .sort(*keys, "step")
    )


def _series_schema(table: str, cols: tuple[str, ...]) -> dict[str, pl.DataType]:
    raw = polars_schema(table)
    out: dict[str, pl.DataType] = {k: raw[k] for k in SERIES_KEYS[table]}
    out.update({"step": pl.Int64(), "step_lo": pl.Int64(), "step_hi": pl.Int64(), "n": pl.Int32()})
    for c in cols:
        out.update(
            {f"{c}_{a}": (raw[c] if a in ("min", "max", "last") else pl.Float64()) for a in ROLLUP_AGGS}
        )
    return out


def _empty_series(table: str, cols: tuple[str, ...]) -> pl.DataFrame:
    return pl.DataFrame(schema=_series_schema(table, cols))


def read_table(run_dir: str | Path, table: str) -> pl.DataFrame:
    return scan_table(run_dir, table).collect()


def missing_columns(run_dir: str | Path, table: str) -> list[str]:
    """Columns of the current schema that the table's first part lacks (older writers)."""
    parts = good_parts(cached_part_files(run_dir, table))
    if not parts:
        return []
    have = set(pl.read_parquet_schema(parts[0]))
    return [c for c in schema.TABLE_COLUMNS[table] if c not in have]


def last_step(run_dir: str | Path) -> int:
    """The largest step in the `steps` table, -1 when it has none."""
    if not part_files(run_dir, schema.TABLE_STEPS):
        return -1
    v = scan_table(run_dir, schema.TABLE_STEPS).select(pl.col("step").max()).collect().item()
    return -1 if v is None else int(v)


# Expert rows held at once by `read_reports` (about 60 MB of polars and numpy columns): a
# month-long run is replayed window by window, never whole (Trinity's shape is 14,848 expert
# rows a step, 14.8 billion for 1M steps).
REPORT_ROW_BOUND = 1_000_000


class Listing:
    """The part files of some tables of a run, listed once and read many times (a replay streams
    a run window by window). `read(fn)` runs `fn`, which reads through `parts`; when a part it
    listed is gone (PartGone, or polars' FileNotFoundError: a compaction of a live run merged or
    retired it since, guard/store/compaction.py) it lists again and re-runs `fn`, up to
    `retries` times. A merged part holds the rows of the parts it replaced, so nothing is lost
    or read twice."""

    def __init__(self, run_dir: str | Path, tables: tuple[str, ...], retries: int = 3) -> None:
        self.run_dir, self.tables, self.retries = run_dir, tables, retries
        self.parts = self._list()

    def _list(self) -> dict[str, list[Path]]:
        return {t: part_files(self.run_dir, t) for t in self.tables}

    def read(self, fn: Callable[[], _T]) -> _T:
        for _ in range(self.retries):
            try:
                return fn()
            except FileNotFoundError:
                self.parts = self._list()
        return fn()  # the last try: a part still gone is an error of its own


def read_reports(run_dir: str | Path, *, row_bound: int = REPORT_ROW_BOUND) -> Iterator[StepReport]:
    """StepReports rebuilt from the steps, layers, experts and groups tables, in step order
    (guard/core/rows.py is the mapping), streamed: a window of steps at a time, sized so that at
    most about `row_bound` expert rows are held, each table read only from the parts whose names
    say they hold the window (guard/store/layout.py names parts by their first step)."""
    listing = Listing(run_dir, tuple(_REPORT_TABLES))

    def plan() -> tuple[Any, Any, int]:
        steps_all = scan_table(run_dir, schema.TABLE_STEPS, listing.parts[schema.TABLE_STEPS]).select("step")
        bounds = steps_all.select(
            pl.col("step").min().alias("lo"), pl.col("step").max().alias("hi")
        ).collect()
        per_step = rows_per_step(run_dir, schema.TABLE_EXPERTS, listing.parts[schema.TABLE_EXPERTS])
        return bounds["lo"][0], bounds["hi"][0], max(1, row_bound // max(1, per_step))

    lo, hi, window = listing.read(plan)
    if lo is None or hi is None:
        return
    for a in range(int(lo), int(hi) + 1, window):
        b = min(a + window - 1, int(hi))
        got = listing.read(
            lambda a=a, b=b: {
                t: scan_steps(run_dir, t, a, b, parts=listing.parts[t]).sort("step", *keys).collect()
                for t, keys in _REPORT_TABLES.items()
            }
        )
        if not got[schema.TABLE_STEPS].height:
            continue
        yield from reports_from_columns(
            got[schema.TABLE_STEPS].to_dict(as_series=False),
            *({c: df[c].to_numpy() for c in df.columns} for t, df in got.items() if t != schema.TABLE_STEPS),
        )
        del got


_REPORT_TABLES: dict[str, tuple[str, ...]] = {  # the tables a StepReport is rebuilt from, by sort keys
    schema.TABLE_STEPS: (),
    schema.TABLE_LAYERS: ("layer",),
    schema.TABLE_EXPERTS: ("layer", "expert"),
    schema.TABLE_GROUPS: ("group",),
}


def rows_per_step(run_dir: str | Path, table: str, parts: list[Path]) -> int:
    """Rows a step of the table (0 when it has none), from the newest part that holds more than
    one step (a checkpoint's one-step part says little), else the newest that reads."""
    best = 0
    for p in reversed(good_parts(parts[-4:])):
        st = scan_table(run_dir, table, [p]).select(pl.len().alias("n"), pl.col("step").n_unique().alias("s"))
        n, s = st.collect().row(0)
        if n:
            best = max(1, int(n) // max(1, int(s)))
            if s > 1:
                break
    return best


def count_actions(run_dir: str | Path) -> dict[str, int]:
    """Guard actions of a stored run, counted from its `steps` and `events` tables by the one
    definition of what counts (guard/core/actions.py)."""
    steps = scan_table(run_dir, schema.TABLE_STEPS).select("action")
    step_actions = list(actions.STEP_ACTIONS)
    per_step = steps.filter(pl.col("action").is_in(step_actions)).group_by("action").len().collect()
    ev = scan_table(run_dir, schema.TABLE_EVENTS).select("step", "kind", "action")
    per_event = (
        ev.filter((pl.col("kind") == schema.EV_ACTION) & pl.col("action").is_in(list(actions.EVENT_ACTIONS)))
        .group_by("action")
        .len()
        .collect()
    )
    out = actions.zero()
    for df in (per_step, per_event):
        for a, n in df.iter_rows():
            out[a] += int(n)
    if not out[schema.ACT_BIAS_CORRECT]:  # a run recorded before issue #28: corrections as events only
        old = ev.filter((pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_BIAS_CORRECT))
        out[schema.ACT_BIAS_CORRECT] = int(old.select(pl.col("step").n_unique()).collect().item() or 0)
    return out
