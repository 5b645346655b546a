"""How a run ended reads the same in the job's own store and the collector's copy (issue #37: the
collector stored preempted and interrupted runs as `finished` beside the note "SIGTERM
(preemption)"). A GuardedStep loop streaming to a real collector on loopback is stopped by
SIGTERM, by Ctrl-C (SIGINT), or runs to its end; the peer_lost endings under torchrun are drilled
by tests/integration/test_paging_drills.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard.core import schema
from guard.store.reader import read_meta
from tests.conftest import REPO
from tests.helpers_collector import TOKEN, CollectorProc
from tests.helpers_http import wait_until

LOOP = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {repo!r})
    from guard.api import GuardedStep
    from tests.guard.test_api import Net
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with GuardedStep(model, opt, run_dir={run_dir!r}, collector={url!r}) as guarded:
        for step in range({steps}):
            x, y = torch.randn(64, 16), torch.randn(64)
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            guarded.step(loss, tokens=64)
            if step == 5:
                print("ready", flush=True)
    """
)


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[CollectorProc]:
    c = CollectorProc(tmp_path / "collector-runs").start()
    yield c
    c.stop()


def loop(tmp_path: Path, collector: CollectorProc, run: str, steps: int) -> subprocess.Popen:
    code = LOOP.format(repo=str(REPO), run_dir=str(tmp_path / run), url=collector.url, steps=steps)
    env = {**os.environ, schema.ENV_TOKEN: TOKEN}
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


@pytest.mark.parametrize(
    ("sig", "status", "code"),
    [
        (signal.SIGTERM, schema.STATUS_PREEMPTED, 143),
        (signal.SIGINT, schema.STATUS_INTERRUPTED, -signal.SIGINT),  # Python re-raises Ctrl-C
        (None, schema.STATUS_FINISHED, 0),
    ],
)
def test_the_job_and_the_collector_store_the_same_ending(
    tmp_path: Path, collector: CollectorProc, sig: signal.Signals | None, status: str, code: int
) -> None:
    run = f"ends-{status}"
    p = loop(tmp_path, collector, run, steps=100_000 if sig else 12)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    if sig is not None:
        p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == code, err[-2000:]
    job = read_meta(tmp_path / run)
    assert job["status"] == status, job
    copy = collector.runs / run / schema.META_FILE

    def same() -> bool:
        m = read_meta(copy.parent) if copy.is_file() else None
        return bool(m) and (m["status"], m.get("status_note", "")) == (status, job.get("status_note", ""))

    wait_until(same, timeout=30, what=f"the collector's meta.json to say {status}")
