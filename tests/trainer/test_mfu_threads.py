"""One MFU (issue #31, item 4): a run pinned to fewer torch threads than its CPU class has cores
is held to the peak of the cores it can use. A 1-thread canary worker on a 2-core class showed
MFU 10.2% on the Runs page against the whole machine's peak, while the canary said 21.6%."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from guard.store.reader import read_meta, read_table
from tests.trainer.test_cli import train
from trainer import flops


def test_a_pinned_peak_is_scaled_to_the_threads_the_run_uses(tmp_path: Path) -> None:
    f = tmp_path / "peaks.toml"
    flops.write_cpu_peaks(
        {"cpu-x-8c": {"cores": 8, "fp32": 1.6e11, "measured": "2026-01-02", "method": "m"}}, f
    )
    full, src = flops.pinned_cpu_peak(torch.float32, "cpu-x-8c", f, threads=8)
    assert full == 1.6e11 and "cores" not in src.split("(m)")[1]
    two, src = flops.pinned_cpu_peak(torch.float32, "cpu-x-8c", f, threads=2)
    assert two == pytest.approx(0.4e11) and "x 2/8 cores: the run uses 2 torch thread(s)" in src
    assert flops.pinned_cpu_peak(torch.float32, "cpu-x-8c", f, threads=32)[0] == 1.6e11  # no more than all


def test_a_one_thread_run_records_the_one_thread_peak_and_its_mfu(tmp_path: Path) -> None:
    value, _ = flops.pinned_cpu_peak(torch.float32)
    if value is None:
        pytest.skip("this machine class has no pinned peak: MFU is not computed here")
    cores = flops.load_cpu_peaks()[flops.cpu_machine_class()]["cores"]
    p = train(tmp_path / "r", "--steps", "4", "--no-progress")  # train.threads=1 (tests/trainer/test_cli.py)
    assert p.returncode == 0, p.stderr[-2000:]
    env = read_meta(tmp_path / "r")["env"]
    assert env["peak_flops"] == pytest.approx(value / cores)
    if cores > 1:
        assert f"x 1/{cores} cores" in env["peak_flops_source"]
    assert (read_table(tmp_path / "r", "steps")["mfu"] > 0).all()
