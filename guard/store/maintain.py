"""A long run's upkeep, done by its one writer as the run goes: summary.json after every write
(with each table's newest parts listed for the Runs page, summary.PARTS_KEY), and once a
1,000-step segment is closed (the run is `compact_lag_steps` past it), in this order:

    1. its parts merged into one per table (guard/store/compaction.py), reading each input once;
       the same pass feeds the layers/experts/groups/ranks rows to the segment's rollups;
    2. its rollups written at 10, 100 and 1,000 steps (guard/store/rollup.py), one part per
       segment and resolution, named by the segment (a redo rewrites the same file);
    3. summary.json: rolled_through = the segment (the commit point of 1 and 2);
    4. retention (guard/store/retention.py): segments wholly older than raw_window_steps, already
       rolled up, lose their raw rows outside incident windows. summary.json first says they are
       no longer full fidelity, then the parts are rewritten (atomic rename).
    5. rollup rows older than their resolution's window dropped (whole parts).

A kill -9 anywhere redoes from the last committed step on the next open: every step is
idempotent. The in-process run store calls it from its writer thread (never the training
thread); the collector from its checkpoint, under the run's journal lock.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl

from guard.core import schema
from guard.store import retention, summary
from guard.store.compaction import clean_temps, compact_span
from guard.store.layout import (
    ROLLUP_RESOLUTIONS,
    SEGMENT_STEPS,
    fsync_dir,
    live_parts,
    part_files,
    part_name,
    polars_schema,
    remove_hidden,
    rollup_polars_schema,
    rollup_table_dir,
    segment_of,
)
from guard.store.policy import StoreConfig
from guard.store.rollup import SegmentRoller
from guard.store.writer import write_part_file

log = logging.getLogger("moeguard.store")
# Retired segments whose rollup parts are merged into one, per resolution (guard/store/layout.py).
ROLLUP_BLOCK_SEGMENTS = {100: 10, 1000: 100}


def _scan(run_dir: Path, table: str, after: int | None = None) -> pl.DataFrame:
    from guard.store.reader import scan_table  # the tolerant reader (skips damaged parts)

    lf = scan_table(run_dir, table)
    if after is not None:
        lf = lf.filter(pl.col("step") > after)
    return lf.collect()


class StoreMaintainer:
    """summary.json, rollups, compaction and retention of one run (see the module docstring)."""

    def __init__(self, run_dir: str | Path, policy: StoreConfig | None = None) -> None:
        self.dir = Path(run_dir)
        self.policy = policy or StoreConfig()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._mtime: int | None = None
        for d in self._folders():
            clean_temps(d)
            remove_hidden(d, grace_s=self.policy.grace_s)
        self.doc = self._load()
        self.save()

    # ---- summary --------------------------------------------------------------------------
    def _folders(self) -> list[Path]:
        out = [self.dir / t for t in schema.TABLES]
        out += [rollup_table_dir(self.dir, t, r) for t in schema.ROLLUP_TABLES for r in ROLLUP_RESOLUTIONS]
        return [d for d in out if d.is_dir()]

    def _load(self) -> dict[str, Any]:
        """summary.json brought up to what the tables hold (rows a crash wrote after its last
        save are counted; a truncated run is recounted). No summary: counted from the tables once
        (an old store: rollups start at the segment it is reopened in, older rows stay raw)."""
        doc = summary.read_summary(self.dir)
        steps_last = _scan(self.dir, schema.TABLE_STEPS).select(pl.col("step").max()).item()
        if doc is None:
            doc = summary.empty_summary()
            doc["rolled_from"] = 0 if steps_last is None else segment_of(int(steps_last))
            doc["rolled_through"] = doc["rolled_from"] - 1
            self._count(doc, None)
        elif doc.get("recount") or (steps_last is not None and (doc["last_step"] or -1) > steps_last):
            self._recount(doc)
        elif steps_last is not None and steps_last > (
            doc["last_step"] if doc["last_step"] is not None else -1
        ):
            self._count(doc, doc["last_step"])
        doc.setdefault("rolled_from", 0)
        doc.setdefault("retired", None)
        doc.setdefault("granted", [])
        self._refresh_ranges(doc)
        return doc

    def _recount(self, doc: dict[str, Any]) -> None:
        keep = {k: doc.get(k) for k in ("rolled_from", "rolled_through", "retired", "rollups", "status")}
        fresh = summary.empty_summary()
        fresh.update({k: v for k, v in keep.items() if v is not None})
        for k in ("granted", "incident_points", "incident_count", "incidents"):
            if k in doc:
                fresh[k] = doc[k]
        doc.clear()
        doc.update(fresh)
        self._count(doc, None)
        doc.pop("recount", None)

    def _count(self, doc: dict[str, Any], after: int | None) -> None:
        steps, events = (
            _scan(self.dir, schema.TABLE_STEPS, after),
            _scan(self.dir, schema.TABLE_EVENTS, after),
        )
        self._note(doc, steps.sort("step"), events)

    def _note(self, doc: dict[str, Any], steps: pl.DataFrame | None, events: pl.DataFrame | None) -> None:
        if steps is not None:
            summary.add_steps(doc, steps)
        if events is not None:
            summary.add_events(doc, events)
        new = retention.incident_steps(steps, events)
        if new:
            retention.grant(doc, new, self.policy.incident_steps, self.policy.incident_budget_steps)

    def _refresh_ranges(self, doc: dict[str, Any]) -> None:
        first, last = doc.get("first_step"), doc.get("last_step")
        ranges: list[tuple[int, int]] = list(retention.kept_windows(doc))
        if first is not None and last is not None:
            ret = doc.get("retired")
            if ret is None:
                ranges.append((first, last))
            else:
                if first < ret[0]:
                    ranges.append((first, ret[0] - 1))
                if last > ret[1]:
                    ranges.append((ret[1] + 1, last))
        doc["full_fidelity"] = [list(r) for r in retention.merge_ranges(ranges)]
        doc["rollups"] = {
            t: [r for r in ROLLUP_RESOLUTIONS if rollup_table_dir(self.dir, t, r).is_dir()]
            for t in schema.ROLLUP_TABLES
            if any(rollup_table_dir(self.dir, t, r).is_dir() for r in ROLLUP_RESOLUTIONS)
        }

    def save(self) -> None:
        self._refresh_ranges(self.doc)
        self.doc[summary.PARTS_KEY] = summary.table_tails(self.dir, self.doc.get("last_step"))
        self.doc["updated_at"] = time.time()
        summary.write_summary(self.dir, self.doc)
        self._mtime = self._stat()

    def _stat(self) -> int | None:
        try:
            return os.stat(self.dir / schema.SUMMARY_FILE).st_mtime_ns
        except OSError:
            return None

    def set_status(self, status: str) -> None:
        self.doc["status"] = status
        self.save()

    # ---- as rows land ---------------------------------------------------------------------
    def wrote(self, frames: Mapping[str, pl.DataFrame]) -> None:
        """Rows just written as parts (any tables): counted, incidents granted, then closed
        segments processed and the summary saved."""
        if self._stat() != self._mtime:  # someone else rewrote it (truncate_after on a resume)
            self.doc = self._load()
        self._note(self.doc, frames.get(schema.TABLE_STEPS), frames.get(schema.TABLE_EVENTS))
        self.upkeep()
        self.save()

    def upkeep(self, *, final: bool = False) -> None:
        """Process every closed segment (with `final`, the last open one's rollups and parts too:
        a run that ends)."""
        last = self.doc.get("last_step")
        if last is None:
            return
        k = max(self.doc["rolled_through"] + 1, self.doc["rolled_from"])
        start = k
        while (k + 1) * SEGMENT_STEPS + self.policy.compact_lag_steps <= last:
            self._segment(k)
            self.doc["rolled_through"] = k
            self.save()
            k += 1
        if final and k * SEGMENT_STEPS <= last and self.policy.rollups:
            self._segment(k, compact=False)  # the live tail: rolled up (again once it closes), not merged
        if k != start or final:
            self._retire(last)

    def _segment(self, k: int, *, compact: bool = True) -> None:
        lo, hi = k * SEGMENT_STEPS, (k + 1) * SEGMENT_STEPS - 1
        rollers = {t: SegmentRoller(t, lo, hi) for t in schema.ROLLUP_TABLES} if self.policy.rollups else {}
        for t in schema.TABLES:
            d = self.dir / t
            roller = rollers.get(t)
            feed = roller.feed if roller is not None else None
            if self.policy.compact and compact:
                out = compact_span(d, lo, hi, polars_schema(t), grace_s=self.policy.grace_s, feed=feed)
                if out is None and feed is not None:  # one part already, or a damaged one: roll what reads
                    self._feed_parts(d, lo, hi, feed)
            elif feed is not None:
                self._feed_parts(d, lo, hi, feed)
        for t, roller in rollers.items():
            for res, df in roller.frames().items():
                if res < schema.ROLLUP_MIN_RESOLUTION.get(t, 0):
                    continue
                rd = rollup_table_dir(self.dir, t, res)
                rd.mkdir(parents=True, exist_ok=True)
                write_part_file(rd / part_name(lo, k), df)
                fsync_dir(rd)

    def _feed_parts(self, d: Path, lo: int, hi: int, feed: Any) -> None:
        """Feed the segment's rows part by part, row group by row group (a plain part of the
        segment before may hold a few of its rows: one written before parts were cut at segments)."""
        import pyarrow.parquet as pq

        from guard.store.reader import good_parts

        parts = [
            p
            for pi, p in live_parts(d)
            if lo <= pi.first_step <= hi or (lo - SEGMENT_STEPS <= pi.first_step < lo and not pi.compacted)
        ]
        for p in good_parts(parts):
            for batch in pq.ParquetFile(p).iter_batches(batch_size=1 << 18):
                feed(pl.from_arrow(batch))

    def _retire(self, last: int) -> None:
        """Retention: raw rows of old rolled-up segments outside incident windows; old rollups."""
        p = self.policy
        if p.retires_raw:
            ret = self.doc.get("retired")
            start = self.doc["rolled_from"] if ret is None else segment_of(ret[1]) + 1
            end = min(self.doc["rolled_through"], segment_of(last - p.raw_window_steps + 1) - 1)
            for j in range(start, end + 1):
                lo, hi = j * SEGMENT_STEPS, (j + 1) * SEGMENT_STEPS - 1
                self.doc["retired"] = [ret[0] if ret is not None else lo, hi]
                ret = self.doc["retired"]
                self.save()  # first: readers are no longer promised these rows
                keep = retention.keep_expr(
                    [
                        (max(a, lo), min(b, hi))
                        for a, b in retention.kept_windows(self.doc)
                        if a <= hi and b >= lo
                    ]
                )
                for t in retention.THINNED_TABLES:
                    compact_span(
                        self.dir / t, lo, hi, polars_schema(t), grace_s=p.grace_s, keep=keep, force=True
                    )
                self._merge_rollup_blocks(j)
        for res, window in p.windows().items():
            if not window:
                continue
            for t in schema.ROLLUP_TABLES:
                d = rollup_table_dir(self.dir, t, res)
                remove_hidden(d)  # a part deleted below must not uncover a leftover
                for pi, f in live_parts(d):
                    if pi.last + SEGMENT_STEPS - 1 < last - window:
                        f.unlink()

    def _merge_rollup_blocks(self, j: int) -> None:
        """Once segment `j` is retired: if it ends a block of ROLLUP_BLOCK_SEGMENTS[res] segments,
        that block's per-segment rollup parts at `res` are merged into one (1,000 files a table
        at 1M steps become 100 at r100 and 10 at r1000). Only retired segments: a resume never
        re-rolls them, so a merged block is never partly rewritten."""
        for res, n in ROLLUP_BLOCK_SEGMENTS.items():
            if (j + 1) % n:
                continue
            lo, hi = (j + 1 - n) * SEGMENT_STEPS, (j + 1) * SEGMENT_STEPS - 1
            for t in schema.ROLLUP_TABLES:
                d = rollup_table_dir(self.dir, t, res)
                if d.is_dir():
                    compact_span(d, lo, hi, rollup_polars_schema(t), grace_s=self.policy.grace_s)

    def finish(self, status: str | None = None) -> None:
        """A run that ends: its last segment rolled up and compacted, the status saved."""
        self.upkeep(final=True)
        if status is not None:
            self.doc["status"] = status
        self.save()


__all__ = ["StoreMaintainer", "part_files"]
