"""Issue #32's attacks: a connection flood under a 1,024 open-files limit, descriptors and disk
running out mid-run, skewed trainer clocks, and inputs that must be refused at the edge.

Each returns a Row; `quarantined_after` counts runs still quarantined once the condition cleared,
`p99_ms` the client p99 latency measured during a flood.

Writes docs/BENCHMARKS.md: no section of its own; part of Collector › Collector and pager under
attack (issues #13 and #32, `bench/attacks/collector_attacks.py`).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import select
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.attacks.kit import (
    AUTH,
    G1,
    TOKEN,
    CollectorProc,
    Ledger,
    Row,
    batch,
    report,
    wait_until,
)
from guard.core import schema
from guard.runtime.exporter import Exporter, ExporterConfig
from guard.store.reader import read_table

FLOOD = 1100  # idle connections: past the 1,024 open-files limit of the collector under attack


def _post(client: httpx.Client, ledger: Ledger, payload: dict[str, Any]) -> int:
    """POST on a kept-alive connection (as a rank does); acknowledged rows go in the ledger."""
    try:
        r = client.post("/v1/ingest", content=json.dumps(payload).encode())
    except httpx.HTTPError:
        return -1
    if r.status_code == 200 and r.json().get("duplicate") is False:
        ledger.ack(payload)
    return r.status_code


class _Flood:
    """Keeps FLOOD idle connections open, reopening the ones the collector closes."""

    def __init__(self, port: int) -> None:
        self.port, self.socks, self.closed_by_server = port, {}, 0
        self.poll = select.poll()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for fd, _ in self.poll.poll(0):
                s = self.socks.pop(fd, None)
                if s is not None:
                    self.poll.unregister(fd)
                    s.close()
                    self.closed_by_server += 1
            for _ in range(min(100, FLOOD - len(self.socks))):  # up to 1,000 new connections a second
                try:
                    s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
                except OSError:
                    break
                self.socks[s.fileno()] = s
                self.poll.register(s.fileno(), select.POLLIN | select.POLLHUP)
            self.stop.wait(0.1)

    def __enter__(self) -> _Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks.values():
            s.close()


def idle_flood_1024(work: Path) -> Row:
    """1,100 idle connections (reopened as the collector closes them) under a 1,024 open-files
    limit while a real exporter streams 200 steps and a rank and a prober measure latency."""
    c = CollectorProc(work, nofile=1024).start()
    ledger, took, statuses = Ledger(), {"rank": [], "new": []}, {"rank": Counter(), "new": Counter()}
    own_limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(own_limit[0], min(own_limit[1], 8192)), own_limit[1]))
    exp = Exporter(c.url, TOKEN, "streamed", 0, work / "spool", ExporterConfig(heartbeat_s=1.0, poll_s=1e9))
    rank = httpx.Client(base_url=c.url, headers=AUTH, timeout=10)
    try:
        with _Flood(c.port) as flood:
            # in full swing: half the flood connected, counting those the collector already closed
            # to make room (under its cap only ~half of it is open at once: conn_guard.py)
            wait_until(
                lambda: len(flood.socks) + flood.closed_by_server >= FLOOD // 2, 30, "the flood to connect"
            )
            for step in range(200):
                exp.submit(report(step))
                t0 = time.perf_counter()
                statuses["rank"][_post(rank, ledger, batch("probe", G1 | (step + 1), [step]))] += 1
                took["rank"].append(time.perf_counter() - t0)
                if step % 10 == 0:  # a new client on a fresh connection (Prometheus, an operator)
                    t0 = time.perf_counter()
                    try:
                        statuses["new"][httpx.get(f"{c.url}/healthz", timeout=10).status_code] += 1
                    except httpx.HTTPError as e:
                        statuses["new"][type(e).__name__] += 1
                    took["new"].append(time.perf_counter() - t0)
                time.sleep(0.05)
            closed = flood.closed_by_server
            delivered = exp.flush(60)
        up = c.alive()
    finally:
        exp.close(30)
        rank.close()
        c.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, own_limit)
    lost, twice = ledger.check(c.runs)
    streamed = read_table(c.runs / "streamed", schema.TABLE_STEPS)["step"].to_list()
    lost += 200 - len(set(streamed))
    twice += len(streamed) - len(set(streamed))
    p99 = {k: float(np.percentile(v, 99)) * 1e3 for k, v in took.items()}
    log_mb = c.log.stat().st_size / 1e6
    ok = all(st[200] == sum(st.values()) for st in statuses.values())
    said = {k: ", ".join(f"{n} x {a}" for a, n in sorted(v.items(), key=str)) for k, v in statuses.items()}
    return Row(
        attack="idle_flood_1024",
        item="32.1",
        what=f"{FLOOD:,} idle connections, reopened as closed, under a 1,024 open-files limit while an exporter streams",
        answer=f"exporter {len(set(streamed))}/200 steps stored (flushed: {delivered}); a rank's kept-alive "
        f"connection: {said['rank']}, p99 {p99['rank']:.0f} ms; new connections: {said['new']}, p99 "
        f"{p99['new']:.0f} ms; {closed:,} flood connections closed by the collector; log {log_mb:.2f} MB",
        up=up,
        lost=lost,
        twice=twice,
        held=up and ok and lost == 0 and max(p99.values()) < 1000,
        p99_ms=max(p99.values()),
    )


def emfile_mid_run(work: Path) -> Row:
    """300 new runs while the collector's open-files limit is cut to what it has open + 8, then
    lifted; every refused batch retried as an exporter would."""
    c = CollectorProc(work).start()
    ledger, first, queue = Ledger(), Counter(), []
    client = httpx.Client(base_url=c.url, headers=AUTH, timeout=10)
    try:
        assert _post(client, ledger, batch("warm", G1 | 1, [0])) == 200  # the connection is open first
        soft, hard = resource.prlimit(c.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(c.pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{c.pid}/fd")) + 8, hard))
        for i in range(300):
            payload = batch(f"emfile-{i:03d}", G1 | 1, [0, 1])
            status = _post(client, ledger, payload)
            first[status] += 1
            if status != 200:
                queue.append(payload)
        quarantined_while = httpx.get(f"{c.url}/healthz", timeout=10).json()["quarantined"]
        resource.prlimit(c.pid, resource.RLIMIT_NOFILE, (soft, hard))  # the condition clears
        deadline = time.monotonic() + 60
        while queue and time.monotonic() < deadline:
            queue = [p for p in queue if _post(client, ledger, p) != 200]
            time.sleep(0.2 if queue else 0)
        quarantined = httpx.get(f"{c.url}/healthz", timeout=10).json()["quarantined"]
        up = c.alive()
    finally:
        client.close()
        c.stop()
    lost, twice = ledger.check(c.runs)
    answers = ", ".join(f"{n} x {s}" for s, n in sorted(first.items()))
    return Row(
        attack="emfile_mid_run",
        item="32.2",
        what="300 new runs while the collector is out of file descriptors (EMFILE), then the limit is lifted",
        answer=f"first answers {answers}; quarantined meanwhile {quarantined_while}; after the limit was "
        f"lifted {300 - len(queue)}/300 runs stored, {quarantined} quarantined",
        up=up,
        lost=lost + len(queue),
        twice=twice,
        held=up and not queue and quarantined == 0 and quarantined_while == 0,
        quarantined_after=quarantined,
    )


def _mount_tmpfs(mnt: Path, size: str) -> bool:
    mnt.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    return p.returncode == 0


def _fill(path: Path) -> int:
    """Write `path` until the disk is full; bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(b"\0" * (256 << 10))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return n


