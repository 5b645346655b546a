"""Cost of one pager delivery against the size of the incident book, and the body-limit attack.

    python bench/pager_delivery.py [--sizes 100,3000] [--deliveries 300] [--e2e 100,3000]
                                   [--dir DIR] [--no-attack]

Book: an IncidentBook persisted to a state file on DIR (default: a temp dir under the repo, so
fsync reaches a disk, not tmpfs) is filled with N firing incidents (4 ranks each), then
`--deliveries` deliveries are timed, each doing what a sink worker does around its HTTP POST:
snapshot the incident, render the Slack body, record the result (which persists it). Medians
and p95 per delivery; the ratio between the largest and smallest book should be near 1.

End to end (`--e2e`): the real `python -m guard pager` with one webhook receiver (a local
HTTP server that answers 200) gets one Alertmanager webhook of N alerts for N runs; timed from
the POST until the receiver has all N, then per delivery.

Attack (skipped with `--no-attack`): a 200 MB POST with that Content-Length, then a chunked one
that streams 200 MB; the pager's answer, bytes the client got out, and the pager's peak RSS
(VmHWM) before and after.
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parent.parent))  # `python bench/x.py` from a checkout

import argparse
import json
import os
import re
import select
import selectors
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench._docs import shown_command
from guard.pager.book import IncidentBook, delivery_needed
from guard.pager.intake import FIRING, parse_alertmanager
from guard.pager.sinks import SlackSink

REPO = Path(__file__).resolve().parent.parent
ATTACK_BYTES = 200 << 20


def alert(run: str, rank: int) -> dict[str, Any]:
    labels = {"alertname": "HeartbeatLost", "run": run, "rank": str(rank), "severity": "critical"}
    return {
        "status": "firing",
        "labels": labels | {"scope": "run", "runbook_base": "https://runbooks.example/moeguard"},
        "annotations": {
            "summary": f"Heartbeat lost for run {run}",
            "description": f"No heartbeat from run {run} rank {rank} for 60 s.",
            "runbook_url": "playbooks/HeartbeatLost.md",
        },
        "startsAt": "2026-11-22T03:00:00.000Z",
        "generatorURL": "http://prometheus.example:9090/graph?g0.expr=up",
        "fingerprint": f"{run}-{rank}",
    }


def payload(alerts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"version": "4", "status": "firing", "externalURL": "http://am.example:9093", "alerts": alerts}


def bench_book(n: int, deliveries: int, workdir: Path) -> dict[str, float]:
    """Per-delivery cost (snapshot, render, record) with `n` incidents in a persisted book."""
    state = workdir / f"book-{n}" / "state.json"
    state.parent.mkdir(parents=True)
    book = IncidentBook(state)
    keys: list[str] = []
    for start in range(0, n, 100):  # Alertmanager groups of 100 incidents
        batch = [alert(f"run-{i}", r) for i in range(start, min(n, start + 100)) for r in range(4)]
        keys += book.apply(parse_alertmanager(payload(batch)), time.time())
    sink = SlackSink("http://slack.invalid/x", "")
    times = []
    for i in range(deliveries):
        key = keys[(i * 7919) % len(keys)]
        t0 = time.perf_counter()
        inc = book.snapshot(key)
        status = delivery_needed(inc, inc["sent"].get(f"s{i}")) or FIRING
        json.dumps(sink.body(inc, status))
        book.record(key, f"s{i % 3}", status if i % 5 else None, None if i % 5 else "HTTP 503")
        times.append(time.perf_counter() - t0)
    files = sum(p.stat().st_size for p in state.parent.iterdir())
    times.sort()
    return {
        "incidents": n,
        "median_ms": 1e3 * statistics.median(times),
        "p95_ms": 1e3 * times[int(0.95 * (len(times) - 1))],
        "state_bytes": files,
    }


class _Counter(BaseHTTPRequestHandler):
    got: set[str] = set()
    cond = threading.Condition()

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.cond:
            self.got.add(body["run"])
            self.cond.notify_all()
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a: Any) -> None:
        pass


def start_pager(workdir: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    cmd = [
        sys.executable,
        "-m",
        "guard",
        "pager",
        "--port",
        "0",
        "--state",
        str(workdir / "state.json"),
        "--log-level",
        "warning",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEGUARD_")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    line = proc.stdout.readline().decode() if sel.select(60) else ""
    m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"pager did not start: {line!r}")
    port = int(m.group(1))
    deadline = time.monotonic() + 30  # it prints the port, then starts serving
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def post(port: int, path: str, body: bytes, timeout: float = 600) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        return int(s.recv(4096).split(b" ", 2)[1])


def bench_e2e(n: int, workdir: Path, timeout: float) -> dict[str, float]:
    """Real pager, one webhook: one Alertmanager POST of `n` alerts (n incidents) until all delivered."""
    _Counter.got = set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    wd = workdir / f"e2e-{n}"
    wd.mkdir()
    proc, port = start_pager(wd, "--webhook-url", f"http://127.0.0.1:{server.server_address[1]}/hook")
    try:
        body = json.dumps(payload([alert(f"run-{i}", 0) for i in range(n)])).encode()
        t0 = time.perf_counter()
        status = post(port, "/v1/alertmanager", body)
        answered = time.perf_counter() - t0
        deadline = time.monotonic() + timeout
        with _Counter.cond:
            while len(_Counter.got) < n and time.monotonic() < deadline:
                _Counter.cond.wait(1.0)
            delivered = len(_Counter.got)
        total = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(10)
        server.shutdown()
    return {
        "incidents": n,
        "status": status,
        "answered_s": answered,
        "delivered": delivered,
        "total_s": total,
        "ms_per_delivery": 1e3 * total / max(1, delivered),
    }


def vm_kib(pid: int, field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) if m else -1


def send_attack(port: int, chunked: bool) -> tuple[str, int]:
    """Stream a 200 MB body; stop when the pager answers or hangs up. (answer, bytes sent)."""
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {ATTACK_BYTES}"
    sent, piece = 0, b"[" + b"0," * (1 << 19)  # ~1 MB of JSON-looking bytes
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            f"POST /v1/alertmanager HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{framing}\r\n\r\n".encode()
        )
        try:
            readable = select.select([s], [], [], 0.5)[0]  # a server that checks the header answers now
            while sent < ATTACK_BYTES and not readable:
                chunk = piece[: ATTACK_BYTES - sent]
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                sent += len(chunk)
                readable = select.select([s], [], [], 0)[0]
        except OSError:
            pass  # it hung up while we were sending: read what it said
        try:
            answer = s.recv(4096)
        except OSError as e:
            return f"connection reset ({type(e).__name__})", sent
    return answer.split(b"\r\n", 1)[0].decode(errors="replace") or "connection closed", sent


def bench_attack(workdir: Path) -> list[dict[str, Any]]:
    wd = workdir / "attack"
    wd.mkdir()
    proc, port = start_pager(wd)
    out = []
    try:
        time.sleep(1.0)
        for chunked in (False, True):
            before = vm_kib(proc.pid, "VmRSS")
            answer, sent = send_attack(port, chunked)
            time.sleep(0.5)
            out.append(
                {
                    "framing": "chunked" if chunked else "Content-Length: 200 MB",
                    "answer": answer,
                    "client_sent_mb": sent / 2**20,
                    "rss_before_mb": before / 1024,
                    "rss_after_mb": vm_kib(proc.pid, "VmRSS") / 1024,
                    "peak_rss_mb": vm_kib(proc.pid, "VmHWM") / 1024,
                }
            )
    finally:
        proc.terminate()
        proc.wait(10)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,3000", help="book sizes, incidents")
    ap.add_argument("--deliveries", type=int, default=300, help="timed deliveries per size")
    ap.add_argument("--e2e", default="100,3000", help="incidents per end-to-end webhook ('' to skip)")
    ap.add_argument("--e2e-timeout", type=float, default=300.0)
    ap.add_argument("--no-attack", action="store_true")
    ap.add_argument("--dir", type=Path, default=None, help="work dir on the disk under test")
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="pager-bench-", dir=args.dir or REPO))
    try:
        book = [bench_book(int(n), args.deliveries, workdir) for n in args.sizes.split(",")]
        e2e = [bench_e2e(int(n), workdir, args.e2e_timeout) for n in args.e2e.split(",") if n]
        attack = [] if args.no_attack else bench_attack(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res = {"book": book, "e2e": e2e, "attack": attack}
    print(markdown(res, shown_command("bench/pager_delivery.py", argv or sys.argv[1:])))
    return res


def markdown(res: dict[str, Any], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| incidents in book | per delivery, median | p95 | state on disk |",
        "|---|---|---|---|",
    ]
    for b in res["book"]:
        lines.append(
            f"| {b['incidents']} | {b['median_ms']:.2f} ms | {b['p95_ms']:.2f} ms | {b['state_bytes'] / 1e6:.2f} MB |"
        )
    if len(res["book"]) > 1:
        lo, hi = res["book"][0], res["book"][-1]
        lines.append(
            f"\nratio {hi['incidents']}/{lo['incidents']} incidents: {hi['median_ms'] / lo['median_ms']:.2f}x"
        )
    if res["e2e"]:
        lines += [
            "",
            "| webhook of N alerts | answered | delivered | total | per delivery |",
            "|---|---|---|---|---|",
        ]
        for e in res["e2e"]:
            lines.append(
                f"| {e['incidents']} | HTTP {e['status']} in {e['answered_s']:.2f} s | {e['delivered']} | "
                f"{e['total_s']:.2f} s | {e['ms_per_delivery']:.2f} ms |"
            )
    if res["attack"]:
        lines += [
            "",
            "| 200 MB POST | answer | client got out | RSS before | RSS after | peak RSS |",
            "|---|---|---|---|---|---|",
        ]
        for a in res["attack"]:
            lines.append(
                f"| {a['framing']} | {a['answer']} | {a['client_sent_mb']:.1f} MB | {a['rss_before_mb']:.0f} MB | "
                f"{a['rss_after_mb']:.0f} MB | {a['peak_rss_mb']:.0f} MB |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
