"""The command line a benchmark writes into docs/BENCHMARKS.md names no path of the machine that ran
it (bench.common.docs.shown_command, which every docs-writing bench calls)."""

from __future__ import annotations

from bench.common.docs import shown_command
from bench.detection.detector_recorded import command_line


def test_absolute_paths_are_masked_and_the_rest_is_kept(tmp_path):
    out, work, run = tmp_path / "r.json", tmp_path / "work", tmp_path / "runs" / "mixtral-0"
    argv = ["--blocks", "8", "--out", str(out), f"--dir={work}", str(run), "configs/tiny.toml", "--keep"]
    shown = shown_command("-m bench.x", argv)
    assert str(tmp_path) not in shown
    assert (
        shown
        == "python -m bench.x --blocks 8 --out OUT.json --dir=DIR PATH/mixtral-0 configs/tiny.toml --keep"
    )


def test_recorded_runs_keep_their_names_and_other_paths_are_masked(tmp_path):
    run = tmp_path / "clean1k" / "olmoe-0"
    shown = command_line([str(run), "--out", str(tmp_path / "o.json")], {str(run)})
    assert str(tmp_path) not in shown
    assert shown == "python bench/detection/detector_recorded.py RUNS/olmoe-0 --out OUT.json"
