"""`moeguard app` takes its Streamlit child down with it (issue #31, item 8): after SIGTERM,
SIGINT or even SIGKILL of `moeguard app`, the child is gone and the port is free for a restart
(before, `kill PID` left the child serving and a restart said "Port 8599 is not available")."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers_http import free_port, wait_http, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) serves nothing
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a restarted server would (TIME_WAIT)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_stopping_moeguard_app_stops_streamlit_and_frees_the_port(
    tmp_path: Path, sig: signal.Signals
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    port = free_port()
    cmd = [sys.executable, "-m", "guard", "app", "--runs", str(runs), "--port", str(port)]
    log = open(tmp_path / "app.log", "w")  # noqa: SIM115 (closed below)
    app = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    child = None
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", timeout=90)
        (child,) = wait_until(lambda: children(app.pid), timeout=10, what="the streamlit child")
        app.send_signal(sig)
        code = app.wait(timeout=30)
        wait_until(
            lambda: not alive(child), timeout=20, what=f"streamlit child {child} to exit after {sig.name}"
        )
        wait_until(lambda: port_free(port), timeout=10, what=f"port {port} to be free")
        if sig != signal.SIGKILL:
            assert code == 128 + sig, (code, (tmp_path / "app.log").read_text()[-2000:])
    finally:
        for pid in (app.pid, child):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        app.wait(timeout=10)
        log.close()
        time.sleep(0)  # nothing left running
