"""bench/scale/month_run.py at a tiny size (seconds): it builds a long-run store, opens every
page's data path in fresh processes, replays it, and reports sizes and files per table; and
bench/scale/month_store.py's fast build leaves the store the real writer path leaves."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from bench.scale import month_run
from bench.scale.month_store import write_month_run
from guard.core import schema
from guard.store import layout, summary


def test_month_run_tiny(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = [
        "--steps",
        "2000",
        "--steps",
        "3000",
        "--layers",
        "4",
        "--experts",
        "8",
        "--ranks",
        "16",
        "--runs",
        "5",
    ]
    args += [
        "--incident-every",
        "1000",
        "--recent",
        "1000",
        "--radius",
        "20",
        "--repeat",
        "1",
        "--add-step",
        "120",
    ]
    month_run.main([*args, "--dir", str(tmp_path / "b"), "--out", str(out)])
    res = json.loads(out.read_text())
    for n in (2000, 3000):
        r = res["results"][f"new-{n}"]
        assert r["measured"]["runs"]["runs"] == 5 and r["measured"]["runs"]["steps"] == n - 1
        assert r["measured"]["health"]["stages"]["figure_json_bytes"] > 0
        assert r["measured"]["replay"]["peak_rss_mb"] > 0
        # compacted: one part per table per closed 1,000-step segment; the newest (the live tail
        # when the run ended) stays as written, one part per flush
        run = tmp_path / "b" / f"new-{n}" / "runs" / month_run.RUN_ID
        tail = (n // 1000 - 1) * 1000
        for t in (schema.TABLE_STEPS, schema.TABLE_EXPERTS):
            closed = [pi for pi, _ in layout.live_parts(run / t) if pi.first_step < tail]
            assert len(closed) == n // 1000 - 1 and all(pi.compacted for pi in closed)
        assert r["store"]["rollups/experts-r1000"]["files"] == n // 1000
    assert set(res["growth"]) >= {"runs", "health", "compare", "replay"}
    assert res["add_step"]["steps"] == 120 and res["add_step"]["p999_ms"] > 0


def test_the_fast_build_leaves_what_the_real_writer_leaves(tmp_path: Path) -> None:
    """The same rows through RunStore (add_event / add_rank_rows / add_step / close, the policy's
    upkeep) and through the fast build (the writer's functions, the real StoreMaintainer, old
    quiet and incident segments tiled from a template): the same files in every table and
    rollup tier, each with the same schema and rows, the same summary.json. 12 segments: old
    segments tiled, a 10-segment r100 block merged, r10 rollups past their window dropped."""
    shape = {"steps": 12_000, "layers": 3, "experts": 8, "ranks": 8, "incident_every": 2000}
    shape |= {"recent": 1000, "radius": 20, "r10_window": 2000}
    fast = write_month_run(tmp_path / "fast", fast=True, **shape)
    real = write_month_run(tmp_path / "real", fast=False, **shape)
    assert fast["tiled"] == [2, 3, 4, 5, 6, 7, 8, 9, 10]  # templates: 0 (incident), 1 (quiet)
    files = {p.relative_to(tmp_path / "fast") for p in (tmp_path / "fast").rglob("*.parquet")}
    assert files == {p.relative_to(tmp_path / "real") for p in (tmp_path / "real").rglob("*.parquet")}
    folders = {f.parent for f in files}
    assert {Path(t) for t in (schema.TABLE_STEPS, schema.TABLE_EXPERTS, schema.TABLE_RANKS)} <= folders
    assert Path("rollups/experts-r100") in folders and Path("rollups/steps-r1000") in folders
    merged = [
        f for f in files if f.parent == Path("rollups/experts-r100") and layout.parse_part(f.name).compacted
    ]
    assert merged  # the first ten segments' r100 parts merged into one block
    assert not [
        f for f in files if f.parent == Path("rollups/experts-r10") and int(f.name.split("-")[1]) < 9000
    ]
    for f in sorted(files):
        a, b = pl.read_parquet(tmp_path / "fast" / f), pl.read_parquet(tmp_path / "real" / f)
        assert a.schema == b.schema and a.equals(b), f
    docs = [json.loads((tmp_path / k / schema.SUMMARY_FILE).read_text()) for k in ("fast", "real")]
    for doc in docs:
        doc.pop("updated_at")
        for rec in doc[summary.PARTS_KEY].values():  # the same newest parts; the folders' mtimes differ
            rec.pop("mtime_ns")
    assert docs[0] == docs[1]
    assert fast["extremes"] == real["extremes"] and fast["ranges"] == real["ranges"]
