"""Part-file names (issue #13, item 2): one definition, no overflow past seq 999,999.

A store whose parts run 999998, 999999, 1000000, 1000001, ... must read whole and in order
through every reader: reader.read_table, the README's glob, the app's loader, and the
collector (recovery, resume truncation, next part number).
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from dashboards.data import loaders, runs
from guard.core import schema
from guard.store import reader
from guard.store.layout import PartName, next_part_seq, parse_part_name, part_files, part_name
from guard.store.reader import read_meta, read_table
from guard.store.runstore import RunStore
from guard.store.writer import report_frames, truncate_after, write_part_file
from tests.helpers_collector import CollectorProc, batch, make_report, wait_steps
from tests.helpers_http import wait_until

G1, G2 = 1_700_000_000 << 32, 1_700_000_100 << 32


def test_part_name_round_trip_and_widths() -> None:
    assert part_name(0, 0) == "part-0000000000-000000.parquet"  # the format old stores have
    assert part_name(12, 999_999) == "part-0000000012-999999.parquet"
    assert part_name(12, 1_000_000) == "part-0000000012-1000000.parquet"
    assert part_name(10**11, 5) == "part-100000000000-000005.parquet"
    for first, seq in ((0, 0), (7, 999_999), (7, 1_000_000), (10**11, 10**9)):
        assert parse_part_name(part_name(first, seq)) == PartName(first, seq)
    for junk in (
        "part-0000000000-00000.parquet",
        "part-000000000-000000.parquet",
        "part-0000000000-000000.parq",
        ".part-0000000000-000000.parquet.tmp",
        "xpart-0000000000-000000.parquet",
        "part-0000000000-00000a.parquet",
        "wal-abc.log",
        "part--1-000000.parquet",
    ):
        assert parse_part_name(junk) is None, junk
    with pytest.raises(ValueError):
        part_name(-1, 0)
    # numeric order, not string order: "1000000" sorts before "999999" as text
    names = [part_name(5, s) for s in (1_000_001, 999_998, 1_000_000, 999_999)]
    assert sorted(names, key=parse_part_name) == [
        part_name(5, s) for s in (999_998, 999_999, 1_000_000, 1_000_001)
    ]


def _seed(run: Path, seqs: list[int], steps_per_part: int = 5) -> None:
    """Parts of the steps / layers / experts tables with the given seqs (steps 0, 5, 10, ...)."""
    for i, seq in enumerate(seqs):
        reps = [make_report(s) for s in range(i * steps_per_part, (i + 1) * steps_per_part)]
        for table, df in report_frames(reps).items():
            (run / table).mkdir(parents=True, exist_ok=True)
            write_part_file(run / table / part_name(reps[0].step, seq), df)


def _readers(run: Path) -> dict[str, list[int]]:
    """Steps as each reader returns them (unsorted: the order is part of the contract)."""
    reader.clear_cache()
    return {
        "read_table": read_table(run, schema.TABLE_STEPS)["step"].to_list(),
        "readme_glob": pl.scan_parquet(str(run / "steps" / "*.parquet")).collect()["step"].to_list(),
        "app_loader": loaders.load_steps(str(run), runs.run_signature(run))["step"].to_list(),
        "app_scan": reader.scan_table(run, schema.TABLE_STEPS, cached=True).collect()["step"].to_list(),
    }


def test_every_reader_reads_parts_past_999999_in_order(tmp_path: Path) -> None:
    run = tmp_path / "big"
    _seed(run, [999_998, 999_999, 1_000_000, 1_000_001])
    for t in (schema.TABLE_STEPS, schema.TABLE_LAYERS, schema.TABLE_EXPERTS):
        assert [parse_part_name(p.name).seq for p in part_files(run, t)] == [
            999_998,
            999_999,
            1_000_000,
            1_000_001,
        ]
        assert [p.name for p in reader.cached_part_files(run, t)] == [p.name for p in part_files(run, t)]
    for name, steps in _readers(run).items():
        assert steps == list(range(20)), name
    assert read_table(run, schema.TABLE_EXPERTS).height == 20 * 2 * 8
    assert next_part_seq(run) == 1_000_002
    # the trainer's own writer continues from there, and a resume truncates the wide parts too
    store = RunStore(run, flush_every=5)
    for s in range(20, 30):
        store.add_step(make_report(s))
    store.close()
    assert max(parse_part_name(p.name).seq for p in part_files(run, schema.TABLE_STEPS)) >= 1_000_002
    for name, steps in _readers(run).items():
        assert steps == list(range(30)), name
    assert truncate_after(run, 17) == 12 + 12 * 4 + 12 * 2 * 8
    for name, steps in _readers(run).items():
        assert steps == list(range(18)), name


def test_readers_skip_what_is_not_a_part(tmp_path: Path) -> None:
    run = tmp_path / "r"
    _seed(run, [0, 1])
    (run / "steps" / part_name(99, 7)).mkdir()  # a folder named like a part
    (run / "steps" / ".part-0000000010-000002.parquet.tmp").write_bytes(b"half")
    (run / "steps" / "notes.txt").write_text("x")
    assert [p.name for p in part_files(run, schema.TABLE_STEPS)] == [part_name(0, 0), part_name(5, 1)]
    reader.clear_cache()
    assert [p.name for p in reader.cached_part_files(run, schema.TABLE_STEPS)] == [
        part_name(0, 0),
        part_name(5, 1),
    ]
    assert read_table(run, schema.TABLE_STEPS)["step"].to_list() == list(range(10))


def test_read_meta_is_none_for_a_meta_that_is_not_an_object(tmp_path: Path) -> None:
    (tmp_path / schema.META_FILE).write_text(json.dumps([1, 2]))
    assert read_meta(tmp_path) is None
    (tmp_path / schema.META_FILE).write_bytes(b"\xff\xfe garbage")
    assert read_meta(tmp_path) is None


@pytest.mark.integration
def test_collector_writes_recovers_and_resumes_past_part_999999(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run = runs / "big"
    _seed(run, [999_998, 999_999])  # steps 0..9, as if an earlier writer had got this far
    c = CollectorProc(runs, "--checkpoint-interval", "0.2").start()
    try:
        assert c.post(batch("big", 0, G1 | 1, [make_report(s) for s in range(10, 20)])).status_code == 200
        assert wait_steps(run, 20).height == 20
        assert c.post(batch("big", 0, G1 | 2, [make_report(s) for s in range(20, 30)])).status_code == 200
        assert wait_steps(run, 30).height == 30
        # a checkpoint writes its tables one after another: the steps table can show all 30 rows
        # before the last table's part is there (seen at load 12)
        seqs = lambda: sorted(parse_part_name(p.name).seq for t in schema.TABLES for p in part_files(run, t))  # noqa: E731
        wait_until(lambda: seqs()[-1] >= 1_000_005, timeout=30, what="the second checkpoint's last part")
        assert seqs()[0] == 999_998 and seqs()[-1] == 1_000_005
        for name, steps in _readers(run).items():
            assert steps == list(range(30)), name
        # SIGKILL and restart: no committed part is taken for uncommitted, the dedupe holds
        c.kill()
        c.start()
        assert (
            c.post(batch("big", 0, G1 | 2, [make_report(s) for s in range(20, 30)])).json()["duplicate"]
            is True
        )
        for name, steps in _readers(run).items():
            assert steps == list(range(30)), name
        # a resumed trainer re-runs 25..34: the rows after 24 in the wide parts are replaced
        resumed = [make_report(s, loss=7.0) for s in range(25, 35)]
        assert c.post(batch("big", 0, G2 | 1, resumed)).status_code == 200
        c.stop()
        for name, steps in _readers(run).items():
            assert steps == list(range(35)), name
        df = read_table(run, schema.TABLE_STEPS)
        assert df.filter(pl.col("step") >= 25)["loss"].to_list() == [7.0] * 10
        assert read_table(run, schema.TABLE_EXPERTS).height == 35 * 2 * 8
        assert next_part_seq(run) > 1_000_005
    finally:
        c.stop()
