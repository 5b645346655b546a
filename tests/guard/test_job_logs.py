"""A guarded job's log under a framework's INFO root logger (torchtitan's init_logger, or
logging.basicConfig(INFO)) carries no httpx line per ingest or command poll (issue #37: 96 of a
40-step run's 217 lines), while it streams to a real collector on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from guard.core import schema
from tests.helpers_alerting import COLLECTOR_TOKEN, start_collector
from tests.helpers_http import wait_until

REPO = Path(__file__).resolve().parents[2]

JOB = textwrap.dedent(
    """
    import logging, sys, torch
    logging.basicConfig(level=logging.INFO)  # what torchtitan's init_logger does to the root logger
    from guard.api import GuardedStep
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guarded = GuardedStep(model, opt, run_dir=sys.argv[1], collector=sys.argv[2])
    x = torch.randn(16, 8)
    for _ in range(20):
        loss = model(x).pow(2).mean()
        loss.backward()
        guarded.step(loss, tokens=16)
    guarded.close()
    """
)


@pytest.mark.integration
def test_httpx_request_lines_stay_out_of_a_streaming_jobs_log(tmp_path: Path) -> None:
    c = start_collector(tmp_path, [])
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO), schema.ENV_TOKEN: COLLECTOR_TOKEN}
        p = subprocess.run(
            [sys.executable, "-c", JOB, str(tmp_path / "job-run"), c.url],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        stored = tmp_path / "collector-runs" / "job-run"
        wait_until(lambda: stored.is_dir() or None, timeout=30, what="the collector's copy of the run")
    finally:
        c.stop()
    lines = p.stderr.splitlines()
    assert not [ln for ln in lines if "HTTP Request" in ln or ln.startswith("INFO:httpx")], lines[:20]