def enospc_tmpfs(work: Path) -> Row:
    """The runs on a 32 MB tmpfs that fills up mid-run (10 streaming runs, 10 first seen while
    full), then space is freed; each run's batches retried in order, as its exporter would."""
    mnt = work / "tmpfs"
    if not _mount_tmpfs(mnt, "32m"):
        return Row(
            attack="enospc_tmpfs",
            item="32.2",
            what="a full disk (needs a tmpfs mount: root)",
            answer="skipped: could not mount a tmpfs here (not root?); io_error_* rows use RLIMIT_FSIZE",
            up=True,
            lost=-1,
        )
    c = CollectorProc(work, "--checkpoint-interval", "0.2", runs=mnt / "runs").start()
    ledger, first = Ledger(), Counter()
    client = httpx.Client(base_url=c.url, headers=AUTH, timeout=10)
    queues: dict[str, list[dict[str, Any]]] = {}
    try:
        for r in range(10):
            assert _post(client, ledger, batch(f"disk-{r}", G1 | 1, [0])) == 200
        filled = _fill(mnt / "filler")
        for r in range(20):  # 10 runs streaming, 10 first seen while the disk is full
            queues[f"disk-{r}"] = [batch(f"disk-{r}", G1 | (s + 1), [s]) for s in range(1, 31)]
        for _ in range(30):
            for q in queues.values():
                if q:
                    status = _post(client, ledger, q[0])
                    first[status] += 1
                    if status == 200:
                        q.pop(0)
        left_while_full = sum(map(len, queues.values()))
        (mnt / "filler").unlink()  # space is freed
        deadline = time.monotonic() + 60
        while any(queues.values()) and time.monotonic() < deadline:
            for q in queues.values():
                while q and _post(client, ledger, q[0]) == 200:
                    q.pop(0)
            time.sleep(0.2)
        time.sleep(1.0)  # a few checkpoints
        quarantined = httpx.get(f"{c.url}/healthz", timeout=10).json()["quarantined"]
        up = c.alive()
    finally:
        client.close()
        c.stop()
    lost, twice = ledger.check(c.runs)
    lost += sum(map(len, queues.values()))
    temps = [p for p in c.runs.rglob("*") if ".tmp" in p.name]
    short = c.log_text().count("short write")
    subprocess.run(["umount", str(mnt)], capture_output=True)
    answers = ", ".join(f"{n} x {s}" for s, n in sorted(first.items()))
    return Row(
        attack="enospc_tmpfs",
        item="32.2",
        what="a 32 MB tmpfs under the runs fills up mid-run, then space is freed",
        answer=f"while full ({filled >> 20} MB filler): {answers}, {left_while_full} batches waiting; after: all "
        f"stored: {not any(queues.values())}, {quarantined} quarantined, {len(temps)} temp files, "
        f"{short} 'short write' lines",
        up=up,
        lost=lost,
        twice=twice,
        held=up and quarantined == 0 and not temps and short == 0 and not any(queues.values()),
        quarantined_after=quarantined,
    )
