"""MoEGuardCallback streams like GuardedStep: the real transformers Trainer (tiny Mixtral,
bench/common/hf_trainer_job.py in its own process) with $MOEGUARD_COLLECTOR set, against a real
collector on loopback. The collector's copy of the run equals the job's own run store step for
step (actions included), its /metrics carries the run's MFU and the skip, /v1/runs its last step."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate: pip install accelerate")

from guard.core import schema  # noqa: E402
from guard.store.reader import read_meta, read_table  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.helpers_collector import AUTH, TOKEN, CollectorProc  # noqa: E402
from tests.helpers_http import wait_until  # noqa: E402

pytestmark = [pytest.mark.slow]
STEPS, SPIKE = 30, 20


def test_the_trainer_streams_its_run_to_the_collector(tmp_path: Path) -> None:
    collector = CollectorProc(tmp_path / "collector-runs", "--checkpoint-interval", "0.5").start()
    try:
        run_dir = tmp_path / "hf-stream"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            schema.ENV_COLLECTOR: collector.url,
            schema.ENV_TOKEN: TOKEN,
        }
        # clip_spikes off: the spike is skipped, an action the collector must count (the default
        # would apply it within the grad clip, no action)
        cfg = tmp_path / "skip-spikes.toml"
        cfg.write_text("[policy]\nclip_spikes = false\n")
        cmd = [
            sys.executable, str(REPO / "bench" / "common" / "hf_trainer_job.py"), "--steps", str(STEPS),
            "--out", str(tmp_path / "out"), "--run-dir", str(run_dir), "--inject", f"gradspike@{SPIKE}:1000",
            "--guard", str(cfg),
        ]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
        assert p.returncode == 0, p.stderr[-3000:]
        run = run_dir.name
        local = read_table(run_dir, schema.TABLE_STEPS).sort("step")
        assert local.height == STEPS

        def info() -> dict | None:
            r = httpx.get(f"{collector.url}/v1/runs", headers=AUTH, timeout=10).json()
            x = next((x for x in r.get("runs", []) if x.get("run") == run), None)
            return x if x is not None and x.get("last_step") == STEPS - 1 else None

        wait_until(info, timeout=60, interval=0.2, what="the run's last step at the collector")
        samples = collector.metrics()  # (name, sorted labels) -> value, via prometheus_client's parser

        def of_run(name: str, **labels: str) -> list[float]:
            want = {"run": run, **labels}
            return [v for (n, lab), v in samples.items() if n == name and want.items() <= dict(lab).items()]

        # MFU as the job computed it: a number where this CPU class has a pinned peak
        # (configs/cpu_peaks.toml), NaN (exported as such) where it has none
        local_mfu = float(local["mfu"][-1])
        mfu = of_run(schema.M_MFU)
        assert len(mfu) == 1, mfu
        if math.isnan(local_mfu):
            assert math.isnan(mfu[0])
        else:
            assert mfu[0] == pytest.approx(local_mfu) and mfu[0] > 0
        assert of_run(schema.M_ACTIONS, action="skip") == [1.0]
    finally:
        collector.stop()  # a clean stop checkpoints what it holds
    remote = read_table(tmp_path / "collector-runs" / run, schema.TABLE_STEPS).sort("step")
    assert remote["step"].to_list() == local["step"].to_list() == list(range(STEPS))
    assert remote["action"].to_list() == local["action"].to_list()
    assert local["action"][SPIKE] == schema.ACT_SKIP
    assert remote["loss"].to_list() == local["loss"].to_list()
    meta = read_meta(tmp_path / "collector-runs" / run)
    assert meta["flops_per_token"] > 0 and meta["integration"]["family"]  # the FLOP accounting streamed
