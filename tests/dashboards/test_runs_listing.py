"""Issue #38, the Runs page flat from 10k to 1M steps: a run whose summary.json is current is
listed from it (meta.json, summary.json, one stat() per newest part), never by listing its table
folders (~1,020 names each at 1M steps); a cut part is still reported; an old store, a summary
written before the listing existed, and a summary the parts moved past are listed as before."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import pytest

from bench.scale.big_run import write_big_run
from bench.scale.month_store import write_month_run
from dashboards.data import loaders, runs
from guard.core import schema
from guard.store import layout, summary
from guard.store.writer import write_part_file
from tests.dashboards.synth_run import SynthRun, write_run


@pytest.fixture(scope="module")
def month(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2,000-step run as RunStore's upkeep leaves it (compacted segment, flush parts)."""
    d = tmp_path_factory.mktemp("listing") / "month"
    write_month_run(d, steps=2000, layers=2, experts=4, ranks=4, incident_every=1000, recent=1000, radius=20)
    return d


def count_listings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every table folder os.listdir / os.scandir is asked for from now on."""
    seen: list[str] = []
    real_listdir, real_scandir = os.listdir, os.scandir

    def note(p: object) -> None:
        if os.path.basename(os.fspath(p).rstrip(os.sep)) in schema.TABLES:  # type: ignore[arg-type]
            seen.append(os.fspath(p))  # type: ignore[arg-type]

    def listdir(p: object = ".") -> list[str]:
        note(p)
        return real_listdir(p)  # type: ignore[arg-type]

    def scandir(p: object = "."):  # noqa: ANN202
        note(p)
        return real_scandir(p)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "scandir", scandir)
    return seen


def runs_page(run: Path) -> tuple[runs.RunInfo, dict]:
    """What the Runs page reads of one run: its RunInfo and its summary row (cache bypassed)."""
    return runs.run_info(run), loaders.load_summary.__wrapped__(str(run), runs.run_signature(run))


def has_parts(run: Path) -> dict[str, bool]:
    return {t: bool(layout.part_files(run, t)) for t in schema.TABLES}


def test_a_finished_run_is_listed_without_listing_its_tables(month: Path, monkeypatch) -> None:
    seen = count_listings(monkeypatch)
    info, summ = runs_page(month)
    assert seen == []
    monkeypatch.undo()
    assert info.tables == has_parts(month) and info.tables[schema.TABLE_EXPERTS]
    assert not info.tables[schema.TABLE_EVALS]
    assert summ["step"] == 1999 and summ["damaged"] == []


def test_the_writer_names_each_tables_newest_parts_with_their_sizes(month: Path) -> None:
    doc = summary.read_summary(month)
    assert doc is not None and doc["summary_version"] == summary.SUMMARY_VERSION
    open_from = summary.open_segment_start(doc["last_step"])
    assert open_from == 1000
    for t in schema.TABLES:
        d = month / t
        rec = doc[summary.PARTS_KEY][t]
        names = layout.newest_part_names(d, open_from, summary.TAIL_BEFORE, summary.TAIL_MAX)
        assert rec["tail"] == [[n, (d / n).stat().st_size] for n in names], t
        assert rec["mtime_ns"] == (d.stat().st_mtime_ns if d.is_dir() else 0), t
    # the compacted first segment's part is among the steps tail: the newest before the open one
    steps_tail = [n for n, _ in doc[summary.PARTS_KEY][schema.TABLE_STEPS]["tail"]]
    assert layout.parse_part(steps_tail[0]).compacted and len(steps_tail) > 2
    assert summary.current_tails(doc, month) is not None


def test_a_part_cut_after_the_run_ended_is_still_reported(tmp_path: Path, monkeypatch) -> None:
    """Cut in place (a copy in progress): the folder's mtime does not move, the summary is still
    current, and the stat() of the part finds another size than the writer's."""
    run = write_run(tmp_path, SynthRun(run_id="cut", steps=200, seed=3))
    victim = layout.part_files(run, schema.TABLE_STEPS)[-1]
    victim.write_bytes(victim.read_bytes()[:-20])
    doc = summary.read_summary(run)
    assert doc is not None and summary.current_tails(doc, run) is not None
    seen = count_listings(monkeypatch)
    info, summ = runs_page(run)
    assert seen == []
    assert [p for p, _ in summ["damaged"]] == [f"{schema.TABLE_STEPS}/{victim.name}"]
    assert "truncated" in summ["damaged"][0][1]
    assert info.has_steps and summ["step"] == 199


def test_an_old_store_without_summary_is_listed_as_before(tmp_path: Path, monkeypatch) -> None:
    run = write_big_run(tmp_path / "old", steps=300, layers=2, experts=4, part_steps=50)
    assert summary.read_summary(run) is None
    victim = layout.part_files(run, schema.TABLE_LAYERS)[-1]
    victim.write_bytes(victim.read_bytes()[:-20])
    seen = count_listings(monkeypatch)
    info, summ = runs_page(run)
    assert seen  # no summary: the folders are listed
    monkeypatch.undo()
    assert info.tables == has_parts(run) and summ["step"] == 299
    assert [p for p, _ in summ["damaged"]] == [f"{schema.TABLE_LAYERS}/{victim.name}"]


def test_a_summary_written_before_the_listing_reads_and_lists(tmp_path: Path, monkeypatch) -> None:
    """summary.json of an older moeguard (same summary_version, no PARTS_KEY): read as before,
    its folders listed, a cut newest part found."""
    run = write_run(tmp_path, SynthRun(run_id="older", steps=200, seed=4))
    doc = summary.read_summary(run)
    assert doc is not None
    del doc[summary.PARTS_KEY]
    summary.write_summary(run, doc)
    victim = layout.part_files(run, schema.TABLE_STEPS)[-1]
    victim.write_bytes(victim.read_bytes()[:-20])
    seen = count_listings(monkeypatch)
    info, summ = runs_page(run)
    assert seen
    monkeypatch.undo()
    assert info.tables == has_parts(run) and summ["step"] == 199
    assert [p for p, _ in summ["damaged"]] == [f"{schema.TABLE_STEPS}/{victim.name}"]


def test_parts_written_after_the_summary_send_the_page_back_to_listing(tmp_path: Path, monkeypatch) -> None:
    """A table folder that changed since the writer's last save (here: a first evals part, and a
    cut part renamed into the steps folder) is not taken from the summary."""
    run = write_run(tmp_path, SynthRun(run_id="live", steps=200, seed=5))
    doc = summary.read_summary(run)
    assert doc is not None and not runs.run_info(run).tables[schema.TABLE_EVALS]
    steps = layout.part_files(run, schema.TABLE_STEPS)
    evals = run / schema.TABLE_EVALS
    evals.mkdir(exist_ok=True)
    write_part_file(evals / layout.part_name(150, 900), pl.DataFrame({"step": [150]}))
    late = run / schema.TABLE_STEPS / layout.part_name(199, 901)
    late.write_bytes(steps[-1].read_bytes()[:-20])
    os.utime(run / schema.TABLE_STEPS, ns=(0, doc[summary.PARTS_KEY][schema.TABLE_STEPS]["mtime_ns"] + 10**9))
    assert summary.current_tails(doc, run) is None
    seen = count_listings(monkeypatch)
    info, summ = runs_page(run)
    assert seen
    assert info.tables[schema.TABLE_EVALS]
    assert f"{schema.TABLE_STEPS}/{late.name}" in [p for p, _ in summ["damaged"]]
