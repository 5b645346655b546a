"""Sustained ingest rate and request latency of the real collector process, pinned to one core.

    python bench/scale/collector_ingest.py [--layers 32] [--experts 64] [--batch 10] [--clients 4]
                                     [--seconds 20] [--collector-core 0] [--client-core 1]
                                     [--collector-arg=--http=h11 ...]

The collector runs as `python -m guard collector` under `taskset -c CORE` with its defaults
(server-side detectors on, write-ahead log fdatasync'd before every 200, Parquet checkpoints
every second). The load comes from this process, pinned to another core: `--clients` threads
in a closed loop, each streaming rank-0 batches of `--batch` full StepReports for its own run
(what one trainer's exporter sends). Bodies are built from pre-serialised report templates so
the generator is not the bottleneck. Counted: numeric values (StepReport.n_values) acknowledged
per second, and request latency percentiles. At the end the collector is stopped and the run
store is checked to hold every acknowledged step exactly once. `--collector-arg` (repeatable) is
passed to the collector as it is, e.g. `--collector-arg=--http=h11 --collector-arg=--loop=asyncio`
against `--collector-arg=--http=httptools --collector-arg=--loop=uvloop` for its HTTP stack's cost
(small requests, `--layers 1 --experts 8 --batch 1 --trainer-detectors`, make the stack dominate).

Writes docs/BENCHMARKS.md › Collector › Collector ingest (`bench/scale/collector_ingest.py`) and ›
Collector HTTP stack: h11 vs httptools, asyncio vs uvloop (issue #30).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from guard.core import schema  # noqa: E402
from guard.core.report import StepReport  # noqa: E402
from guard.store.reader import read_table  # noqa: E402

TOKEN = "bench-token"


def make_report(step: int, layers: int, experts: int, rng: np.random.Generator) -> StepReport:
    moe = np.arange(layers, dtype=np.int32)  # every layer is MoE (the worst case for values/report)
    return StepReport(
        step=step,
        time=time.time(),
        loss=2.0 + 0.05 * rng.random(),
        grad_norm=1.0 + 0.05 * rng.random(),
        lr=3e-4,
        tokens=1 << 20,
        step_time_s=1.0 + 0.01 * rng.random(),
        data_wait_s=0.01,
        tokens_per_s=1e6 * (1 + 0.01 * rng.random()),
        mfu=0.4 + 0.01 * rng.random(),
        mem_peak_bytes=60 << 30,
        layer_ids_L=np.arange(layers, dtype=np.int32),
        layer_grad_norm_L=0.1 + 0.01 * rng.random(layers),
        moe_layer_ids_M=moe,
        router_entropy_M=2.0 + 0.01 * rng.random(layers),
        load_entropy_M=0.95 + 0.01 * rng.random(layers),
        maxvio_M=0.2 + 0.01 * rng.random(layers),
        dead_experts_M=np.zeros(layers, np.int32),
        bias_norm_M=0.01 * rng.random(layers),
        load_ME=rng.integers(14_000, 18_000, (layers, experts)),
        bias_ME=1e-3 * rng.standard_normal((layers, experts)),
    )


def templates(n: int, layers: int, experts: int) -> tuple[list[str], int]:
    """JSON of `n` different reports with the leading `{"step": 0` cut off, and n_values each."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        rep = make_report(0, layers, experts, rng)
        s = json.dumps(rep.to_json(), separators=(",", ":"))
        assert s.startswith('{"step":0,')
        out.append(s[len('{"step":0') :])
    return out, rep.n_values()


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process, all threads (contention-proof: work per core-second)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=10, help="reports per request")
    ap.add_argument("--clients", type=int, default=4, help="concurrent streams (one run each)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--collector-core", type=int, default=0)
    ap.add_argument("--client-core", type=int, default=1)
    ap.add_argument("--runs", default=None, help="run store dir (default: a temp dir, removed)")
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="offered load in values/s over all clients (0: closed loop, as fast as acknowledged)",
    )
    ap.add_argument(
        "--trainer-detectors",
        action="store_true",
        help="batches say the trainer runs its own detectors (the collector then runs none)",
    )
    ap.add_argument(
        "--collector-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to `moeguard collector` as it is (repeatable; write --collector-arg=--http=h11)",
    )
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="moeguard-bench-"))
    runs = Path(args.runs) if args.runs else tmp / "runs"
    port = free_port()
    env = dict(
        os.environ,
        MOEGUARD_TOKEN=TOKEN,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    cmd = [
        "taskset",
        "-c",
        str(args.collector_core),
        sys.executable,
        "-m",
        "guard",
        "collector",
        "--port",
        str(port),
        "--runs",
        str(runs),
        "--log-level",
        "warning",
        *args.collector_arg,
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)
    os.sched_setaffinity(0, {args.client_core})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("collector did not start") from None
            time.sleep(0.1)

    tpl, values_per_report = templates(16, args.layers, args.experts)
    stop_at = time.monotonic() + args.warmup + args.seconds
    measure_from = time.monotonic() + args.warmup
    lat: list[list[float]] = [[] for _ in range(args.clients)]
    done = [0] * args.clients  # reports acknowledged inside the measured window
    acked_steps = [0] * args.clients
    errors: list[str] = []

    def client(i: int) -> None:
        run = f"bench-{i}"
        step, seq = 0, 0
        interval = args.clients * args.batch * values_per_report / args.rate if args.rate else 0.0
        next_at = time.monotonic() + interval * i / max(1, args.clients)
        extra = ',"trainer_detectors":true' if args.trainer_detectors else ""
        with httpx.Client(
            headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}, timeout=30
        ) as c:
            while time.monotonic() < stop_at:
                if interval:
                    next_at += interval
                    time.sleep(max(0.0, next_at - interval - time.monotonic()))
                seq += 1
                parts = [f'{{"step":{step + k}{tpl[(step + k) % len(tpl)]}' for k in range(args.batch)]
                body = f'{{"run":"{run}","rank":0,"seq":{seq}{extra},"reports":[{",".join(parts)}]}}'.encode()
                t0 = time.monotonic()
                r = c.post(f"{url}/v1/ingest", content=body)
                t1 = time.monotonic()
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    return
                step += args.batch
                acked_steps[i] = step
                if t0 >= measure_from:
                    lat[i].append(t1 - t0)
                    done[i] += args.batch

    noop: list[float] = []

    def prober() -> None:
        """GET /healthz every 50 ms: the latency floor the machine itself imposes (scheduling)."""
        with httpx.Client(timeout=30) as c:
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                c.get(f"{url}/healthz")
                if t0 >= measure_from:
                    noop.append(time.monotonic() - t0)
                time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    threads.append(threading.Thread(target=prober))
    for t in threads:
        t.start()
    time.sleep(max(0.0, measure_from - time.monotonic()))
    cpu0 = cpu_seconds(proc.pid)
    time.sleep(max(0.0, stop_at - time.monotonic()))
    cpu1 = cpu_seconds(proc.pid)
    for t in threads:
        t.join()
    elapsed = args.seconds  # requests started inside the window; the last may end just after it
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    if errors:
        print("errors:", errors[:3])
        return 1
    lats = np.asarray([x for li in lat for x in li]) * 1e3
    reports = sum(done)
    vps = reports * values_per_report / elapsed
    stored_ok = all(
        sorted(read_table(runs / f"bench-{i}", schema.TABLE_STEPS)["step"].to_list())
        == list(range(acked_steps[i]))
        for i in range(args.clients)
    )
    load = f"offered {args.rate / 1e6:.2f} M values/s" if args.rate else "closed loop"
    dets = "trainer's own (collector runs none)" if args.trainer_detectors else "server-side DetectorSuite on"
    print(
        f"collector pinned to core {args.collector_core}; {args.clients} clients on core {args.client_core}; "
        f"{load}; detectors: {dets}"
    )
    try:
        import orjson  # noqa: F401

        parser = "orjson"
    except ImportError:
        parser = "stdlib json"
    print(f"JSON parser in the collector: {parser}")
    print(
        f"report: {args.layers} layers x {args.experts} experts = {values_per_report} values; "
        f"{args.batch} reports/request ({len(tpl[0]) * args.batch / 1e6:.2f} MB)"
    )
    cpu = cpu1 - cpu0
    print(
        f"requests: {lats.size} in {elapsed:.0f} s ({lats.size / elapsed:.0f}/s); reports/s {reports / elapsed:.0f}; "
        f"collector CPU {1e3 * cpu / max(1, lats.size):.3f} ms a request"
        + (f" ({' '.join(args.collector_arg)})" if args.collector_arg else "")
    )
    print(
        f"ingest: {vps / 1e6:.2f} M values/s wall; collector used {cpu:.1f} CPU-s in {elapsed:.0f} s "
        f"-> {reports * values_per_report / cpu / 1e6:.2f} M values per CPU-second; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"latency ms: p50 {np.percentile(lats, 50):.1f}  p90 {np.percentile(lats, 90):.1f}  "
        f"p99 {np.percentile(lats, 99):.1f}  max {lats.max():.1f}"
    )
    nl = np.asarray(noop) * 1e3
    print(
        f"no-op GET /healthz meanwhile, ms: p50 {np.percentile(nl, 50):.1f}  p99 {np.percentile(nl, 99):.1f}"
    )
    print(f"run store holds every acknowledged step exactly once: {stored_ok}")
    if not args.runs:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if stored_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
