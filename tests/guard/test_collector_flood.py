"""The collector under a connection flood (issue #32, item 1): a cap below the open-files limit
with a share kept for authenticated clients, a header deadline, the limit raised or named at
start, and repeated log lines counted instead of written.

The flood runs against a real collector process whose open-files limit is 1,024 (soft and hard,
set in the child before it starts), as on most hosts.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import resource
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from guard.collector.lograte import RepeatFilter
from guard.store.reader import read_table
from guard.wire.conn_guard import ConnectionBudget, http_stack
from tests.helpers_collector import AUTH, CollectorProc, batch, make_report

G1 = 1_700_000_000 << 32
# uvicorn's two HTTP/1.1 stacks, each under the budget and the header deadline (conn_guard.py)
STACKS = [
    ("h11", "asyncio"),
    pytest.param(
        "httptools",
        "asyncio",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("httptools") is None,
            reason="httptools not installed (the collector extra brings it)",
        ),
    ),
]


def _body(*a: object) -> bytes:
    return json.dumps(batch(*a)).encode()  # type: ignore[arg-type]


@contextmanager
def collector_under(
    tmp_path: Path, *flags: str, log: Path, nofile: tuple[int, int] = (1024, 1024)
) -> Iterator[CollectorProc]:
    """A real collector whose open-files limit is `nofile` (soft, hard; 1,024 both by default, as
    on many hosts), set in the child before it starts."""
    c = CollectorProc(tmp_path / "runs", "--log-level", "info", *flags, stderr=log)
    real = subprocess.Popen
    limit = functools.partial(resource.setrlimit, resource.RLIMIT_NOFILE, nofile)
    subprocess.Popen = functools.partial(real, preexec_fn=limit)  # type: ignore[misc]
    try:
        c.start()
    finally:
        subprocess.Popen = real  # type: ignore[misc]
    try:
        yield c
    finally:
        c.stop()


def idle_sockets(port: int, n: int) -> list[socket.socket]:
    """`n` connections that never send a byte (this process's own open-files limit raised for them)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < n + 200:
        pytest.skip(f"this process may open {hard} files, the flood needs {n + 200}")
    if soft != resource.RLIM_INFINITY and soft < n + 200:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (n + 200 if hard == resource.RLIM_INFINITY else min(hard, 4096), hard)
        )
    out = []
    for _ in range(n):
        out.append(socket.create_connection(("127.0.0.1", port), timeout=10))
    return out


@pytest.mark.integration
@pytest.mark.parametrize(("http", "loop"), STACKS)
def test_an_idle_connection_flood_under_1024_files_takes_nothing_down(
    tmp_path: Path, http: str, loop: str
) -> None:
    """1,100 idle connections (no credentials) while an exporter streams: its batches, a new
    authenticated client and /healthz are all answered; nothing is quarantined; the log stays small."""
    log = tmp_path / "collector.log"
    with collector_under(tmp_path, "--http", http, "--loop", loop, log=log) as c:
        exporter = httpx.Client(headers=AUTH, timeout=5)  # one keep-alive connection, as a rank has
        assert (
            exporter.post(
                f"{c.url}/v1/ingest", content=_body("flood", 0, G1 | 1, [make_report(0)])
            ).status_code
            == 200
        )
        flood = idle_sockets(c.port, 1100)
        try:
            time.sleep(0.5)
            answers = [
                exporter.post(
                    f"{c.url}/v1/ingest", content=_body("flood", 0, G1 | (n + 1), [make_report(n)])
                ).status_code
                for n in range(1, 6)
            ]
            fresh = httpx.post(
                f"{c.url}/v1/ingest",
                content=_body("fresh-run", 0, G1 | 1, [make_report(0)]),
                headers=AUTH,
                timeout=5,
            )
            health = httpx.get(f"{c.url}/healthz", timeout=5)
        finally:
            for s in flood:
                s.close()
            exporter.close()
        assert answers == [200] * 5
        assert fresh.status_code == 200, fresh.text
        assert health.status_code == 200 and health.json()["quarantined"] == 0
        conns = health.json()["connections"]
        # 1,024 files cannot hold the default 16,384 ranks and 1,000 runs' logs: half to connections
        assert conns["cap"] == 512 and conns["kept_for_authenticated"] == 256 and conns["closed_for_room"] > 0
    assert read_table(c.runs / "flood", "steps")["step"].to_list() == [0, 1, 2, 3, 4, 5]
    text = log.read_text()
    assert "connections capped at 512" in text and "soft limit 1024" in text  # the line at start
    assert text.count("hard limit (ulimit -Hn) is 1024, enough for 256 ranks") == 1  # and its warning
    assert log.stat().st_size < 200_000


