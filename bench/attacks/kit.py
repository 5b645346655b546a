"""What every attack needs: the real `moeguard collector` in a temp dir on
loopback, a recording receiver, raw-socket requests, and the ledger of acknowledged rows that
decides "rows lost" (read back through guard/store/reader.py, the one run-store reader).

Writes docs/BENCHMARKS.md: no section of its own; part of Collector › Collector and pager under
attack (issues #13 and #32, `bench/attacks/collector_attacks.py`).
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np

from guard.collector.config import STATE_DIR, STATE_FILE, SUPERSEDED_DIR
from guard.core import schema
from guard.core.report import StepReport
from guard.store.reader import read_table

REPO = Path(__file__).resolve().parents[2]
TOKEN = "attack-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
G1, G2 = 1_700_000_000 << 32, 1_700_000_100 << 32  # exporter generations (start second << 32)


@dataclass(kw_only=True, slots=True)
class Row:
    """One line of the table: an attack and how the service took it."""

    attack: str  # its --only name
    item: str  # the issue #13 defect it replays ("1" .. "10"), or "held" / "control"
    what: str  # the attack, in words
    answer: str  # what the service answered, in words
    up: bool = False  # still serving at the end
    lost: int = 0  # acknowledged rows missing afterwards
    twice: int = 0  # rows stored more than once
    held: bool = False  # answered as designed
    quarantined_after: int = 0  # runs still quarantined once the condition cleared (issue #32)
    p99_ms: float = -1.0  # client p99 latency during a flood (-1: not measured here)


class Down(RuntimeError):
    """The service under attack did not start, or died."""


# ---------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------
def report(
    step: int, loss: float | None = None, layers: int = 4, experts: int = 8, rank: int = 0
) -> StepReport:
    """A small MoE report (every other layer MoE), deterministic per step."""
    rng = np.random.default_rng(step)
    moe = np.arange(1, layers, 2, dtype=np.int32)
    m = len(moe)
    return StepReport(
        step=step,
        time=time.time(),
        loss=2.0 + 0.01 * rng.random() if loss is None else loss,
        grad_norm=1.0,
        lr=1e-3,
        tokens=4096,
        step_time_s=0.1,
        data_wait_s=0.001,
        tokens_per_s=40960.0,
        mfu=0.4,
        mem_peak_bytes=1 << 30,
        rank=rank,
        layer_ids_L=np.arange(layers, dtype=np.int32),
        layer_grad_norm_L=0.1 + 0.01 * rng.random(layers),
        moe_layer_ids_M=moe,
        router_entropy_M=np.full(m, 1.5),
        load_entropy_M=np.full(m, 0.95),
        maxvio_M=np.full(m, 0.1),
        dead_experts_M=np.zeros(m, np.int32),
        bias_norm_M=np.full(m, 0.01),
        load_ME=rng.integers(90, 110, (m, experts)),
        bias_ME=np.zeros((m, experts)),
    )


def batch(
    run: str,
    seq: int,
    steps: Iterable[int],
    events: Iterable[dict[str, Any]] = (),
    *,
    rank: int = 0,
    loss: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """An ingest batch (guard/wire/batch.py) as a JSON-ready dict; `extra`: more top-level fields."""
    reps = [report(s, loss, rank=rank).to_json() for s in steps]
    return {"run": run, "rank": rank, "seq": seq, "reports": reps, "events": list(events), **extra}


def halt(step: int) -> dict[str, Any]:
    return {"step": step, "kind": schema.EV_HALT, "action": schema.ACT_HALT, "detail": {"reason": "attack"}}


# ---------------------------------------------------------------------------------------
# the ledger: what was acknowledged, and whether the run store still has it
# ---------------------------------------------------------------------------------------
class Ledger:
    """Rank-0 steps and events of every batch answered 200 (not duplicate), per run."""

    def __init__(self) -> None:
        self.steps: dict[str, set[int]] = defaultdict(set)
        self.events: dict[str, Counter[tuple[int, str]]] = defaultdict(Counter)

    def ack(self, payload: dict[str, Any]) -> None:
        run = payload["run"]
        if payload["rank"] == 0:
            self.steps[run].update(r["step"] for r in payload.get("reports", []))
        self.events[run].update((e["step"], e["kind"]) for e in payload.get("events", []))

    def post(self, c: CollectorProc, payload: dict[str, Any]) -> httpx.Response:
        r = c.ingest(payload)
        if r.status_code == 200 and r.json().get("duplicate") is False:
            self.ack(payload)
        return r

    def check(self, runs_dir: Path) -> tuple[int, int]:
        """(rows lost, rows stored twice): acknowledged rows found neither in the live tables nor
        among the rows a newer writer superseded (kept in .collector/superseded/), and rows the
        live tables hold more than once. Read after the collector stopped."""
        lost = twice = 0
        for run in sorted(set(self.steps) | set(self.events)):
            stores = [runs_dir / run, *_superseded(runs_dir / run)]
            live = read_table(stores[0], schema.TABLE_STEPS)["step"].to_list()
            kept = {s for d in stores for s in read_table(d, schema.TABLE_STEPS)["step"].to_list()}
            lost += len(self.steps[run] - kept)
            twice += len(live) - len(set(live))
            live_ev = _event_keys(stores[0])
            kept_ev = sum((_event_keys(d) for d in stores), Counter())
            for key, n in self.events[run].items():
                lost += max(0, n - kept_ev[key])
                twice += max(0, live_ev[key] - n)
        return lost, twice

    def rows(self) -> int:
        return sum(len(s) for s in self.steps.values()) + sum(sum(c.values()) for c in self.events.values())


def _superseded(run_dir: Path) -> list[Path]:
    d = run_dir / STATE_DIR / SUPERSEDED_DIR
    return sorted(p for p in d.iterdir() if p.is_dir()) if d.is_dir() else []


def _event_keys(store: Path) -> Counter[tuple[int, str]]:
    return Counter(read_table(store, schema.TABLE_EVENTS).select("step", "kind").rows())


# ---------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------
def _service_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEGUARD_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


_STARTED: list[subprocess.Popen[bytes]] = []  # every service process started, for stop_all()


def _spawn(cmd: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, **kw)
    _STARTED.append(proc)
    return proc


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def stop_all() -> int:
    """Stop every service process an attack left running (one that failed half-way); how many."""
    left = [p for p in _STARTED if p.poll() is None]
    for p in left:
        _stop(p, 30)
    _STARTED.clear()
    return len(left)


def _copy(src: IO[bytes], dst: Path) -> None:
    """The service's output into its log file, written by this process: a file-size limit
    put on the service (the I/O attacks) must not cut its log short."""
    with open(dst, "ab") as f:
        for line in iter(src.readline, b""):
            f.write(line)
            f.flush()


class _Service:
    """What a service wrapper needs: the process, its URL and liveness."""

    proc: subprocess.Popen[bytes] | None
    url: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        """Running and answering /healthz."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            return httpx.get(f"{self.url}/healthz", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False


