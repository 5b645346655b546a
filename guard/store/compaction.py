"""Compaction: the live parts of one closed step span of a table folder merged into one part,
atomically and crash-safe (guard/store/layout.py states the LIVE rule it relies on).

    1. read the inputs one at a time (memory: one input part and one row group), writing the
       merged part to a temporary name (invisible to readers), fsync;
    2. rename it to its compacted name (part-<first>-<hi>-<lo>-<last>), fsync the folder: from
       this instant readers list the merged part and no longer its inputs;
    3. delete the inputs (at once, or `grace_s` later for readers that listed them just before).

A kill -9 before 2 leaves a temp file (removed at the next compaction) and the inputs live; after
2 the inputs are hidden leftovers that `remove_hidden` deletes. Nothing acknowledged is lost and
no row is ever visible twice. A span holding a damaged part (a crash of an older writer) is left
as it is: compaction never hides rows it could not read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from guard.store.layout import compacted_part_name, discard, fsync_dir, live_parts, remove_hidden

log = logging.getLogger("moeguard.store")

ROW_GROUP_ROWS = 1 << 18  # rows buffered before a row group is written (small parts are merged)
TMP_PREFIX = ".compact-"


def _conform(df: pl.DataFrame, sch: dict[str, pl.DataType]) -> pl.DataFrame:
    """The frame with exactly the schema's columns, in order and type (an older part's missing
    columns as nulls; unknown ones dropped)."""
    return df.select(
        pl.col(c).cast(t) if c in df.columns else pl.lit(None, dtype=t).alias(c) for c, t in sch.items()
    )


def _readable(p: Path) -> bool:
    try:
        pq.read_metadata(p)
        return True
    except Exception:
        return False


def clean_temps(table_dir: Path) -> None:
    """Remove temp files a killed compaction left in the folder."""
    try:
        with os.scandir(table_dir) as it:
            for e in it:
                if e.name.startswith(TMP_PREFIX):
                    discard(Path(e.path))
    except FileNotFoundError:
        pass


def compact_span(
    table_dir: str | Path,
    first: int,
    last: int,
    sch: dict[str, pl.DataType],
    *,
    grace_s: float = 0.0,
    feed: Callable[[pl.DataFrame], None] | None = None,
    keep: pl.Expr | None = None,
    force: bool = False,
) -> Path | None:
    """Merge the live parts of `table_dir` whose first step lies in [first, last] into one.
    `feed` sees every input's rows (rollups are built in the same pass), `keep` filters the rows
    that go into the merged part (retention). Returns the merged part, or None when there was
    nothing to do (fewer than two inputs and no `force`, or a damaged input)."""
    d = Path(table_dir)
    inputs = [(pi, p) for pi, p in live_parts(d) if first <= pi.first_step <= last]
    if not inputs or (len(inputs) < 2 and not force):
        return None
    bad = [p.name for _, p in inputs if not _readable(p)]
    if bad:
        log.warning("%s: steps %d..%d not compacted: damaged part(s) %s", d, first, last, ", ".join(bad))
        return None
    lo = min(pi.lo for pi, _ in inputs)
    hi = max(pi.seq for pi, _ in inputs)
    out = d / compacted_part_name(first, last, lo, hi)
    tmp = d / f"{TMP_PREFIX}{out.name}.{os.getpid()}"
    writer: pq.ParquetWriter | None = None
    arrow_schema: pa.Schema | None = None
    buf: list[pl.DataFrame] = []
    buffered = 0

    def flush_buf() -> None:
        nonlocal writer, arrow_schema, buf, buffered
        if not buf:
            return
        tbl = pl.concat(buf).to_arrow()
        if writer is None:
            arrow_schema = tbl.schema
            writer = pq.ParquetWriter(tmp, arrow_schema, compression="zstd", write_statistics=True)
        writer.write_table(tbl.cast(arrow_schema))
        buf, buffered = [], 0

    try:
        for _, p in inputs:
            for batch in pq.ParquetFile(p).iter_batches(batch_size=ROW_GROUP_ROWS):
                df = _conform(pl.from_arrow(batch), sch)  # type: ignore[arg-type]
                if feed is not None:
                    feed(df)
                if keep is not None:
                    df = df.filter(keep)
                if df.height:
                    buf.append(df)
                    buffered += df.height
                    if buffered >= ROW_GROUP_ROWS:
                        flush_buf()
        flush_buf()
        if writer is None:  # every row filtered out: an empty part still covers its inputs
            empty = pl.DataFrame(schema=sch).to_arrow()
            writer = pq.ParquetWriter(tmp, empty.schema, compression="zstd", write_statistics=True)
            writer.write_table(empty)
        writer.close()
        writer = None
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        if writer is not None:
            writer.close()
        discard(tmp)
        raise
    fsync_dir(d)
    if grace_s <= 0:
        remove_hidden(d)
    return out
