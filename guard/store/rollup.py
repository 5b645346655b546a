"""Rollups: a table's rows summarised per series (its key columns) per bucket of `res` steps,
the way Thanos downsamples (count, sum, min, max and a counter per 5 m / 1 h chunk, each tier
from the finer one) and W&B's full-fidelity line plots draw (min/max band, last value as the
line), so a spike or a dead expert anywhere in a month-long run shows in the extremes.

Built as the run goes, one closed 1,000-step segment at a time (guard/store/maintain.py), from
that segment's raw rows only, part by part: each part's rows become partial aggregates (n, sum,
count, min, max, last per series and 10-step bucket), partials of a bucket split between two
parts merge exactly, and each coarser resolution is merged from the finer one. Nothing reads the
whole run. The columns are schema.rollup_columns (mean = sum / count of non-NaN values).
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from guard.core import schema
from guard.store.layout import ROLLUP_RESOLUTIONS

_NAN = float("nan")


def _partial_aggs(vals: tuple[str, ...]) -> list[pl.Expr]:
    aggs = [
        pl.col("step").min().alias("step_lo"),
        pl.col("step").max().alias("step_hi"),
        pl.len().cast(pl.Int64).alias("n"),
    ]
    for c in vals:
        v = pl.col(f"{c}__v")  # NaN as null: sum, count, min and max skip it
        aggs += [
            v.sum().alias(f"{c}__sum"),
            v.count().cast(pl.Int64).alias(f"{c}__cnt"),
            v.min().alias(f"{c}__min"),
            v.max().alias(f"{c}__max"),
            pl.col(c).last().cast(pl.Float64).alias(f"{c}__last"),
        ]
    return aggs


def partials(table: str, df: pl.DataFrame, res: int) -> pl.DataFrame:
    """Partial aggregates of raw rows per (key, bucket of `res` steps). Rows must be in step order
    within a series (a part's rows are)."""
    keys = schema.ROLLUP_KEYS[table]
    vals = schema.rollup_value_columns(table)
    missing = [c for c in (*keys, *vals) if c not in df.columns]
    if missing:  # a part written before a column existed
        dtypes = schema.TABLE_COLUMNS[table]
        df = df.with_columns(pl.lit(None, dtype=getattr(pl, dtypes[c])()).alias(c) for c in missing)
    return (
        df.with_columns(
            (pl.col("step") // res * res).alias("_bucket"),
            *(pl.col(c).cast(pl.Float64).fill_nan(None).alias(f"{c}__v") for c in vals),
        )
        .group_by([*keys, "_bucket"], maintain_order=True)
        .agg(_partial_aggs(vals))
    )


def merge_partials(table: str, parts: Iterable[pl.DataFrame], res: int) -> pl.DataFrame:
    """Partials (of `res` or a finer resolution that divides it) merged per (key, bucket of `res`):
    exact for n, count, sum, min, max; last is the one with the largest step_hi."""
    keys = schema.ROLLUP_KEYS[table]
    vals = schema.rollup_value_columns(table)
    df = pl.concat(list(parts), how="vertical_relaxed")
    aggs = [
        pl.col("step_lo").min(),
        pl.col("step_hi").max(),
        pl.col("n").sum(),
    ]
    for c in vals:
        aggs += [
            pl.col(f"{c}__sum").sum(),
            pl.col(f"{c}__cnt").sum(),
            pl.col(f"{c}__min").min(),
            pl.col(f"{c}__max").max(),
            pl.col(f"{c}__last").sort_by("step_hi").last(),
        ]
    return (
        df.with_columns((pl.col("_bucket") // res * res).alias("_bucket"))
        .group_by([*keys, "_bucket"])
        .agg(aggs)
    )


def finish(table: str, merged: pl.DataFrame) -> pl.DataFrame:
    """Merged partials as rollup rows (schema.rollup_columns, sorted by step then key)."""
    keys = schema.ROLLUP_KEYS[table]
    cols: list[pl.Expr] = [pl.col(k) for k in keys]
    cols += [
        pl.col("_bucket").cast(pl.Int64).alias("step"),
        pl.col("step_lo").cast(pl.Int64),
        pl.col("step_hi").cast(pl.Int64),
        pl.col("n").cast(pl.Int32),
    ]
    for c in schema.rollup_value_columns(table):
        cnt = pl.col(f"{c}__cnt")
        mean = pl.when(cnt > 0).then(pl.col(f"{c}__sum") / cnt).otherwise(_NAN)
        cols += [
            mean.cast(pl.Float32).alias(f"{c}_mean"),
            pl.col(f"{c}__min").fill_null(_NAN).cast(pl.Float32).alias(f"{c}_min"),
            pl.col(f"{c}__max").fill_null(_NAN).cast(pl.Float32).alias(f"{c}_max"),
            pl.col(f"{c}__last").fill_null(_NAN).cast(pl.Float32).alias(f"{c}_last"),
        ]
    dtypes = schema.rollup_columns(table)
    out = merged.select(cols).sort(["step", *keys])
    return out.cast({k: getattr(pl, dtypes[k])() for k in keys})


class SegmentRoller:
    """The rollups of one segment's rows, fed one part at a time (memory: one part plus the
    10-step partials of the segment, ~1.5M rows at Trinity shape)."""

    def __init__(self, table: str, lo: int, hi: int) -> None:
        self.table, self.lo, self.hi = table, lo, hi
        self._parts: list[pl.DataFrame] = []

    def feed(self, df: pl.DataFrame) -> None:
        """Raw rows of the table (rows outside the segment's [lo, hi] steps are ignored)."""
        df = df.filter(pl.col("step").is_between(self.lo, self.hi))
        if df.height:
            self._parts.append(partials(self.table, df, ROLLUP_RESOLUTIONS[0]))
            if len(self._parts) >= 16:  # keep memory flat over many small parts
                self._parts = [merge_partials(self.table, self._parts, ROLLUP_RESOLUTIONS[0])]

    def frames(self) -> dict[int, pl.DataFrame]:
        """Rollup rows per resolution (empty dict when no row was fed)."""
        if not self._parts:
            return {}
        out: dict[int, pl.DataFrame] = {}
        merged = merge_partials(self.table, self._parts, ROLLUP_RESOLUTIONS[0])
        for res in ROLLUP_RESOLUTIONS:
            if res != ROLLUP_RESOLUTIONS[0]:
                merged = merge_partials(self.table, [merged], res)
            out[res] = finish(self.table, merged)
        return out


def rollup(table: str, df: pl.DataFrame, res: int) -> pl.DataFrame:
    """Rollup rows of raw rows at one resolution, in one call (tests, benches)."""
    merged = merge_partials(table, [partials(table, df.sort("step", maintain_order=True), res)], res)
    return finish(table, merged)
