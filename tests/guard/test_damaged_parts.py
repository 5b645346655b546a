"""A damaged Parquet part (issue #31, item 1): half a file under runs/<run>/steps/ (a crash, a full
disk, a copy in progress) is skipped with a warning naming it; the rest of the run and every other
run still read, through the reader, `moeguard replay` and the app's Runs and Run health pages."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from guard.cli import main as cli_main
from guard.core import schema
from guard.store import reader
from guard.store.layout import part_files
from guard.store.runstore import RunStore
from tests.helpers_collector import make_report


def write_run(run_dir: Path, steps: int = 100, flush_every: int = 25) -> Path:
    store = RunStore(run_dir, flush_every=flush_every)
    store.write_meta({"run_id": run_dir.name, "status": "finished", "config": {"guard": {}}})
    for s in range(steps):
        store.add_step(make_report(s, t=1000.0 + s))
    store.close()
    return run_dir


def truncate(p: Path) -> Path:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    return p


def test_reader_skips_a_truncated_part_and_names_it(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r")
    bad = truncate(part_files(run, schema.TABLE_STEPS)[1])  # steps 25..49
    with pytest.warns(reader.DamagedPartWarning, match=bad.name):
        steps = reader.read_table(run, schema.TABLE_STEPS)
    assert sorted(steps["step"].to_list()) == [*range(25), *range(50, 100)]
    assert [d.path for d in reader.damaged_parts(run)] == [bad]
    assert "truncated" in reader.damaged_parts(run)[0].reason
    with pytest.warns(reader.DamagedPartWarning):
        assert reader.last_step(run) == 99
        assert [r.step for r in reader.read_reports(run)] == [*range(25), *range(50, 100)]
        assert reader.count_actions(run) is not None


def test_not_parquet_and_empty_parts_are_skipped(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r")
    parts = part_files(run, schema.TABLE_LAYERS)
    parts[0].write_bytes(b"")  # a full disk
    parts[2].write_bytes(b"<html>not parquet at all</html>" * 4)
    reasons = {d.path: d.reason for d in reader.damaged_parts(run)}
    assert set(reasons) == {parts[0], parts[2]}
    assert "too short" in reasons[parts[0]] and "not a Parquet file" in reasons[parts[2]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", reader.DamagedPartWarning)
        layers = reader.read_table(run, schema.TABLE_LAYERS)
    assert sorted(set(layers["step"].to_list())) == [*range(25, 50), *range(75, 100)]


def test_a_part_that_a_copy_finishes_later_is_read_again(tmp_path: Path) -> None:
    """The check is remembered per (size, mtime), not forever: a copy in progress completes."""
    run = write_run(tmp_path / "r")
    p = part_files(run, schema.TABLE_STEPS)[0]
    whole = p.read_bytes()
    truncate(p)
    assert reader.damaged_parts(run)
    p.write_bytes(whole)
    assert reader.damaged_parts(run) == []
    assert reader.read_table(run, schema.TABLE_STEPS).height == 100


def test_replay_prints_the_damaged_part_and_replays_the_rest(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "r")
    bad = truncate(part_files(run, schema.TABLE_STEPS)[2])
    assert cli_main(["replay", str(run)]) == 0
    out, err = capsys.readouterr()
    assert f"skipped damaged part {bad}" in err and "truncated" in err
    assert err.count(bad.name) == 1  # said once, not once per table scan
    assert "replayed 75 steps" in out
