"""Helpers for the collector's tests (tests/guard/test_collector*.py, the paging and app tests):
a real `python -m guard collector` subprocess on loopback, the wire batches it takes (defined by
guard/wire/batch.py), and an in-process Collector's ingest and scrape."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import polars as pl
from prometheus_client.parser import text_string_to_metric_families

from guard.collector.config import STATE_DIR
from guard.collector.wal import Wal
from guard.core import schema
from guard.core.events import Event
from guard.core.report import StepReport
from guard.store.reader import read_table
from tests.helpers_http import wait_until

TOKEN = "test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


# ---------------------------------------------------------------------------------------
# a collector in a subprocess, and the wire batches it takes
# ---------------------------------------------------------------------------------------
def make_report(
    step: int,
    *,
    n_layers: int = 4,
    n_experts: int = 8,
    rank: int = 0,
    loss: float | None = None,
    t: float | None = None,
) -> StepReport:
    """MoE on every other layer (dense layers carry NaN routing stats)."""
    rng = np.random.default_rng(step * 1000 + rank)
    moe = np.arange(1, n_layers, 2, dtype=np.int32)
    m = len(moe)
    return StepReport(
        step=step,
        time=time.time() if t is None else t,
        loss=2.0 + 0.01 * rng.random() if loss is None else loss,
        grad_norm=1.0 + 0.01 * rng.random(),
        lr=1e-3,
        tokens=4096,
        step_time_s=0.1 + 0.001 * rng.random(),
        data_wait_s=0.001,
        tokens_per_s=40960.0,
        mfu=0.4,
        mem_peak_bytes=1 << 30,
        rank=rank,
        layer_ids_L=np.arange(n_layers, dtype=np.int32),
        layer_grad_norm_L=0.1 + 0.01 * rng.random(n_layers),
        moe_layer_ids_M=moe,
        router_entropy_M=1.5 + 0.01 * rng.random(m),
        load_entropy_M=0.95 + 0.01 * rng.random(m),
        maxvio_M=0.1 + 0.01 * rng.random(m),
        dead_experts_M=np.zeros(m, np.int32),
        bias_norm_M=0.01 * rng.random(m),
        load_ME=rng.integers(90, 110, (m, n_experts)),
        bias_ME=0.001 * rng.standard_normal((m, n_experts)),
    )


def batch(
    run: str, rank: int, seq: int, reports: list[StepReport], events: list[dict] | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "run": run,
        "rank": rank,
        "seq": seq,
        "reports": [r.to_json() for r in reports],
        "events": events or [],
        **extra,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CollectorProc:
    """`python -m guard collector` in a subprocess on a fixed port (restartable on it)."""

    def __init__(
        self,
        runs: Path,
        *args: str,
        port: int | None = None,
        token: str | None = TOKEN,
        stderr: Path | None = None,
    ) -> None:
        self.runs, self.args, self.token, self.stderr = runs, args, token, stderr
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, wait_loaded: bool = True) -> CollectorProc:
        """Start and wait until it answers (and, with wait_loaded, its start-up scan of the
        run folders is done: it listens before that)."""
        env = {k: v for k, v in os.environ.items() if k != schema.ENV_TOKEN}
        if self.token:
            env[schema.ENV_TOKEN] = self.token
        err = None if self.stderr is None else open(self.stderr, "ab")
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "guard",
                    "collector",
                    "--port",
                    str(self.port),
                    "--runs",
                    str(self.runs),
                    "--log-level",
                    "warning",
                    *self.args,
                ],
                env=env,
                stderr=err,
            )
        finally:
            if err is not None:
                err.close()  # the child has its own copy
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited with {self.proc.returncode}")
            try:
                h = httpx.get(f"{self.url}/healthz", timeout=1)
                if h.status_code == 200 and (not wait_loaded or h.json().get("pending_load", 0) == 0):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("collector did not come up")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def post(self, payload: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return httpx.post(
            f"{self.url}/v1/ingest", content=body, headers=AUTH if headers is None else headers, timeout=10
        )

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }


def wait_steps(run_dir: Path, n: int, timeout: float = 10.0) -> pl.DataFrame:
    deadline = time.monotonic() + timeout
    while True:
        df = read_table(run_dir, schema.TABLE_STEPS)
        if df.height >= n or time.monotonic() > deadline:
            return df
        time.sleep(0.05)


def tree_digest(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(d)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _all_checkpointed(runs: Path) -> bool:
    """No run holds a write-ahead-log segment: a checkpoint deletes the ones it committed."""
    return not any(Wal(d / STATE_DIR).segments() for d in runs.iterdir() if (d / STATE_DIR).is_dir())


def settled_digest(runs: Path, quiet_s: float = 0.2, timeout: float = 60) -> str:
    """tree_digest(runs) once the collector has checkpointed every batch it acknowledged and
    nothing changed for quiet_s (the upkeep after a commit). A fixed sleep is not enough: on a
    loaded 2-vCPU CI machine a checkpoint landed more than 0.3 s after its batch was acknowledged,
    inside the next check's window."""
    seen: list[str | None] = [None]

    def unchanged() -> str | None:
        digest = tree_digest(runs) if _all_checkpointed(runs) else None
        steady = digest is not None and digest == seen[-1]
        seen.append(digest)
        return digest if steady else None

    return wait_until(
        unchanged, timeout=timeout, interval=quiet_s, what=f"the collector's store under {runs} to settle"
    )


# ---------------------------------------------------------------------------------------
# the in-process collector (Collector without HTTP): ingest and scrape
# ---------------------------------------------------------------------------------------
G1, G2, G3 = 1_700_000_000 << 32, 1_700_000_100 << 32, 1_700_000_200 << 32  # exporter generations


def ingest(c: Any, payload: dict[str, Any]) -> dict[str, Any]:
    status, ans = c.ingest(json.dumps(payload).encode())
    assert status == 200, ans
    return ans


def scrape(c: Any) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(c.metrics.render().decode())
        for s in f.samples
    }


def halted(c: Any, run: str) -> float:
    return scrape(c)[("moeguard_run_halted", (("run", run),))]


def lost_series(c: Any, run: str) -> dict[str, float]:
    return {
        dict(k[1])["rank"]: v
        for k, v in scrape(c).items()
        if k[0] == "moeguard_heartbeat_lost" and dict(k[1])["run"] == run
    }


def halt_row(step: int) -> dict[str, Any]:
    return Event(
        step=step,
        kind=schema.EV_HALT,
        action=schema.ACT_HALT,
        value=2.0,
        threshold=1.0,
        detail={"severity": "critical", "reason": "2 rollbacks within 500 steps"},
    ).row()


def beat(run: str, rank: int, seq: int, step: int = 0, **extra: Any) -> dict[str, Any]:
    return {"run": run, "rank": rank, "seq": seq, "heartbeat": {"time": time.time(), "step": step}, **extra}


@contextlib.contextmanager
def in_process_collectors(runs_dir: Path, **defaults: Any) -> Iterator[Callable[..., Any]]:
    """make(**config) -> a started in-process Collector (no HTTP) over one runs folder (a second
    one is a restart); every one made is closed at the end."""
    from guard.collector.config import CollectorConfig
    from guard.collector.service import Collector

    made: list[Any] = []

    def make(**kw: Any) -> Any:
        c = Collector(CollectorConfig(runs_dir=runs_dir, token=None, **{**defaults, **kw}))
        c.start()
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
