"""meta.json's goodput and the end-of-run summary's are one figure (issue #40, item 7): each took
report(now) at its own moment (11.1% in meta.json, 10.6% printed, for one run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from guard.store.reader import read_meta
from tests.conftest import MICRO, REPO, train_micro


def test_the_goodput_after_the_run_is_the_one_meta_json_holds(tmp_path: Path) -> None:
    t = train_micro(tmp_path / "r", overrides={"train.steps": 3, "train.threads": 1})
    meta = read_meta(tmp_path / "r")
    assert t.goodput() == meta["goodput"]  # taken once, at the end
    assert t.goodput() == t.goodput()


def test_the_cli_summary_prints_meta_jsons_goodput(tmp_path: Path) -> None:
    run = tmp_path / "r"
    cmd = [sys.executable, "-m", "guard", "train", "--config", str(MICRO), "--run-dir", str(run)]
    p = subprocess.run(
        [*cmd, "--steps", "3", "--set", "train.threads=1", "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    gp = read_meta(run)["goodput"]["goodput"]
    assert f"goodput {gp:.1%} " in p.stdout, (gp, p.stdout)
