"""A canary's worker process dies with the canary: a stopped or crashed canary must not leave a
worker training on the cores the next measurement needs (seen: killing `moeguard canary --ab`
left its worker running for the rest of its window, in the next canary's first pair)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.parametrize("stable_layout", [True, False])
def test_killing_the_canary_kills_its_worker(tmp_path: Path, stable_layout: bool) -> None:
    pid_file = tmp_path / "worker.pid"
    worker_code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    canary_code = textwrap.dedent(
        f"""
        from guard.canary.measure import spawn_measurement
        spawn_measurement({{}}, 120, 1, {stable_layout}, worker=("-c", {worker_code!r}))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    canary = subprocess.Popen([sys.executable, "-c", canary_code], env=env)
    worker = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()):
            assert canary.poll() is None, "the canary exited before its worker started"
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        assert _alive(worker)
        canary.send_signal(signal.SIGKILL)  # the worst case: no handler, no cleanup in the parent
        canary.wait(10)
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker), f"worker {worker} outlived its canary"
    finally:
        if canary.poll() is None:
            canary.kill()
        if worker is not None and _alive(worker):  # a failed run leaves no sleeper behind
            os.kill(worker, signal.SIGKILL)
