"""Issue #38, the read side: reads proportional to what is shown, on a store with rollups and
retired raw rows (bench/scale/month_store.py builds it with the writer's own rollup code), and a
store written before rollups opening as it did."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import polars as pl
import pytest

from bench.scale.big_run import write_big_run
from bench.scale.month_store import write_month_run
from guard.core import schema
from guard.core.rows import reports_from_columns
from guard.store import damage, layout, reader

STEPS = 3000


@pytest.fixture(scope="module")
def month(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("long") / "month"
    info = write_month_run(
        d, steps=STEPS, layers=4, experts=8, ranks=16, incident_every=1000, recent=1000, radius=20
    )
    return d, info


def test_read_series_picks_the_resolution_that_fits(month) -> None:
    d, info = month
    # retention retires whole segments: 0 and 1 (past the 1,000-step raw window) keep their
    # incidents' windows, segment 2 (2000..2999) is whole
    assert info["ranges"] == [(313, 353), (1313, 1353), (2000, 2999)]
    whole = reader.read_series(d, schema.TABLE_EXPERTS, columns=("load",))
    assert (whole.lo, whole.hi, whole.resolution) == (0, STEPS - 1, 10)  # 300 buckets <= 2,000
    assert whole.frame["step"].n_unique() == STEPS // 10
    assert reader.read_series(d, schema.TABLE_EXPERTS, columns=("load",), max_points=100).resolution == 100
    assert reader.read_series(d, schema.TABLE_EXPERTS, columns=("load",), max_points=2).resolution == 1000
    # a short range kept at full fidelity (an incident's window, the recent window) reads every step
    inc = reader.read_series(d, schema.TABLE_EXPERTS, columns=("load",), lo=313, hi=353)
    assert inc.resolution == 1 and sorted(inc.frame["step"].unique()) == list(range(313, 354))
    assert reader.read_series(d, schema.TABLE_LAYERS, columns=("maxvio",), lo=2600, hi=2900).resolution == 1
    # a short range whose raw rows were retired reads the finest rollup that holds it
    assert reader.read_series(d, schema.TABLE_EXPERTS, columns=("load",), lo=500, hi=700).resolution == 10
    # every row is in exactly one bucket
    assert whole.frame["n"].sum() == STEPS * 4 * 8


@pytest.mark.parametrize("table", [schema.TABLE_LAYERS, schema.TABLE_EXPERTS, schema.TABLE_RANKS])
def test_rollup_extremes_equal_the_raw_extremes(month, table: str) -> None:
    """The raw rows are gone outside the kept windows, yet every resolution's min and max over
    the run equal those of the raw rows the run wrote (a dead expert at each incident: load 0)."""
    d, info = month
    cols = tuple(c for c in schema.rollup_value_columns(table) if c in info["extremes"][table])
    for mp in (2000, 100, 2):
        got = reader.read_series(d, table, columns=cols, max_points=mp)
        assert got.resolution > 1
        for c in cols:
            lo, hi = info["extremes"][table][c]
            assert math.isclose(got.frame[f"{c}_min"].min(), lo, rel_tol=1e-6), (table, c, mp)  # float32
            assert math.isclose(got.frame[f"{c}_max"].max(), hi, rel_tol=1e-6), (table, c, mp)
    if table == schema.TABLE_EXPERTS:
        assert info["extremes"][table]["load"][0] == 0  # the dead expert is in the extremes


def test_the_live_tail_past_the_rollups_is_read_from_finer_tiers(month, tmp_path: Path) -> None:
    """Steps the rollups do not cover yet (the last segment, still being written) come from the
    full-fidelity rows, bucketed the same way: nothing missing, nothing counted twice."""
    d = tmp_path / "live"
    shutil.copytree(month[0], d)
    for res in layout.ROLLUP_RESOLUTIONS:
        for p in layout.rollup_part_files(d, schema.TABLE_EXPERTS, res):
            if int(p.name.split("-")[1]) >= 2000:
                p.unlink()
    got = reader.read_series(d, schema.TABLE_EXPERTS, columns=("load",), max_points=100)
    # (segment 2, the newest, keeps every raw row)
    kept_raw = reader.read_table(d, schema.TABLE_EXPERTS).filter(pl.col("step") >= 2000).height
    assert kept_raw == 1000 * 4 * 8
    assert got.resolution == 100 and got.frame["n"].sum() == 2000 * 4 * 8 + kept_raw
    tail = got.frame.filter(pl.col("step") >= 2500)
    raw = reader.read_table(d, schema.TABLE_EXPERTS).filter(pl.col("step") >= 2500)
    assert tail["load_max"].max() == raw["load"].max() and tail["n"].sum() == raw.height


def test_a_store_without_rollups_reads_every_step_as_before(tmp_path: Path) -> None:
    d = write_big_run(tmp_path / "old", steps=300, layers=3, experts=4, part_steps=50)
    assert reader.rollup_resolutions(d, schema.TABLE_EXPERTS) == [] and reader.raw_ranges(d) is None
    got = reader.read_series(d, schema.TABLE_LAYERS, columns=("grad_norm",), max_points=10)
    raw = reader.read_table(d, schema.TABLE_LAYERS).sort("step", "layer")
    assert got.resolution == 1 and got.frame.height == raw.height
    assert got.frame.sort("step", "layer")["grad_norm_max"].to_list() == raw["grad_norm"].to_list()
    # a range opens only the parts its names say can hold it
    assert len(reader.parts_overlapping(layout.part_files(d, schema.TABLE_LAYERS), 120, 160)) == 2


def test_damaged_checks_are_incremental(tmp_path: Path) -> None:
    """Each part's footer is checked once; a new part, or one damaged after the first scan, is
    checked (and caught); nothing else is re-read."""
    d = write_big_run(tmp_path / "r", steps=500, layers=2, experts=4, part_steps=50)
    reader.clear_cache()
    n_parts = sum(len(layout.part_files(d, t)) for t in schema.TABLES)
    before = damage.footer_checks
    assert reader.damaged_parts(d) == []
    assert damage.footer_checks - before == n_parts
    assert reader.damaged_parts(d) == [] and damage.footer_checks - before == n_parts  # none again
    victim = layout.part_files(d, schema.TABLE_LAYERS)[2]
    victim.write_bytes(victim.read_bytes()[:-20])
    assert [x.path for x in reader.damaged_parts(d)] == [victim]
    assert damage.footer_checks - before == n_parts + 1
    assert [x.path for x in reader.damaged_parts(d)] == [victim]
    assert damage.footer_checks - before == n_parts + 1


def test_replay_reads_in_bounded_windows_with_the_same_reports(tmp_path: Path, monkeypatch) -> None:
    """read_reports holds at most about row_bound expert rows (here 1/20 of the table) and
    rebuilds exactly the reports a whole-table read gives."""
    d = write_big_run(tmp_path / "r", steps=400, layers=4, experts=16, part_steps=50)
    n_rows = 400 * 4 * 16
    held: list[int] = []
    real = reader.reports_from_columns

    def counting(steps, layers, experts, groups=None):
        held.append(len(experts["step"]))
        return real(steps, layers, experts, groups)

    monkeypatch.setattr(reader, "reports_from_columns", counting)
    streamed = list(reader.read_reports(d, row_bound=n_rows // 20))
    assert len(held) == 20 and max(held) <= n_rows // 20
    t = {x: reader.read_table(d, x) for x in (schema.TABLE_STEPS, schema.TABLE_LAYERS, schema.TABLE_EXPERTS)}
    whole = list(
        reports_from_columns(
            t[schema.TABLE_STEPS].sort("step").to_dict(as_series=False),
            {c: s.to_numpy() for c, s in t[schema.TABLE_LAYERS].sort("step", "layer").to_dict().items()},
            {
                c: s.to_numpy()
                for c, s in t[schema.TABLE_EXPERTS].sort("step", "layer", "expert").to_dict().items()
            },
        )
    )
    assert [r.step for r in streamed] == [r.step for r in whole] == list(range(400))
    for a, b in zip(streamed, whole, strict=True):
        assert (a.load_ME == b.load_ME).all() and (a.maxvio_M == b.maxvio_M).all() and a.loss == b.loss


def test_a_finer_rollup_kept_for_recent_steps_only_is_not_read_for_the_whole_run(
    month, tmp_path: Path
) -> None:
    """r10 rollups are kept for the newest steps only (policy r10_window_steps): a chart of the
    whole run reads r100, which reaches back to step 0; a chart of recent steps still reads r10."""
    d = tmp_path / "windowed"
    shutil.copytree(month[0], d)
    for p in layout.rollup_part_files(d, schema.TABLE_LAYERS, 10):
        if int(p.name.split("-")[1]) < 2000:
            p.unlink()
    whole = reader.read_series(d, schema.TABLE_LAYERS, columns=("maxvio",))
    assert whole.resolution == 100 and whole.frame["n"].sum() == STEPS * 4
    recent = reader.read_series(d, schema.TABLE_LAYERS, columns=("maxvio",), lo=2000, hi=2999, max_points=200)
    assert recent.resolution == 10


def test_newest_part_names_lists_the_open_segment_and_the_newest_before(month, tmp_path: Path) -> None:
    """The Runs page's listing (layout.newest_part_names): the live parts from a step on and the
    `before` newest before it, as a full listing would give them; temp files are not parts."""
    d = tmp_path / "copy"
    shutil.copytree(month[0], d)
    (d / schema.TABLE_STEPS / ".compact-part-x.parquet.1").write_bytes(b"")
    for t in (schema.TABLE_STEPS, schema.TABLE_EXPERTS, schema.TABLE_RANKS, schema.TABLE_EVENTS):
        live = layout.sorted_part_names(d / t)
        for from_step, before in ((2000, 2), (2000, 0), (1000, 1), (0, 2), (5000, 2)):
            firsts = [layout.parse_part(n).first_step for n in live]
            newer = [n for n, f in zip(live, firsts, strict=True) if f >= from_step]
            older = (
                [n for n, f in zip(live, firsts, strict=True) if f < from_step][-before:] if before else []
            )
            assert layout.newest_part_names(d / t, from_step, before) == tuple(older + newer), (t, from_step)
            for limit in (1, 3, 50):  # the newest `limit` of the same names (the collector's long tails)
                got = layout.newest_part_names(d / t, from_step, before, limit)
                assert got == tuple((older + newer)[-limit:]), (t, from_step, limit)


def test_a_replay_of_a_live_run_survives_a_compaction_between_its_windows(tmp_path: Path) -> None:
    """The store's upkeep compacts a live run while `moeguard replay` streams it: the parts the
    replay listed are gone for its next window; it lists again and rebuilds every step once, the
    same reports as a replay with no compaction."""
    from guard.store.compaction import compact_span

    d = write_big_run(tmp_path / "r", steps=400, layers=4, experts=16, part_steps=50)
    calm = [(r.step, r.loss, r.load_ME.sum()) for r in reader.read_reports(d, row_bound=400 * 4 * 16 // 8)]
    it = reader.read_reports(d, row_bound=400 * 4 * 16 // 8)
    got = [next(it)]  # the first window is read: every table listed
    for t in (schema.TABLE_STEPS, schema.TABLE_LAYERS, schema.TABLE_EXPERTS):
        before = layout.part_files(d, t)
        assert len(before) > 1
        assert compact_span(d / t, 0, 10**9, layout.polars_schema(t), force=True) is not None
        assert not any(p.exists() for p in before)  # deleted at once (grace_s 0)
    got += list(it)
    assert [(r.step, r.loss, r.load_ME.sum()) for r in got] == calm
    assert [r.step for r in got] == list(range(400))
