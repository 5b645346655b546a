"""Bad `--run-dir` paths (issue #31, item 6): a file, a folder under a file, a place nobody can
write: one line naming the path and why, exit 2 (not a traceback and exit 1, "crashed"), and
nothing written anywhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from guard.store.layout import run_dir_problem
from tests.trainer.test_cli import one_line_error, train


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_file_and_a_folder_under_a_file_are_one_line_and_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("not a run folder\n")
    before = listing(tmp_path)
    line = one_line_error(train(f, "--steps", "2", "--no-progress"))
    assert str(f) in line and "is a file, not a folder" in line and "nothing was written" in line
    line = one_line_error(train(f / "sub" / "run", "--steps", "2", "--no-progress"))
    assert str(f / "sub" / "run") in line and f"'{f}' is a file" in line
    assert listing(tmp_path) == before and f.read_text() == "not a run folder\n"


def test_an_unwritable_place_is_one_line_and_exit_2(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root writes through file modes: /proc takes no new folders from anyone
        where = Path("/proc") / "moeguard-test" / "run"
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        where = ro / "run"
    line = one_line_error(train(where, "--steps", "2", "--no-progress"))
    assert str(where) in line and "cannot write in" in line
    assert not where.exists()


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_good_places_have_no_problem_and_the_probe_leaves_nothing(tmp_path: Path, make: str) -> None:
    d = tmp_path / "a" / "b" if make == "missing" else tmp_path
    assert run_dir_problem(d) is None
    assert listing(tmp_path) == []
