"""Long runs in the run store (issue #38): retention keeps every incident at full fidelity,
rollups keep every series' extremes, compaction survives kill -9, the collector's copy is
compacted and rolled up through the real ingest path, and an old store opens unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from guard.core import schema
from guard.core.events import Event
from guard.core.report import StepReport
from guard.core.rows import expert_columns
from guard.store import layout, retention
from guard.store.compaction import compact_span
from guard.store.layout import SEGMENT_STEPS, part_files, polars_schema, rollup_part_files
from guard.store.policy import StoreConfig, load_store_config
from guard.store.reader import read_table
from guard.store.rollup import rollup
from guard.store.runstore import RunStore
from guard.store.summary import read_summary
from guard.store.writer import report_frames, write_parts
from tests.helpers_collector import batch, beat, ingest, make_report

ROOT = Path(__file__).resolve().parents[2]
SMALL = StoreConfig(raw_window_steps=1000, incident_steps=3, r10_window_steps=2000, compact_lag_steps=10)


def report(step: int) -> StepReport:
    return make_report(step, n_layers=4, n_experts=6)


def test_an_incident_anywhere_stays_at_full_fidelity_and_rollups_keep_the_extremes(tmp_path: Path) -> None:
    run = tmp_path / "r"
    store = RunStore(run, flush_every=40, policy=SMALL)
    reps = []
    for s in range(3600):
        r = report(s)
        if s == 700:
            store.add_event(Event(step=s, kind=schema.EV_VERDICT, detector=schema.DET_MAXVIO))
        if s == 1234:
            r.action = schema.ACT_SKIP
        if s == 1801:
            r.loss = float("nan")
        if s == 2222:
            store.add_event(Event(step=s, kind=schema.EV_OPERATOR, action=schema.ACT_ROLLBACK))
        if s == 333:  # a spike no detector saw: only the rollups keep it
            r.load_ME[0, 2] = 10_000_000
        store.add_step(r)
        reps.append(r)
    store.close(status=schema.STATUS_FINISHED)

    raw = read_table(run, schema.TABLE_EXPERTS)
    kept = set(raw["step"].unique().to_list())
    for s in (700, 1234, 1801, 2222):
        assert set(range(s - 3, s + 4)) <= kept, s  # +-incident_steps, though the run moved on
    assert 333 not in kept and 1500 not in kept  # old quiet steps: rolled up, raw dropped
    assert set(range(2000, 3600)) <= kept  # the raw window (segments not yet retired)
    assert read_table(run, schema.TABLE_STEPS)["step"].to_list() == list(range(3600))  # steps: whole
    ranges = retention.full_fidelity_ranges(run)
    for s in (700, 1234, 1801, 2222, 3599):
        assert any(lo <= s <= hi for lo, hi in ranges), (s, ranges)
    assert not any(lo <= 333 <= hi for lo, hi in ranges)
    for lo, hi in ranges:  # every promised step is there
        assert set(range(lo, hi + 1)) <= kept

    # rollups: extremes equal the raw series' extremes, mean and last are right, at every tier
    truth = pl.DataFrame(expert_columns(reps))
    for res in layout.ROLLUP_RESOLUTIONS:
        got = pl.read_parquet(rollup_part_files(run, schema.TABLE_EXPERTS, res))
        if res == 10:  # older r10 parts dropped past r10_window_steps
            assert got["step"].min() >= 3599 - 2000 - SEGMENT_STEPS
        want = (
            truth.with_columns((pl.col("step") // res * res).alias("b"))
            .group_by("layer", "expert", "b")
            .agg(
                pl.col("load").max().alias("mx"),
                pl.col("load").min().alias("mn"),
                pl.col("load").mean().alias("mean"),
                pl.col("load").sort_by("step").last().alias("last"),
                pl.col("step").min().alias("lo"),
                pl.col("step").max().alias("hi"),
                pl.len().alias("n"),
            )
        )
        j = got.join(want, left_on=["layer", "expert", "step"], right_on=["layer", "expert", "b"])
        assert j.height == got.height and got.height > 0
        assert (j["load_max"] == j["mx"].cast(pl.Float32)).all()
        assert (j["load_min"] == j["mn"].cast(pl.Float32)).all()
        assert (j["load_last"] == j["last"].cast(pl.Float32)).all()
        assert np.allclose(j["load_mean"].to_numpy(), j["mean"].to_numpy(), rtol=1e-6)
        assert (
            (j["step_lo"] == j["lo"]).all()
            and (j["step_hi"] == j["hi"]).all()
            and (j["n"] == j["n_right"]).all()
        )
    r1000 = pl.read_parquet(rollup_part_files(run, schema.TABLE_EXPERTS, 1000))
    spike = r1000.filter((pl.col("step") == 0) & (pl.col("layer") == 1) & (pl.col("expert") == 2))
    assert spike["load_max"].item() == 10_000_000  # the unseen spike survives in the extremes

    doc = read_summary(run)
    assert doc is not None and doc["steps_written"] == 3600 and doc["last_step"] == 3599
    assert doc["status"] == schema.STATUS_FINISHED and doc["actions"][schema.ACT_SKIP] == 1
    assert doc["rollups"][schema.TABLE_EXPERTS] == list(layout.ROLLUP_RESOLUTIONS)
    # compaction: one part per table per closed segment (the last, open one is the live tail)
    for t in (schema.TABLE_STEPS, schema.TABLE_EXPERTS):
        firsts = [layout.parse_part(p.name).first_step for p in part_files(run, t)]  # type: ignore[union-attr]
        closed = [f for f in firsts if f < 3 * SEGMENT_STEPS]
        assert sorted(closed) == [0, 1000, 2000], (t, firsts)


def test_rollup_ignores_nan_and_keeps_the_last_value() -> None:
    df = pl.DataFrame(
        {
            "step": [0, 1, 2, 3],
            "layer": [0, 0, 0, 0],
            "grad_norm": [1.0, 5.0, float("nan"), 2.0],
            "router_entropy": [float("nan")] * 4,
        }
    )
    r = rollup(schema.TABLE_LAYERS, df, 10).row(0, named=True)
    assert (r["n"], r["step_lo"], r["step_hi"]) == (4, 0, 3)
    assert (r["grad_norm_min"], r["grad_norm_max"], r["grad_norm_last"]) == (1.0, 5.0, 2.0)
    assert r["grad_norm_mean"] == pytest.approx(8.0 / 3)
    assert np.isnan(r["router_entropy_mean"]) and np.isnan(r["router_entropy_max"])


def test_a_crash_mid_compaction_shows_no_row_twice_and_is_cleaned(tmp_path: Path) -> None:
    run = tmp_path / "r"
    for i, s0 in enumerate(range(0, 100, 25)):
        write_parts(run, report_frames([report(s) for s in range(s0, s0 + 25)]), i * 10)
    d = run / schema.TABLE_EXPERTS
    before = read_table(run, schema.TABLE_EXPERTS).sort("step", "layer", "expert")
    inputs = [p.name for p in part_files(run, schema.TABLE_EXPERTS)]
    # kill -9 after the rename, before the inputs go: simulate by compacting with a grace
    out = compact_span(d, 0, 999, polars_schema(schema.TABLE_EXPERTS), grace_s=3600)
    assert out is not None and all((d / n).exists() for n in inputs)  # leftovers on disk...
    assert [p.name for p in part_files(run, schema.TABLE_EXPERTS)] == [out.name]  # ...hidden
    assert read_table(run, schema.TABLE_EXPERTS).sort("step", "layer", "expert").equals(before)
    (d / ".compact-part-x.parquet.123").write_bytes(b"half")  # a temp a kill left
    RunStore(run).close()  # the next open cleans both
    assert sorted(os.listdir(d)) == [out.name]
    assert read_table(run, schema.TABLE_EXPERTS).sort("step", "layer", "expert").equals(before)
    # a late part in a compacted span stays live, and the next compaction takes it in
    write_parts(run, report_frames([report(100)]), 99)
    assert len(part_files(run, schema.TABLE_EXPERTS)) == 2
    compact_span(d, 0, 999, polars_schema(schema.TABLE_EXPERTS))
    assert len(part_files(run, schema.TABLE_EXPERTS)) == 1 and len(os.listdir(d)) == 1
    assert read_table(run, schema.TABLE_EXPERTS)["step"].n_unique() == 101


_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from typing import Any
from guard.store.policy import StoreConfig
from guard.store.runstore import RunStore
from guard.store.writer import truncate_after
from tests.helpers_collector import make_report
run, start = Path(sys.argv[2]), int(sys.argv[3])
truncate_after(run, start - 1)  # a resume: drop what was written after the last acknowledged step
store = RunStore(run, flush_every=50, policy=StoreConfig(raw_window_steps=1000, incident_steps=2, compact_lag_steps=5))
s = start
while True:
    store.add_step(make_report(s, n_layers=2, n_experts=4))
    if s % 50 == 49:
        store.flush(wait=True)
        print(s, flush=True)  # acknowledged: on disk
    s += 1
"""