class CollectorProc(_Service):
    """`python -m guard collector` on a free loopback port, its runs in work/runs."""

    def __init__(
        self,
        work: Path,
        *flags: str,
        token: str | None = TOKEN,
        nofile: int | None = None,
        runs: Path | None = None,
    ) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.runs, self.log, self.flags, self.token = (
            runs or work / "runs",
            work / "collector.log",
            flags,
            token,
        )
        self.nofile = nofile  # RLIMIT_NOFILE (soft and hard) of the process, as on a host with that limit
        self._port_file = work / "collector.port"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 90.0) -> CollectorProc:
        """Start and wait until it listens and its start-up scan of the run folders is done."""
        self._port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "guard", "collector", "--port", "0", "--port-file", str(self._port_file)]
        cmd += ["--runs", str(self.runs), "--log-level", "info", *self.flags]
        env = _service_env({schema.ENV_TOKEN: self.token} if self.token else {})
        nofile = self.nofile
        limit = (
            None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        )
        self.proc = _spawn(cmd, env, stderr=subprocess.STDOUT, preexec_fn=limit)
        assert self.proc.stdout is not None
        threading.Thread(target=_copy, args=(self.proc.stdout, self.log), daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Down(f"collector exited with {self.proc.returncode} at start")
            if self._port_file.is_file() and self._port_file.read_text().strip():
                self.url = f"http://127.0.0.1:{int(self._port_file.read_text())}"
                try:
                    h = httpx.get(f"{self.url}/healthz", timeout=2)
                    if h.status_code == 200 and h.json().get("pending_load", 0) == 0:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        _stop(self.proc, 5)
        raise Down(f"collector did not come up within {timeout:.0f} s")

    def stop(self) -> None:
        """SIGTERM: the collector checkpoints every run on the way out."""
        _stop(self.proc, 60)

    def kill(self) -> None:
        """SIGKILL: nothing checkpointed; the write-ahead log must hold every acknowledged batch."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def ingest(
        self, payload: dict[str, Any] | bytes, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        h = AUTH if headers is None else headers
        return httpx.post(f"{self.url}/v1/ingest", content=body, headers=h, timeout=60)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=60, **kw)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def __enter__(self) -> CollectorProc:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------
# raw requests, process limits, waiting
# ---------------------------------------------------------------------------------------
def raw_request(port: int, head: bytes, body: Iterator[bytes]) -> tuple[str, int]:
    """Send `head`, then `body` piece by piece until the server answers or hangs up.
    (its status line or what happened, body bytes sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        try:
            readable = select.select([s], [], [], 0.5)[0]  # a server that checks the header answers now
            for piece in body:
                if readable:
                    break
                s.sendall(piece)
                sent += len(piece)
                readable = select.select([s], [], [], 0)[0]
        except OSError:
            pass  # it hung up while we were sending: read what it said
        try:
            answer = s.recv(65536)
        except OSError as e:
            return f"connection reset ({type(e).__name__})", sent
    status = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    return (status.split(" ", 1)[1] if " " in status else status or "connection closed"), sent


def vm_kib(pid: int, field: str) -> int:
    """VmRSS / VmHWM (peak) of a process, KiB."""
    m = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) if m else -1


def limit_file_size(pid: int, limit: int | None) -> None:
    """RLIMIT_FSIZE of a running process (None: lift it). Past the limit its writes to regular
    files fail (EFBIG; Python ignores SIGXFSZ): a disk-full that strikes one process only."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard if limit is None else limit, hard))


def wait_until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def state_json(run_dir: Path) -> dict[str, Any]:
    """The collector's committed state of a run ({} before its first checkpoint)."""
    try:
        return json.loads((run_dir / STATE_DIR / STATE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.0f} ms" if seconds >= 0.01 else f"{1e3 * seconds:.1f} ms"
