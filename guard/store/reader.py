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

import functools
import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from guard.core import actions, schema
from guard.core.report import StepReport
from guard.core.rows import reports_from_columns
from guard.store.layout import parse_part_name, part_files, polars_schema, sorted_part_names

PARQUET_MAGIC = b"PAR1"  # a Parquet file starts and ends with it; the footer length sits before the end


class DamagedPartWarning(UserWarning):
    """A part file that is not whole Parquet was skipped (the message names the file)."""


@dataclass(frozen=True, slots=True)
class DamagedPart:
    path: Path
    reason: str

    def message(self) -> str:
        return f"skipped damaged part {self.path}: {self.reason}; the rest of the run reads without it"


def part_problem(path: str | Path) -> str | None:
    """Why a part file cannot be read as Parquet (None when it can): its magic bytes, footer
    length and footer are checked, remembered per (path, size, mtime) so a file that a copy
    finishes later is checked again."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    return _part_problem(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=65536)
def _part_problem(path: str, size: int, mtime_ns: int) -> str | None:
    del mtime_ns  # cache key only
    if size < 12:
        return f"{size} bytes, too short to be Parquet (a crash or a full disk?)"
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(size - 8)
            tail = f.read(8)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if head != PARQUET_MAGIC:
        return "does not start with Parquet's magic bytes (not a Parquet file)"
    if tail[4:] != PARQUET_MAGIC:
        return "has no Parquet footer: truncated (a crash, a full disk or a copy in progress?)"
    if int.from_bytes(tail[:4], "little") + 12 > size:
        return "its footer length points before the file's start (damaged)"
    try:
        pl.read_parquet_schema(path)
    except Exception as e:  # polars raises several kinds for a bad footer
        return "its footer cannot be parsed (" + (str(e).splitlines() or [type(e).__name__])[0][:120] + ")"
    return None


def good_parts(parts: list[Path]) -> list[Path]:
    """`parts` without the damaged ones; each skipped file is reported as a DamagedPartWarning."""
    out = []
    for p in parts:
        why = part_problem(p)
        if why is None:
            out.append(p)
        else:
            warnings.warn(DamagedPart(Path(p), why).message(), DamagedPartWarning, stacklevel=3)
    return out


def damaged_parts(run_dir: str | Path) -> list[DamagedPart]:
    """Every part of every table of the run that readers skip, with the reason."""
    return [
        DamagedPart(p, why)
        for t in schema.TABLES
        for p in part_files(run_dir, t)
        if (why := part_problem(p)) is not None
    ]


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
    the same long run over and over (the app). A part renamed in within the same mtime tick as
    the previous listing is seen on a later change, so writers and tests use `part_files`."""
    d = os.path.join(run_dir, table)
    try:
        mtime = os.stat(d).st_mtime_ns
    except OSError:
        return []
    return [Path(d, n) for n in _cached_names(d, mtime)]


@functools.lru_cache(maxsize=256)
def _cached_names(table_dir: str, mtime_ns: int) -> tuple[str, ...]:
    del mtime_ns  # cache key only
    return sorted_part_names(table_dir)


def clear_cache() -> None:
    """Forget the remembered part listings (`cached_part_files`)."""
    _cached_names.cache_clear()
    _part_problem.cache_clear()


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


def read_reports(run_dir: str | Path) -> Iterator[StepReport]:
    """StepReports rebuilt from the steps, layers, experts and groups tables, in step order
    (guard/core/rows.py is the mapping)."""
    steps = scan_table(run_dir, schema.TABLE_STEPS).sort("step").collect()
    layers = scan_table(run_dir, schema.TABLE_LAYERS).sort("step", "layer").collect()
    experts = scan_table(run_dir, schema.TABLE_EXPERTS).sort("step", "layer", "expert").collect()
    groups = scan_table(run_dir, schema.TABLE_GROUPS).sort("step", "group").collect()
    yield from reports_from_columns(
        steps.to_dict(as_series=False),
        {c: layers[c].to_numpy() for c in layers.columns},
        {c: experts[c].to_numpy() for c in experts.columns},
        {c: groups[c].to_numpy() for c in groups.columns},
    )


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