def _steps_seen(run: Path) -> list[int]:
    for _ in range(20):  # a listing can race a compaction's delete: list again (what readers do)
        try:
            return read_table(run, schema.TABLE_STEPS)["step"].to_list()
        except (FileNotFoundError, OSError, pl.exceptions.ComputeError):
            time.sleep(0.01)
    raise AssertionError("the steps table stayed unreadable")


def test_kill_9_at_random_points_loses_nothing_acknowledged_and_doubles_nothing(tmp_path: Path) -> None:
    run = tmp_path / "r"
    rng = random.Random(38)
    acked = -1
    attempt = 0
    while acked < 2 * SEGMENT_STEPS + 300 and attempt < 20:  # past a retirement, killed into at random
        attempt += 1
        out = tmp_path / f"acked-{attempt}.txt"
        with open(out, "w") as f:
            p = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(ROOT), str(run), str(acked + 1)], stdout=f
            )
        # kill -9 at a random point after this writer acknowledged something new (a loaded CI box
        # can take seconds to start it), while it flushes, compacts, rolls up or retires
        kill_at, start = None, time.monotonic()
        while kill_at is None or time.monotonic() < kill_at:
            seen = _steps_seen(run)  # readable throughout, never a row twice
            assert len(seen) == len(set(seen))
            if kill_at is None and out.read_text().split():
                kill_at = time.monotonic() + rng.uniform(0.0, 2.0)
            assert time.monotonic() - start < 120, "the writer acknowledged nothing in 120 s"
            time.sleep(0.1)
        p.send_signal(signal.SIGKILL)
        p.wait()
        lines = [int(x) for x in out.read_text().split()]
        if lines:
            acked = lines[-1]
        seen = _steps_seen(run)
        assert len(seen) == len(set(seen))
        assert set(range(acked + 1)) <= set(seen)  # every acknowledged step
    assert acked > 2 * SEGMENT_STEPS + 300  # compactions and retention ran, and were killed into
    subprocess.run(  # a last clean open: leftovers go, the store reads whole
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); from guard.store.runstore import RunStore; "
            "from guard.store.writer import truncate_after; truncate_after(sys.argv[2], int(sys.argv[3])); RunStore(sys.argv[2]).close()",
            str(ROOT),
            str(run),
            str(acked),
        ],
        check=True,
    )
    seen = sorted(_steps_seen(run))
    assert seen == list(range(acked + 1))
    for t in schema.TABLES:
        assert not layout.hidden_part_files(run / t)
    ex = read_table(run, schema.TABLE_EXPERTS)
    per_step = ex.group_by("step").len()
    assert (per_step["len"] == 4).all()  # 2 layers: MoE layer 1 only, 4 experts; none doubled
    r1000 = pl.read_parquet(rollup_part_files(run, schema.TABLE_EXPERTS, 1000))
    assert r1000.group_by("layer", "expert", "step").len()["len"].max() == 1
    full = r1000.filter(pl.col("step") + SEGMENT_STEPS <= acked)
    assert (full["n"] == SEGMENT_STEPS).all()  # every closed segment rolled up whole, once


