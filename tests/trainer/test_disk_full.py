"""A full disk is one line, exit 4, and meta.json says how the run ended (issue #40, item 4).

It used to be `RuntimeError: run store writer failed: ... No space left on device` with a
traceback, exit 1, and meta.json left `running`. The disk is not filled for real: the real CLI
runs in a child process whose Parquet writes fail from step 10 on as polars fails them on a full
disk (a ComputeError carrying "No space left on device (os error 28)"), optionally meta.json's
writes too; everything else (the run store's writer thread, the trainer, the CLI) is the real path.
The profiler's trace is skipped, with a warning, on a disk with less than 1 GiB free.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from guard.core import schema
from guard.store.full import EXIT_DISK_FULL, disk_full_line
from guard.store.reader import read_meta, read_table
from tests.conftest import MICRO, REPO

CHILD = """
import errno, sys
import polars as pl
from polars.exceptions import ComputeError
import guard.store.runstore as runstore
from guard.cli import main

full = [False]
real_parquet, real_meta = pl.DataFrame.write_parquet, runstore.atomic_write_json

def write_parquet(self, *a, **k):
    if full[0] or ("step" in self.columns and self.height and self["step"].min() >= 10):
        full[0] = True
        raise ComputeError(
            "parquet: File out of specification: underlying IO error: No space left on device (os error 28)"
        )
    return real_parquet(self, *a, **k)

def write_meta(path, obj):
    if full[0] and META_FULL:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return real_meta(path, obj)

pl.DataFrame.write_parquet = write_parquet
runstore.atomic_write_json = write_meta
META_FULL = sys.argv[1] == "meta-too"
sys.exit(main(sys.argv[2:]))
"""


def train_on_a_full_disk(run: Path, mode: str) -> subprocess.CompletedProcess:
    args = ["train", "--config", str(MICRO), "--run-dir", str(run), "--steps", "40", "--no-progress"]
    return subprocess.run(
        [sys.executable, "-c", CHILD, mode, *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_a_full_disk_is_one_line_with_its_own_exit_code_and_meta_json_says_so(tmp_path: Path) -> None:
    run = tmp_path / "r"
    p = train_on_a_full_disk(run, "parts")
    assert p.returncode == EXIT_DISK_FULL, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("moeguard train: disk full: run store ") and str(run) in line, line
    assert "no space left on device" in line and "free on its disk" in line, line
    meta = read_meta(run)
    assert meta["status"] == schema.STATUS_CRASHED, meta["status"]
    assert "disk full" in meta["status_note"] and "rows written before it are kept" in meta["status_note"]
    kept = read_table(run, schema.TABLE_STEPS)["step"].to_list()
    assert kept == list(range(min(kept), max(kept) + 1)) and kept[:1] == [0] and max(kept) < 10, kept


def test_when_meta_json_cannot_be_written_either_the_line_says_so(tmp_path: Path) -> None:
    run = tmp_path / "r"
    p = train_on_a_full_disk(run, "meta-too")
    assert p.returncode == EXIT_DISK_FULL, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert "meta.json could not be written either" in line and "still says running" in line, line
    assert read_meta(run)["status"] == schema.STATUS_RUNNING  # as the line says


def test_the_line_reads_polars_and_os_errors_alike(tmp_path: Path) -> None:
    err = pl.exceptions.ComputeError("underlying IO error: No space left on device (os error 28)")
    assert disk_full_line(err, tmp_path).startswith(f"disk full: {tmp_path}: no space left on device (")
    assert "free on its disk" in disk_full_line(OSError(122, "Disk quota exceeded", str(tmp_path / "x")))
    assert disk_full_line(OSError(2, "No such file or directory")) is None
    assert disk_full_line(RuntimeError("os error 5")) is None


def test_the_profiler_trace_is_skipped_on_a_nearly_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import train_micro
    from trainer.callbacks import profiler

    monkeypatch.setattr(profiler, "free_bytes", lambda path: 200 * 10**6)
    over = {"train.steps": 12, "telemetry.profile": True, "telemetry.profile_wait": 1}
    train_micro(tmp_path / "r", overrides=over)
    err = capsys.readouterr().err
    assert "profiler trace skipped: 200.0 MB free on the disk of" in err, err
    assert not any((tmp_path / "r" / schema.PROFILE_DIR).glob("**/*.json*"))

    monkeypatch.setattr(profiler, "free_bytes", lambda path: 50 * 10**9)
    train_micro(tmp_path / "r2", overrides=over)
    assert any((tmp_path / "r2" / schema.PROFILE_DIR).glob("**/*.json*"))  # room to spare: written
