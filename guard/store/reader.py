"""The one tolerant run-store reader: the app, `moeguard replay`, the collector and the trainer
read runs through it.

Tolerant of what older or partial writers leave: a meta.json that is missing or not a JSON
object reads as None; a table with no part yet scans as an empty frame of the right schema;
a part written before a column existed gets that column as nulls (and extra columns are
ignored); stray files in a table folder (temp names, anything not named like a part) are
never read.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

from guard.core import actions, schema
from guard.core.report import StepReport
from guard.core.rows import reports_from_columns
from guard.store.layout import parse_part_name, part_files, polars_schema, sorted_part_names


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


def scan_table(
    run_dir: str | Path, table: str, parts: list[Path] | None = None, *, cached: bool = False
) -> pl.LazyFrame:
    """Lazy scan of a table (or of the given `parts` of it); an empty frame with the right
    schema when there is no part. Columns an older writer did not have come back as nulls.
    `cached`: list the parts with `cached_part_files`."""
    if parts is None:
        parts = cached_part_files(run_dir, table) if cached else part_files(run_dir, table)
    sch = polars_schema(table)
    if not parts:
        return pl.LazyFrame(schema=sch)
    return pl.scan_parquet(
        [str(p) for p in parts], schema=sch, missing_columns="insert", extra_columns="ignore"
    )


def read_table(run_dir: str | Path, table: str) -> pl.DataFrame:
    return scan_table(run_dir, table).collect()


def missing_columns(run_dir: str | Path, table: str) -> list[str]:
    """Columns of the current schema that the table's first part lacks (older writers)."""
    parts = cached_part_files(run_dir, table)
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
