"""The one run-store writer: table frames from reports and events, parts written durably.

Both the in-process run store (guard/store/runstore.py, a background thread per run) and the
collector (guard/collector/storage.py, at each checkpoint) turn rows into frames here and land
them with `write_parts`, so there is one Parquet path: the same columns and types, the same
part names (guard/store/layout.py), the same temp-name / fsync / rename / fsync-folder dance.
`truncate_after` is the one way rows leave a store (a resumed run re-running steps).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from guard.core import schema
from guard.core.report import StepReport
from guard.core.rows import expert_columns, group_columns, layer_columns, steps_columns
from guard.store import summary
from guard.store.layout import (
    ROLLUP_DIR,
    ROLLUP_RESOLUTIONS,
    SEGMENT_STEPS,
    discard,
    fsync_dir,
    live_parts,
    part_files,
    part_name,
    polars_schema,
    remove_hidden,
    rollup_table_dir,
    segment_of,
)


def table_frame(table: str, cols: Mapping[str, Any]) -> pl.DataFrame:
    """A frame of the table's columns in the stored types."""
    return pl.DataFrame(dict(cols), schema=polars_schema(table), strict=False)


def report_frames(reports: Sequence[StepReport]) -> dict[str, pl.DataFrame]:
    """steps / layers / experts / groups frames for reports (tables with no row are left out)."""
    if not reports:
        return {}
    out = {schema.TABLE_STEPS: table_frame(schema.TABLE_STEPS, steps_columns(reports))}
    for table, columns in (
        (schema.TABLE_LAYERS, layer_columns),
        (schema.TABLE_EXPERTS, expert_columns),
        (schema.TABLE_GROUPS, group_columns),
    ):
        cols = columns(reports)
        if len(cols["step"]):
            out[table] = table_frame(table, cols)
    return out


def event_frame(rows: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    """The `events` frame of event rows (guard.core.events.Event.row())."""
    return table_frame(schema.TABLE_EVENTS, {c: [r[c] for r in rows] for c in schema.EVENTS_COLUMNS})


def write_part_file(path: Path, df: pl.DataFrame) -> None:
    """Write a part atomically: temp name, fsync, rename (a reader sees all of it or none)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        df.write_parquet(tmp, compression="zstd", statistics=True)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)  # a full disk leaves no empty temp file in the run
        raise


def split_by_segment(df: pl.DataFrame) -> list[pl.DataFrame]:
    """The frame cut at segment boundaries (guard/store/layout.py SEGMENT_STEPS), so no part
    holds rows of two segments and a segment's compaction and rollups read only its own parts."""
    if df.height == 0:
        return [df]
    lo, hi = df["step"].min(), df["step"].max()
    if segment_of(lo) == segment_of(hi):  # type: ignore[arg-type]
        return [df]
    parts = df.with_columns((pl.col("step") // SEGMENT_STEPS).alias("_segment")).partition_by(
        "_segment", maintain_order=True, include_key=False
    )
    return parts


def write_parts(
    run_dir: Path,
    frames: Mapping[str, pl.DataFrame],
    seq: int,
    *,
    first_steps: Mapping[str, int] | None = None,
) -> int:
    """Write each frame as a part of its table, named by its first step and seq, seq + 1, ...
    (in the frames' order), then make the names durable. Returns the next free seq.
    `first_steps`: the step each table's part is named by (default: its smallest step; the
    in-process store names a part by the first step it buffered). A frame whose rows span a
    segment boundary is written as one part per segment (`split_by_segment`)."""
    touched = set()
    for table, frame in frames.items():
        d = run_dir / table
        d.mkdir(parents=True, exist_ok=True)
        for i, df in enumerate(split_by_segment(frame)):
            first = int(df["step"].min())  # type: ignore[arg-type]
            if i == 0 and first_steps is not None:
                first = min(first, first_steps[table])
            write_part_file(d / part_name(first, seq), df)
            seq += 1
        touched.add(d)
    for d in sorted(touched):
        fsync_dir(d)
    return seq


def truncate_after(run_dir: str | Path, step: int, *, archive_dir: str | Path | None = None) -> int:
    """Drop rows with step > `step` from every table (used when resuming from a checkpoint,
    so steps re-run after a crash are not stored twice). Returns the rows dropped.

    With `archive_dir`, nothing is lost: the dropped rows of each part are first written,
    fsynced, to `archive_dir/<table>/<the part's name>` (a store of the same layout), and only
    then removed from the live part. Idempotent: a retry after a failure part-way rewrites the
    same archive files and drops nothing twice."""
    dropped = 0
    for t in schema.TABLES:
        remove_hidden(Path(run_dir) / t)  # a part deleted below must not uncover a leftover
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
    drop_rollups_after(run_dir, step)  # rollups are derived: rebuilt from the raw rows
    return dropped


def drop_rollups_after(run_dir: str | Path, step: int) -> None:
    """Rollups of the segments after step `step` removed (truncate_after on a resume: they are
    rolled again from the new timeline's rows) and summary.json told to recount. A merged block
    reaching past the step goes too. Retired segments after the step stop being retired; the one
    holding step + 1, if retired, is rolled again from the raw rows it kept (docs/long-runs.md,
    Limits)."""
    d = Path(run_dir)
    cut = segment_of(step + 1) * SEGMENT_STEPS
    if (d / ROLLUP_DIR).is_dir():
        for t in schema.ROLLUP_TABLES:
            for res in ROLLUP_RESOLUTIONS:
                rd = rollup_table_dir(d, t, res)
                remove_hidden(rd)  # a part deleted below must not uncover a leftover
                for pi, f in live_parts(rd):
                    if pi.first_step >= cut or pi.last >= cut:
                        f.unlink()
    doc = summary.read_summary(d)
    if doc is not None:
        ret = doc.get("retired")
        if ret is not None:
            doc["retired"] = [ret[0], min(ret[1], cut - 1)] if cut - 1 >= ret[0] else None
        doc["rolled_through"] = min(doc.get("rolled_through", -1), cut // SEGMENT_STEPS - 1)
        doc["granted"] = [g for g in doc.get("granted", []) if g[0] <= step]
        doc["incident_points"] = [
            [lo, min(hi, step)] for lo, hi in doc.get("incident_points", []) if lo <= step
        ]
        doc["incidents"] = [s for s in doc.get("incidents", []) if s <= step]
        doc["incident_count"] = len(doc["granted"]) + sum(hi - lo + 1 for lo, hi in doc["incident_points"])
        doc["recount"] = True
        doc.pop(summary.PARTS_KEY, None)  # the parts changed: readers list until the next save
        summary.write_summary(d, doc)