@pytest.mark.integration
@pytest.mark.parametrize(("http", "loop"), STACKS)
def test_a_request_head_must_arrive_before_the_header_deadline(tmp_path: Path, http: str, loop: str) -> None:
    """A connection that sends nothing, and one that trickles its headers, are closed after
    --header-timeout; a kept-alive connection may idle longer between requests."""
    flags = ("--header-timeout", "1", "--http", http, "--loop", loop)
    with collector_under(tmp_path, *flags, log=tmp_path / "collector.log") as c:
        silent = socket.create_connection(("127.0.0.1", c.port), timeout=10)
        slow = socket.create_connection(("127.0.0.1", c.port), timeout=10)
        slow.sendall(b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\n")
        kept = httpx.Client(headers=AUTH, timeout=5)
        assert kept.get(f"{c.url}/healthz").status_code == 200
        t0 = time.monotonic()
        closed_after = None
        while time.monotonic() - t0 < 6:
            try:
                slow.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed_after = time.monotonic() - t0
                break
            time.sleep(0.2)
        silent.settimeout(5)
        assert silent.recv(1) == b""  # closed by the server, no answer
        assert closed_after is not None and closed_after < 5
        assert kept.get(f"{c.url}/healthz").status_code == 200  # idled 1 s+ between requests: kept
        kept.close()
        silent.close()
        slow.close()


class _Proto:
    def __init__(self, idle: bool = True) -> None:
        self.is_idle, self.closed = idle, False

    def idle(self) -> bool:
        return self.is_idle

    def close_idle(self) -> None:
        self.closed = True


def test_the_budget_keeps_a_share_for_authenticated_connections() -> None:
    b = ConnectionBudget(8)  # 4 kept for authenticated connections, 4 for anyone
    trusted = [_Proto(idle=True) for _ in range(4)]
    for i, p in enumerate(trusted):
        assert b.admit(("t", i), p)
        b.trust(("t", i))
    flood = [_Proto() for _ in range(10)]
    for i, p in enumerate(flood):
        assert b.admit(("f", i), p)  # each past the share closes the oldest idle unauthenticated one
    assert not any(p.closed for p in trusted)
    assert [p.closed for p in flood] == [True] * 6 + [False] * 4
    for i in range(6):
        b.gone(("f", i), flood[i])
    busy = [_Proto(idle=False) for _ in range(4)]
    for i in range(4):
        b.gone(("f", 6 + i), flood[6 + i])
    for i, p in enumerate(busy):
        assert b.admit(("b", i), p)
    assert not b.admit(("late", 0), _Proto())  # nothing idle to close: refused at the door (503)
    assert b.refused == 1


def test_repeated_log_lines_are_counted_not_written(caplog: pytest.LogCaptureFixture) -> None:
    f = RepeatFilter(burst=3, window_s=0.3)
    lg = logging.getLogger("moeguard.test.repeat")
    lg.addFilter(f)
    try:
        with caplog.at_level(logging.WARNING, logger="moeguard.test.repeat"):
            for i in range(100):
                lg.warning("accept failed on socket %d", i)
            time.sleep(0.35)
            lg.warning("accept failed on socket %d", 100)
    finally:
        lg.removeFilter(f)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 4
    assert "and 97 more like this" in msgs[-1]


@pytest.mark.parametrize(
    "flag",
    [
        ("--max-connections", "2"),
        ("--max-connections", "99999999"),
        ("--header-timeout", "0"),
        ("--rank-capacity", "0"),
    ],
)
def test_bad_connection_flags_are_one_line_exit_2(tmp_path: Path, flag: tuple[str, str]) -> None:
    import os
    import sys

    env = {**os.environ, "MOEGUARD_TOKEN": "t"}
    cmd = [sys.executable, "-m", "guard", "collector", "--port", "0", "--runs", str(tmp_path / "runs"), *flag]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and flag[0] in lines[0], (p.returncode, lines)


def test_the_stack_is_httptools_when_installed_and_asyncio_unless_uvloop_is_named() -> None:
    has = {m: importlib.util.find_spec(m) is not None for m in ("httptools", "uvloop")}
    assert http_stack() == ("httptools" if has["httptools"] else "h11", "asyncio")
    assert http_stack("h11", "asyncio") == ("h11", "asyncio")
    if has["uvloop"]:
        assert http_stack("auto", "uvloop")[1] == "uvloop"
    else:
        with pytest.raises(ValueError, match="--loop uvloop: not installed"):
            http_stack("auto", "uvloop")
