"""Host utilisation beside the steps (issue #40): guard/runtime/host.py samples off the training
thread into the run store's `host` table, for GuardedStep and `moeguard train` alike."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from guard.api import GuardedStep
from guard.core import schema
from guard.runtime.host import HostSampler
from guard.store.reader import read_table


def test_a_sample_needs_a_finished_step_and_reads_the_process() -> None:
    rows: list[dict] = []
    s = HostSampler(rows.append, every_s=3600)  # the thread sleeps; samples taken by hand here
    assert s.sample() is None  # no step yet
    s.note_step(4)
    sum(i * i for i in range(200_000))  # some CPU time to see
    row = s.sample()
    assert row is not None and row["step"] == 4 and set(row) == set(schema.HOST_COLUMNS)
    assert math.isfinite(row["cpu_pct"]) and row["cpu_pct"] > 0
    assert row["rss_bytes"] > 10 * 2**20
    assert 0 < row["host_mem_used_bytes"] <= row["host_mem_total_bytes"]
    assert row["gpu_util_pct"] is None and row["gpu_mem_used_bytes"] is None  # no CUDA device in use
    assert s.sample() is None  # same step: no second row
    s.note_step(5)
    s.close()  # the last step's sample
    assert [r["step"] for r in rows] == [5]


def test_gpu_utilisation_without_pynvml_falls_back_to_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def no_nvml(device=None):
        calls.append(device)
        raise ModuleNotFoundError("No module named 'pynvml'")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * 2**30, 8 * 2**30))
    s = HostSampler(lambda row: None, every_s=3600)
    s._cuda, s._gpu_util_ok = 0, True  # as on a host whose training thread uses cuda:0
    assert s._gpu() == {"gpu_mem_used_bytes": 2 * 2**30}
    assert s._gpu() == {"gpu_mem_used_bytes": 2 * 2**30}
    assert calls == [0]  # asked once, then memory only
    s.close()


def _loop(run: Path, steps: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with GuardedStep(model, opt, run_dir=run) as g:
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            time.sleep(0.02)
            g.step(loss, tokens=4)


def test_guarded_step_records_the_host_beside_its_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(schema.ENV_HOST_EVERY, "0.05")
    _loop(tmp_path / "r", 30)
    host = read_table(tmp_path / "r", schema.TABLE_HOST).sort("time")
    assert host.columns == list(schema.HOST_COLUMNS)
    assert 4 <= host.height <= 30  # at most once a step, about every 0.05 s of a ~0.7 s run
    assert host["step"].is_sorted() and host["step"].n_unique() == host.height
    assert host["step"].max() == 29  # the last step, sampled at close
    assert (host["rss_bytes"] > 0).all()


def test_sampling_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(schema.ENV_HOST_EVERY, "0")
    _loop(tmp_path / "r", 3)
    assert read_table(tmp_path / "r", schema.TABLE_HOST).height == 0


def test_moeguard_train_records_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import train_micro

    monkeypatch.setenv(schema.ENV_HOST_EVERY, "0.05")
    t = train_micro(tmp_path / "run", overrides={"train.steps": 12})
    assert t.exit_code == 0
    host = read_table(tmp_path / "run", schema.TABLE_HOST)
    assert host.height >= 1 and host["step"].max() == 11
