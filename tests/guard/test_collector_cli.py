"""`moeguard collector` as a user meets it (issue #37): a default port no common service uses,
its defaults in --help, and a port another process holds is one line and exit 2 (the collector
neither starts nor touches its runs, so nothing streams into whatever holds the port)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from guard.collector.main import DEFAULT_PORT

REPO = Path(__file__).resolve().parents[2]


def collector(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "guard", "collector", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_shows_the_defaults_and_the_port_is_not_prometheus(tmp_path: Path) -> None:
    assert DEFAULT_PORT not in (9090, 9093, 9094, 3000, 8080, 8000, 8501, 6006)  # Prometheus, AM, Grafana...
    p = collector("--help", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())  # argparse wraps lines
    assert f"(default: {DEFAULT_PORT})" in text and "(default: 127.0.0.1)" in text
    assert "(default: runs)" in text and "(default: info)" in text and "(default: 8388608)" in text


def test_a_port_in_use_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as holder:  # another service on the port, as Prometheus on 9090 was
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        p = collector(
            "--port", str(port), "--insecure-no-auth", "--runs", str(tmp_path / "runs"), cwd=tmp_path
        )
    assert p.returncode == 2, p.stderr[-3000:]
    [line] = p.stderr.strip().splitlines()
    assert line.startswith(
        f"moeguard collector: --port {port}: 127.0.0.1:{port} is in use by another process"
    )
    assert "--port 0" not in line or "--port N" in line
    assert not (tmp_path / "runs").exists()  # it stopped before touching its runs
