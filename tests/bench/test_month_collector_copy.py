"""bench/scale/month_store.py's collector's copy (flush_every = COLLECTOR_FLUSH_EVERY: one
checkpoint a step through the same StoreMaintainer) leaves the files the real collector's ingest
leaves (bench/scale/store_tiers.py --collector: an in-process Collector, a checkpoint after every
3-step batch): one part per raw table per closed 1,000 steps, the live tail as written; and the
job's store's rollups, byte for byte."""

from __future__ import annotations

from pathlib import Path

from bench.scale import month_run, store_tiers
from bench.scale.month_store import COLLECTOR_FLUSH_EVERY, write_month_run
from guard.core import schema

N = 1_100  # one closed segment (closed at step 1,050: compact_lag_steps) and a 100-step live tail
SHAPE = {"layers": 4, "experts": 8, "ranks": 0, "incident_every": 0, "recent": 1000, "radius": 20}


def test_the_collector_copy_has_the_real_collectors_files(tmp_path: Path) -> None:
    write_month_run(tmp_path / "job", steps=N, **SHAPE)
    write_month_run(tmp_path / "col", steps=N, flush_every=COLLECTOR_FLUSH_EVERY, **SHAPE)
    real = store_tiers.collector_files(N, tmp_path / "real")
    got = month_run.tail_files(tmp_path / "col", N)
    for t in (schema.TABLE_STEPS, schema.TABLE_LAYERS, schema.TABLE_EXPERTS):
        assert got[t]["per_1000_closed"] == real[t]["files_per_1000_steps_closed"] == 1.0
        # the open segment as written: a part a step here, a part a 3-step checkpoint there
        assert got[t]["live_tail"] == N - (N - 50) // 1000 * 1000
        assert real[t]["live_tail_files"] == -(-got[t]["live_tail"] // 3)
    job, col = month_run.store_stats(tmp_path / "job"), month_run.store_stats(tmp_path / "col")
    rollups = sorted(k for k in job if k.startswith("rollups/"))
    assert rollups and all(job[k] == col[k] for k in rollups)