def test_the_collectors_copy_is_compacted_and_rolled_up_through_ingest(tmp_path: Path) -> None:
    from guard.collector.config import CollectorConfig
    from guard.collector.service import Collector

    c = Collector(
        CollectorConfig(runs_dir=tmp_path / "runs", token=None, checkpoint_interval_s=0.05, store=SMALL)
    )
    c.start()
    try:
        reps = [report(s) for s in range(2600)]
        for seq, i in enumerate(range(0, 2600, 20)):
            events = [Event(step=1500, kind=schema.EV_VERDICT, detector="maxvio").row()] if i == 1500 else []
            ingest(c, batch("r1", 0, seq, reps[i : i + 20], events))
            if seq % 10 == 0:
                time.sleep(0.06)  # let checkpoints happen: one part per table per checkpoint
        run = tmp_path / "runs" / "r1"
        deadline = time.monotonic() + 60
        while len(rollup_part_files(run, schema.TABLE_EXPERTS, 1000)) < 2:  # segment 1's upkeep
            assert time.monotonic() < deadline, "segment 1 was never rolled up"
            time.sleep(0.05)
        r100 = pl.read_parquet(rollup_part_files(run, schema.TABLE_EXPERTS, 100))
        assert r100["step"].max() == 1900  # closed segments only; the live tail stays raw
        # the run ends (rank 0's final beat): its tail is rolled up when the collector closes it
        ingest(c, beat("r1", 0, seq + 1, step=2599, final=True))
    finally:
        c.close()
    run = tmp_path / "runs" / "r1"
    steps = read_table(run, schema.TABLE_STEPS)["step"].sort().to_list()
    assert steps == list(range(2600))
    for t in (schema.TABLE_STEPS, schema.TABLE_EXPERTS, schema.TABLE_LAYERS):
        firsts = [layout.parse_part(p.name).first_step for p in part_files(run, t)]  # type: ignore[union-attr]
        assert sum(f < 2 * SEGMENT_STEPS for f in firsts) == 2, (t, firsts)  # one per closed segment
    truth = pl.DataFrame(expert_columns(reps))
    got = pl.read_parquet(rollup_part_files(run, schema.TABLE_EXPERTS, 100))
    want = (
        truth.with_columns((pl.col("step") // 100 * 100).alias("step"))
        .group_by("layer", "expert", "step")
        .agg(pl.col("load").max())
    )
    j = got.join(want, on=["layer", "expert", "step"])
    assert j.height == got.height and got["step"].max() == 2500
    assert (j["load_max"] == j["load"].cast(pl.Float32)).all()
    doc = read_summary(run)
    assert doc is not None and doc["steps_written"] == 2600 and 1500 in doc["incidents"]
    assert doc["rolled_through"] == 1


def _digest(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def test_an_old_store_opens_unchanged(tmp_path: Path) -> None:
    run = tmp_path / "old"
    seq = 0
    for s0 in range(0, 1500, 50):  # written as before issue #38: parts, meta, no summary, no rollups
        seq = write_parts(run, report_frames([report(s) for s in range(s0, s0 + 50)]), seq)
    (run / schema.META_FILE).write_text(json.dumps({"run_id": "old", "status": "finished"}))
    before = _digest(run)
    assert read_summary(run) is None and layout.rollup_resolutions(run, schema.TABLE_EXPERTS) == []
    assert retention.full_fidelity_ranges(run) == [(0, 1499)]
    assert read_table(run, schema.TABLE_STEPS).height == 1500
    assert _digest(run) == before  # reading changed nothing
    store = RunStore(run, policy=SMALL)  # a writer resuming it: old parts stay as they were
    for s in range(1500, 1520):
        store.add_step(report(s))
    store.close()
    after = _digest(run)
    assert {k: v for k, v in after.items() if k in before and k != schema.META_FILE} == {
        k: v for k, v in before.items() if k != schema.META_FILE
    }
    doc = read_summary(run)
    assert doc is not None and doc["steps_written"] == 1520 and doc["rolled_from"] == 1


def test_store_config_names_the_bad_key(tmp_path: Path) -> None:
    from guard.core.tomlconf import ConfigError

    with pytest.raises(ConfigError, match="store.raw_window_steps"):
        load_store_config(table={"raw_window_steps": 5})
    with pytest.raises(ConfigError, match="store.nope"):
        load_store_config(table={"nope": 1})
    f = tmp_path / "s.toml"
    f.write_text("[store]\nraw_window_steps = 0\n")
    assert not load_store_config(f).retires_raw
    assert load_store_config(ROOT / "configs" / "store.toml") == StoreConfig()  # the documented defaults
    from trainer.config import load_config  # the training config's [store] table

    assert load_config(overrides={"store.raw_window_steps": 0}).store.raw_window_steps == 0


def test_retired_rollup_segments_merge_into_blocks_and_read_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guard.store import maintain

    monkeypatch.setattr(maintain, "ROLLUP_BLOCK_SEGMENTS", {100: 2, 1000: 2})
    run = tmp_path / "r"
    store = RunStore(run, flush_every=100, policy=SMALL)
    reps = [report(s) for s in range(3100)]
    for r in reps:
        store.add_step(r)
    store.close()
    truth = pl.DataFrame(expert_columns(reps))
    for res in (100, 1000):
        names = [p.name for p in rollup_part_files(run, schema.TABLE_EXPERTS, res)]
        assert layout.parse_part(names[0]).compacted and len(names) == 3, names  # type: ignore[union-attr]
        assert not layout.hidden_part_files(layout.rollup_table_dir(run, schema.TABLE_EXPERTS, res))
        got = pl.read_parquet(rollup_part_files(run, schema.TABLE_EXPERTS, res))
        want = (
            truth.with_columns((pl.col("step") // res * res).alias("step"))
            .group_by("layer", "expert", "step")
            .agg(pl.col("load").max(), pl.len().alias("rows"))
        )
        j = got.join(want, on=["layer", "expert", "step"])
        assert j.height == got.height == want.height  # every bucket once, none lost
        assert (j["load_max"] == j["load"].cast(pl.Float32)).all() and (j["n"] == j["rows"]).all()


def test_a_resume_mid_segment_rolls_that_segment_up_again_from_the_new_timeline(tmp_path: Path) -> None:
    from guard.store.writer import truncate_after

    run = tmp_path / "r"
    store = RunStore(run, flush_every=50, policy=SMALL)
    for s in range(2600):
        store.add_step(report(s))
    store.close()
    assert truncate_after(run, 1499) > 0  # resumed from a checkpoint at step 1499
    store = RunStore(run, flush_every=50, policy=SMALL)
    store.add_event(Event(step=1500, kind=schema.EV_RESUME))
    final = []
    for s in range(1500, 3200):
        r = report(s)
        r.loss = 3.0  # the new timeline differs
        r.load_ME = r.load_ME + 1000
        store.add_step(r)
        final.append(r)
    store.close()
    steps = read_table(run, schema.TABLE_STEPS).sort("step")
    assert steps["step"].to_list() == list(range(3200))  # nothing doubled, nothing lost
    assert (steps.filter(pl.col("step") >= 1500)["loss"] == 3.0).all()
    r1000 = pl.read_parquet(rollup_part_files(run, schema.TABLE_EXPERTS, 1000))
    seg1 = r1000.filter(pl.col("step") == 1000)
    assert (seg1["n"] == 1000).all() and (seg1["step_hi"] == 1999).all()
    assert (seg1["load_max"] >= 1000).all()  # the new timeline's rows are in it
    assert r1000.group_by("layer", "expert", "step").len()["len"].max() == 1
    doc = read_summary(run)
    assert doc is not None and doc["steps_written"] == 3200 and doc["last_step"] == 3199
    assert 1500 in doc["incidents"]  # the restart is an incident: its neighbourhood stays raw


def test_a_detector_firing_every_step_cannot_grow_the_summary_or_the_raw_rows() -> None:
    doc: dict[str, Any] = {}
    retention.grant(doc, [10, 500], half=25, budget=60)  # the first window fits, the second not
    assert doc["granted"] == [[10, 25]] and doc["incident_points"] == [[500, 500]]
    for s0 in range(1000, 101_000, 50):  # a detector fires on every step, flush after flush
        retention.grant(doc, range(s0, s0 + 50), half=25, budget=60)
    assert doc["incident_count"] == 2 + 100_000
    assert doc["incident_points"] == [[500, 500], [1000, 100_999]]  # one range, not 100,000 entries
    assert len(doc["incidents"]) == retention.NEWEST_INCIDENTS and doc["incidents"][-1] == 100_999
    assert retention.kept_windows(doc)[:2] == [(0, 35), (500, 500)]
    assert len(json.dumps(doc)) < 20_000


def test_a_resume_into_retired_segments_keeps_older_rollups_and_doubles_nothing(tmp_path: Path) -> None:
    from guard.store.writer import truncate_after

    run = tmp_path / "r"
    store = RunStore(run, flush_every=50, policy=SMALL)
    for s in range(3600):
        store.add_step(report(s))
    store.close()
    assert read_summary(run)["retired"] == [0, 1999]  # type: ignore[index]
    truncate_after(run, 1499)  # resumed from a checkpoint whose segment was already thinned
    assert read_summary(run)["retired"] == [0, 999]  # type: ignore[index]
    store = RunStore(run, flush_every=50, policy=SMALL)
    for s in range(1500, 3600):
        store.add_step(report(s))
    store.close()
    assert sorted(read_table(run, schema.TABLE_STEPS)["step"].to_list()) == list(range(3600))
    r1000 = pl.read_parquet(rollup_part_files(run, schema.TABLE_EXPERTS, 1000))
    assert r1000.group_by("layer", "expert", "step").len()["len"].max() == 1  # no bucket twice
    n = dict(r1000.group_by("step").agg(pl.col("n").min()).iter_rows())
    assert n[0] == n[2000] == 1000  # untouched before, whole after
    assert 500 <= n[1000] < 1000  # the resumed-into segment: its thinned rows plus the new ones
